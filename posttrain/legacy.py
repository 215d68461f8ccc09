"""Older TRL / transformers names, spellings and recipe keys, mapped to today's (TRL 1.16) behaviour.

Much training code in circulation (open-r1, alignment-handbook, tutorials) was written against TRL 0.x and
transformers 4, and TRL 1.16 itself rejects it. posttrain accepts those names here, in one module that is easy to see
and to retire, and warns ``FutureWarning`` once per old name, naming the new spelling. Where an old API's meaning
cannot be reproduced faithfully, it raises with the migration instead of guessing. README "Switching from older
TRL" is the table of everything below.

- ``ModelConfig(torch_dtype=...)`` / ``model_args.torch_dtype`` → ``dtype``.
- ``ModelConfig(trust_remote_code=...)`` / ``model_args.trust_remote_code``: TRL 1.7+ keeps ``trust_remote_code`` on
  the trainer config (``training_args.trust_remote_code``), so ``ModelConfig`` no longer declares it (declaring it
  broke ``HfArgumentParser((ScriptArguments, SFTConfig, ModelConfig))`` with "conflicting option strings"). After
  :class:`~posttrain.TrlParser` the old attribute answers with the trainer config's value.
- Trainer-config keys (Python keyword arguments, YAML recipes, ``--flags``): ``max_seq_length`` → ``max_length``,
  ``use_liger`` → ``use_liger_kernel``, ``torch_dtype`` → ``dtype`` (ModelConfig), ``warmup_ratio`` →
  ``warmup_steps`` (a value below 1 is a fraction of the training steps in transformers 5), ``overwrite_output_dir``
  (removed in transformers 5; it never changed what ``Trainer`` does, so it is accepted and kept as an attribute),
  ``max_prompt_length`` where TRL 0.28/0.29 removed it: GRPO/RLOO and DPO keep the last ``max_prompt_length`` prompt
  tokens as TRL 0.x did (a plain cut there); KTO, ORPO and CPO apply their old rule
  (:func:`fit_prompt_and_completions`: the prompt is cut only when prompt + longest completion exceed ``max_length``,
  then the completions), the old ``truncation_mode`` (``keep_end`` by default, as in TRL 0.x) choosing which prompt
  tokens stay; other configs raise.
- ``SFTConfig(packing_strategy="ffd")`` (``packing_strategy: ffd`` in a recipe): TRL 0.19's name of the packing TRL
  0.20 renamed ``"bfd"`` (the same best-fit-decreasing bins) → ``"bfd"``.
- ``torch_dtype`` inside ``model_init_kwargs`` (every trainer's model loading, the PRM trainer's too) → ``dtype``.
- ``setup_chat_format`` (ChatML tokens + template, embeddings resized), ``DataCollatorForCompletionOnlyLM`` (loss
  only after the response template) and ``get_kbit_device_map`` are the old helpers, re-implemented.
- ``posttrain.ORPOConfig`` / ``ORPOTrainer`` / ``CPOConfig`` / ``CPOTrainer`` (top level in TRL ≤ 0.28) resolve to
  ``posttrain.experimental.orpo`` / ``.cpo``.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Iterable
from typing import Any

_WARNED: set[str] = set()


def warn_once(name: str, message: str, stacklevel: int = 3) -> None:
    """``FutureWarning(message)`` the first time ``name`` is used in this process.

    ``stacklevel`` counts the frames from the caller of ``warn_once`` up to the user's line (1: the caller itself).
    """
    if name in _WARNED:
        return
    _WARNED.add(name)
    warnings.warn(message, FutureWarning, stacklevel=stacklevel + 1)


# -- trainer-config and ModelConfig keys ------------------------------------------------------------------------
# old key -> (new key, what the message says)
RENAMED_KEYS: dict[str, tuple[str, str]] = {
    "max_seq_length": ("max_length", "`max_seq_length` was renamed `max_length` (TRL 0.20)"),
    "use_liger": ("use_liger_kernel", "`use_liger` was renamed `use_liger_kernel` (TRL 0.18)"),
    "torch_dtype": ("dtype", "`torch_dtype` was renamed `dtype` (transformers 4.56, TRL 0.27)"),
}
# keys with no field of their own today, handled by `translate_config_kwargs` (`truncation_mode` only where it goes
# with `max_prompt_length`: KTO / ORPO / CPO lost both)
DROPPED_KEYS = ("warmup_ratio", "overwrite_output_dir", "max_prompt_length", "truncation_mode")
LEGACY_KEYS = (*RENAMED_KEYS, *DROPPED_KEYS)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else set()


def _is_training_config(cls: type) -> bool:
    return "output_dir" in _field_names(cls)


def _truncates_prompts(cls: type) -> bool:
    """Where TRL 0.x's ``max_prompt_length`` was a plain cut of each prompt to its last tokens, which posttrain keeps:
    GRPO/RLOO (before generation, TRL ≤ 0.27) and DPO (at tokenization, TRL ≤ 0.28), with their subclasses."""
    return bool(getattr(cls, "legacy_truncates_prompts", False))  # set on GRPOConfig, RLOOConfig and DPOConfig


def _applies_pair_rule(cls: type) -> bool:
    """Where TRL 0.x's ``max_prompt_length`` was the conditional prompt-then-completion cut, which posttrain keeps:
    KTO (``_process_tokens``), ORPO and CPO (``tokenize_row``), with their subclasses."""
    return bool(getattr(cls, "legacy_pair_prompt_rule", False))  # set on KTOConfig, ORPOConfig and CPOConfig


def fit_prompt_and_completions(
    prompt: list[int], completions: list[list[int]], max_length: int, max_prompt_length: int, truncation_mode: str
) -> tuple[list[int], list[list[int]]]:
    """TRL 0.x's KTO / ORPO / CPO truncation of one row (``completions``: the chosen and rejected, or KTO's one).

    With ``longest`` the longest completion's length, computed once: if ``len(prompt) + longest > max_length`` the
    prompt is cut to ``max_prompt_length`` tokens (its first with ``truncation_mode="keep_start"``, its last with
    ``"keep_end"``); if ``len(prompt) + longest`` still exceeds ``max_length``, every completion is cut to its first
    ``max_length - max_prompt_length`` tokens. Nothing changes when the row fits.
    """
    longest = max((len(c) for c in completions), default=0)
    if len(prompt) + longest > max_length:
        prompt = prompt[:max_prompt_length] if truncation_mode == "keep_start" else prompt[-max_prompt_length:]
    if len(prompt) + longest > max_length:
        completions = [c[: max_length - max_prompt_length] for c in completions]
    return prompt, completions


class FitPromptAndCompletions:
    """Picklable ``dataset.map`` function: :func:`fit_prompt_and_completions` on ``prompt_ids`` and the
    ``<column>_ids`` completions of a tokenized row."""

    def __init__(self, columns: Iterable[str], max_length: int, max_prompt_length: int, truncation_mode: str):
        self.columns = tuple(columns)
        self.max_length, self.max_prompt_length, self.truncation_mode = max_length, max_prompt_length, truncation_mode

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        prompt, completions = fit_prompt_and_completions(
            list(row["prompt_ids"]), [list(row[f"{c}_ids"]) for c in self.columns],
            self.max_length, self.max_prompt_length, self.truncation_mode,
        )  # fmt: skip
        return {"prompt_ids": prompt, **{f"{c}_ids": ids for c, ids in zip(self.columns, completions, strict=True)}}


def fit_tokenized_rows(dataset: Any, args: Any, name: str, columns: Iterable[str]) -> Any:
    """A tokenized KTO / ORPO / CPO dataset with TRL 0.x's ``max_prompt_length`` rule applied to ``prompt_ids`` and
    the ``<column>_ids`` completions (unchanged when the config was not given ``max_prompt_length``)."""
    rule = getattr(args, "_legacy_pair_rule", None)
    if rule is None or dataset is None:
        return dataset
    from posttrain.data.dataset_ops import map_dataset

    max_prompt_length, truncation_mode = rule
    fit = FitPromptAndCompletions(columns, args.max_length, max_prompt_length, truncation_mode)
    return map_dataset(dataset, fit, args, f"Fitting prompts to max_prompt_length={max_prompt_length} ({name})")


class KeepLastPromptTokens:
    """Picklable ``dataset.map`` function: ``prompt_ids`` cut to their last ``n`` tokens (TRL 0.x DPO's
    ``max_prompt_length``, applied right after tokenization as TRL's ``tokenize_row`` did)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"prompt_ids": list(row["prompt_ids"])[-self.n :]}


def truncate_prompt_ids(dataset: Any, args: Any, name: str) -> Any:
    """A tokenized preference dataset with TRL 0.x's ``max_prompt_length`` applied (unchanged when not given)."""
    n = getattr(args, "_legacy_max_prompt_length", None)
    if n is None or dataset is None:
        return dataset
    from posttrain.data.dataset_ops import map_dataset

    return map_dataset(dataset, KeepLastPromptTokens(n), args, f"Keeping the last {n} prompt tokens ({name})")


def _warmup_steps_from_ratio(cls_name: str, ratio: Any, warmup_steps: Any) -> float | None:
    """``warmup_steps`` for an old ``warmup_ratio`` (None: keep ``warmup_steps``, which won in transformers 4)."""
    ratio = float(ratio)
    if warmup_steps not in (None, 0, 0.0):
        warn_once(
            "warmup_ratio",
            f"{cls_name}: `warmup_ratio` was removed in transformers 5 and `warmup_steps` is set too; as in "
            "transformers 4, `warmup_steps` wins. Use only `warmup_steps` (a value below 1 is a fraction of the "
            "training steps).",
            stacklevel=4,
        )
        return None
    if not 0.0 <= ratio < 1.0:
        raise ValueError(
            f"{cls_name}: warmup_ratio={ratio} cannot be expressed in transformers 5, where `warmup_ratio` became "
            "`warmup_steps` and a value of 1 or more counts steps, not a fraction. Set `warmup_steps` to the number "
            "of warm-up steps instead."
        )
    warn_once(
        "warmup_ratio",
        f"{cls_name}: `warmup_ratio` was removed in transformers 5; use `warmup_steps={ratio}` (a value below 1 is "
        "a fraction of the training steps). posttrain maps it for you.",
        stacklevel=4,
    )
    return ratio


def translate_config_kwargs(cls: type, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Map old keyword arguments of a trainer config or ``ModelConfig`` to today's.

    Returns ``(kwargs for the constructor, attributes to set on the built instance)``. Keys the class declares
    itself are left alone (a subclass may still define ``max_seq_length``).
    """
    fields = _field_names(cls)
    if not any(key in kwargs and key not in fields for key in (*LEGACY_KEYS, "trust_remote_code")):
        return kwargs, {}
    kwargs = dict(kwargs)
    attrs: dict[str, Any] = {}
    name = cls.__name__
    for old, (new, why) in RENAMED_KEYS.items():
        if old not in kwargs or old in fields or new not in fields:
            continue
        value = kwargs.pop(old)
        if new in kwargs and kwargs[new] != value:
            raise ValueError(f"{name}: both `{old}` (the old name) and `{new}` are given; keep only `{new}`.")
        warn_once(old, f"{name}: {why}; use `{new}`. posttrain maps it for you.")
        kwargs[new] = value
    if "trust_remote_code" in kwargs and "trust_remote_code" not in fields and not _is_training_config(cls):
        value = kwargs.pop("trust_remote_code")
        warn_once(
            "ModelConfig(trust_remote_code=)",
            f"{name}(trust_remote_code=...) is deprecated: TRL 1.7+ keeps `trust_remote_code` on the trainer config "
            "(e.g. `SFTConfig(trust_remote_code=True)`, read as `training_args.trust_remote_code`).",
        )
        attrs["_legacy_trust_remote_code"] = bool(value)
    if _is_training_config(cls):
        if "warmup_ratio" in kwargs and "warmup_ratio" not in fields:
            steps = _warmup_steps_from_ratio(name, kwargs.pop("warmup_ratio"), kwargs.get("warmup_steps"))
            if steps is not None:
                kwargs["warmup_steps"] = steps
        if "overwrite_output_dir" in kwargs and "overwrite_output_dir" not in fields:
            attrs["overwrite_output_dir"] = bool(kwargs.pop("overwrite_output_dir"))
            warn_once(
                "overwrite_output_dir",
                f"{name}: `overwrite_output_dir` was removed in transformers 5. It never changed what the Trainer "
                "does (only example scripts read it), so posttrain keeps the value as an attribute; drop the key.",
            )
        mode_given = "truncation_mode" in kwargs and "truncation_mode" not in fields
        mode = kwargs.pop("truncation_mode") if mode_given else None
        if mode_given and (kwargs.get("max_prompt_length") is None or not _applies_pair_rule(cls)):
            raise ValueError(
                f"{name}: `truncation_mode` is not an option here (TRL 0.29 removed it with `max_prompt_length`: "
                "prompt and completion are truncated together to `max_length`). Remove the key."
            )
        if "max_prompt_length" in kwargs and "max_prompt_length" not in fields:
            value = kwargs.pop("max_prompt_length")
            if value is not None and _applies_pair_rule(cls):
                mode = "keep_end" if mode is None else mode  # TRL 0.x's KTO / ORPO / CPO default
                if mode not in ("keep_start", "keep_end"):
                    raise ValueError(f"{name}: truncation_mode={mode!r} is not valid. Use 'keep_end' or 'keep_start'.")
                warn_once(
                    "max_prompt_length (prompt, then completion)",  # another rule than the plain cut's warning
                    f"{name}: `max_prompt_length` was removed in TRL 0.29 (prompt and completion are now truncated "
                    "together to `max_length`). posttrain keeps TRL 0.x's rule: when prompt + longest completion "
                    f"exceed `max_length`, the prompt is cut to `max_prompt_length` tokens ({mode}), then the "
                    "completions to `max_length - max_prompt_length`. Drop the key (and `truncation_mode`) to match "
                    "TRL 1.16.",
                )
                attrs["max_prompt_length"] = int(value)
                attrs["_legacy_pair_rule"] = (int(value), mode)
            elif value is not None:
                if not _truncates_prompts(cls):
                    raise ValueError(
                        f"{name}: `max_prompt_length` was removed in TRL 0.29. Prompt and completion are now truncated "
                        "together to `max_length`, and this trainer never had TRL 0.x's prompt-only cut to reproduce. "
                        "Remove the key and set `max_length` to the whole sequence budget, or shorten long prompts in "
                        "the dataset."
                    )
                warn_once(
                    "max_prompt_length",
                    f"{name}: `max_prompt_length` was removed in TRL 0.28/0.29 (prompts are no longer cut on their "
                    "own). posttrain keeps TRL 0.x's behaviour: each prompt is cut to its last `max_prompt_length` "
                    "tokens. Drop the key (and filter long prompts from the dataset) to match TRL 1.16.",
                )
                # the attribute answers old scripts; the private one is what the trainers read (rollout settings, DPO)
                attrs["max_prompt_length"] = attrs["_legacy_max_prompt_length"] = int(value)
    return kwargs, attrs


# -- values ---------------------------------------------------------------------------------------------------------
OLD_PACKING_STRATEGIES = {"ffd": "bfd"}  # TRL 0.19 "first-fit decreasing" = TRL 0.20's "bfd", the same algorithm


def packing_strategy(value: Any, where: str) -> Any:
    """Today's name of a packing strategy: TRL 0.19's ``"ffd"`` becomes ``"bfd"`` (warned once); others unchanged."""
    if isinstance(value, str) and value in OLD_PACKING_STRATEGIES:
        new = OLD_PACKING_STRATEGIES[value]
        warn_once(
            f"packing_strategy={value}",
            f"{where}: packing_strategy={value!r} (TRL 0.19) was renamed {new!r} in TRL 0.20 (the same best-fit "
            f"decreasing packing); use {new!r}. posttrain maps it for you.",
        )
        return new
    return value


def model_init_kwargs(kwargs: dict[str, Any] | None, where: str = "model_init_kwargs") -> dict[str, Any]:
    """A copy of ``model_init_kwargs`` with transformers 4's ``torch_dtype`` as ``dtype`` (warned once); both keys
    with different values raise."""
    kwargs = dict(kwargs or {})
    if "torch_dtype" not in kwargs:
        return kwargs
    value = kwargs.pop("torch_dtype")
    if "dtype" in kwargs and kwargs["dtype"] != value:
        raise ValueError(
            f"{where}: both `torch_dtype` (the old name) and `dtype` are given ({value!r} vs {kwargs['dtype']!r}); "
            "keep only `dtype`."
        )
    warn_once(
        "model_init_kwargs.torch_dtype",
        f"{where}: `torch_dtype` was renamed `dtype` (transformers 4.56, TRL 0.27); write "
        f"`model_init_kwargs={{'dtype': {value!r}}}`. posttrain maps it for you.",
    )
    kwargs["dtype"] = value
    return kwargs


class LegacyKwargsMeta(type):
    """Metaclass of posttrain's configs: old keyword arguments are mapped by :func:`translate_config_kwargs` before
    the dataclass ``__init__`` sees them (a dataclass ``__init__`` rejects unknown keywords)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        kwargs, attrs = translate_config_kwargs(cls, kwargs)
        instance = super().__call__(*args, **kwargs)
        for key, value in attrs.items():
            object.__setattr__(instance, key, value)
        if "_legacy_pair_rule" in attrs:
            _check_pair_rule(instance)
        return instance


def _check_pair_rule(config: Any) -> None:
    """TRL 0.x's rule needs ``max_prompt_length < max_length`` (CPO checked it; ORPO and KTO produced empty or
    reversed cuts otherwise)."""
    max_prompt_length = config._legacy_pair_rule[0]
    max_length = getattr(config, "max_length", None)
    if max_length is None or max_prompt_length >= max_length:
        raise ValueError(
            f"{type(config).__name__}: max_prompt_length ({max_prompt_length}) should be strictly less than "
            f"max_length ({max_length}): TRL 0.x's rule cuts the completions to `max_length - max_prompt_length`."
        )


class LegacyConfigAttributes:
    """Reads of removed trainer-config attributes (``args.max_seq_length`` ...) answer with today's value."""

    def __getattr__(self, name: str) -> Any:
        # only called when normal lookup fails: the old names, never a declared field
        if name in RENAMED_KEYS and RENAMED_KEYS[name][0] in _field_names(type(self)):
            new, why = RENAMED_KEYS[name]
            warn_once(name, f"{type(self).__name__}: {why}; read `{new}`.", stacklevel=2)
            return getattr(self, new)
        if name == "warmup_ratio" and "warmup_steps" in _field_names(type(self)):
            warn_once(
                "warmup_ratio",
                f"{type(self).__name__}: `warmup_ratio` was removed in transformers 5; read `warmup_steps` (a value "
                "below 1 is a fraction of the training steps).",
                stacklevel=2,
            )
            steps = self.warmup_steps
            return float(steps) if 0 <= steps < 1 else 0.0
        if name == "overwrite_output_dir" and _is_training_config(type(self)):
            warn_once(
                "overwrite_output_dir",
                f"{type(self).__name__}: `overwrite_output_dir` was removed in transformers 5 (it never changed what "
                "the Trainer does); it reads False unless it was given.",
                stacklevel=2,
            )
            return False
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _trust_message(cls_name: str) -> str:
    return (
        f"`{cls_name}.trust_remote_code` is deprecated: TRL 1.7+ keeps it on the trainer config. Read "
        "`training_args.trust_remote_code` (e.g. `SFTConfig.trust_remote_code`, set with --trust_remote_code)."
    )


class LegacyModelConfigAttributes:
    """``model_args.torch_dtype`` and ``model_args.trust_remote_code`` on ``ModelConfig`` (see the module doc)."""

    _legacy_trust_remote_code: bool | None = None
    _legacy_trust_source: Any = None

    def __getattr__(self, name: str) -> Any:
        if name == "torch_dtype":
            warn_once("torch_dtype", f"{type(self).__name__}: `torch_dtype` was renamed `dtype`; read `dtype`.", 2)
            return self.dtype
        if name == "trust_remote_code":
            warn_once("model_args.trust_remote_code", _trust_message(type(self).__name__), stacklevel=2)
            return legacy_trust_remote_code(self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def legacy_trust_remote_code(model_args: Any) -> bool:
    """What an old script reading ``model_args.trust_remote_code`` gets, without a warning: the value passed to
    ``ModelConfig(trust_remote_code=...)``, else the trainer config's parsed with it by ``TrlParser``, else False."""
    explicit = vars(model_args).get("trust_remote_code", model_args._legacy_trust_remote_code)
    if explicit is not None:
        return bool(explicit)
    source = model_args._legacy_trust_source
    return bool(getattr(source, "trust_remote_code", False)) if source is not None else False


# -- TrlParser: YAML recipes and --flags ---------------------------------------------------------------------------
def _option_names(parser: Any) -> set[str]:
    return {action.dest for action in parser._actions}


def _parsed_config_types(parser: Any) -> list[type]:
    return [dc for dc in parser.dataclass_types if _is_training_config(dc)]


def translate_recipe(parser: Any, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Old keys of a YAML recipe: renamed ones become today's key when the parser has that option; the others
    (``warmup_ratio``, ``overwrite_output_dir``, ``max_prompt_length``) are returned apart, to be given to the
    trainer config's constructor by :func:`build_with_legacy`. Keys an option of the parser declares are kept."""
    options = _option_names(parser)
    config = dict(config)
    held: dict[str, Any] = {}
    for old, (new, why) in RENAMED_KEYS.items():
        if old in config and old not in options and new in options:
            value = config.pop(old)
            if new in config and config[new] != value:
                raise ValueError(f"The recipe sets both `{old}` (the old name) and `{new}`; keep only `{new}`.")
            warn_once(old, f"Recipe key {why}; use `{new}`. posttrain maps it for you.")
            config[new] = value
    if _parsed_config_types(parser):
        for old in DROPPED_KEYS:
            if old in config and old not in options:
                held[old] = config.pop(old)
    return config, held


_TRUE = {"true", "1", "yes", "y"}


def translate_argv(parser: Any, argv: Iterable[str]) -> tuple[list[str], dict[str, Any]]:
    """As :func:`translate_recipe`, for ``--old value`` / ``--old=value`` / bare ``--old`` on the command line."""
    options = _option_names(parser)
    has_config = bool(_parsed_config_types(parser))
    args = list(argv)
    out: list[str] = []
    held: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, inline = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        if key in RENAMED_KEYS and key not in options and RENAMED_KEYS[key][0] in options:
            new, why = RENAMED_KEYS[key]
            warn_once(key, f"--{key}: {why}; use --{new}. posttrain maps it for you.")
            out.append(f"--{new}{eq}{inline}")
        elif has_config and key in DROPPED_KEYS and key not in options:
            if eq:
                held[key] = inline
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                held[key] = args[i + 1]
                i += 1
            else:
                held[key] = True  # a bare flag
        else:
            out.append(arg)
        i += 1
    return out, held


def _coerce(key: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if key == "overwrite_output_dir":
        return value.strip().lower() in _TRUE
    if key == "truncation_mode":
        return value.strip()
    if value.strip().lower() in ("none", "null", ""):
        return None
    return float(value) if key == "warmup_ratio" else int(value)


def held_kwargs(parser: Any, dtype: type, held: dict[str, Any]) -> dict[str, Any]:
    """The old keys :func:`translate_recipe` / :func:`translate_argv` held back, as keyword arguments for ``dtype``
    when it is the parser's (first) trainer config, so they go through :func:`translate_config_kwargs`."""
    configs = _parsed_config_types(parser)
    if not held or not configs or dtype is not configs[0]:
        return {}
    return {key: _coerce(key, value) for key, value in held.items()}


def link_model_configs(outputs: Iterable[Any]) -> None:
    """Let each parsed ``ModelConfig``'s old ``trust_remote_code`` answer with the trainer config's value."""
    outputs = list(outputs)
    source = next((o for o in outputs if "trust_remote_code" in _field_names(type(o))), None)
    if source is None:
        return
    for output in outputs:
        if isinstance(output, LegacyModelConfigAttributes):
            object.__setattr__(output, "_legacy_trust_source", source)


# -- old helpers --------------------------------------------------------------------------------------------------
_CHATML_START, _CHATML_END = "<|im_start|>", "<|im_end|>"
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'" + _CHATML_START + "' + message['role'] + '\n' + message['content'] + '" + _CHATML_END + "' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + _CHATML_START + "assistant\n' }}{% endif %}"
)


def setup_chat_format(
    model: Any, tokenizer: Any, format: str | None = "chatml", resize_to_multiple_of: int | None = None
) -> tuple[Any, Any]:
    """TRL ≤ 0.25's helper: give ``tokenizer`` the ChatML special tokens and template and resize ``model``'s
    embeddings to match. Deprecated: use :func:`posttrain.clone_chat_template` (copy a real model's template).

    ``<|im_start|>`` becomes the BOS token, ``<|im_end|>`` the EOS and pad tokens (both added as special tokens); the
    embeddings are resized to ``len(tokenizer.vocab)`` (rounded up to ``resize_to_multiple_of``), and the model's
    config and generation config take the new BOS/EOS/pad ids. Raises when the tokenizer already has a chat
    template (set ``tokenizer.chat_template = None`` to overwrite it), as TRL did.
    """
    warn_once(
        "setup_chat_format",
        "`setup_chat_format` was removed in TRL 0.26; use `clone_chat_template(model, tokenizer, source_id)` to copy "
        "a model's chat template. posttrain still applies the ChatML format for you.",
        stacklevel=2,
    )
    if getattr(tokenizer, "chat_template", None) is not None:
        raise ValueError(
            "Chat template is already added to the tokenizer. If you want to overwrite it, please set it to None "
            "(`tokenizer.chat_template = None`) before calling setup_chat_format."
        )
    if format != "chatml":
        raise ValueError(f"Format {format!r} not available. Please use one of ['chatml'].")
    tokenizer.eos_token = _CHATML_END
    tokenizer.pad_token = _CHATML_END
    tokenizer.bos_token = _CHATML_START
    tokenizer.add_special_tokens({"additional_special_tokens": [_CHATML_START, _CHATML_END]})
    tokenizer.chat_template = _CHATML_TEMPLATE
    model.resize_token_embeddings(new_num_tokens=len(tokenizer.vocab), pad_to_multiple_of=resize_to_multiple_of)
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if config is not None:
            config.pad_token_id = tokenizer.pad_token_id
            config.bos_token_id = tokenizer.bos_token_id
            config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def get_kbit_device_map() -> dict[str, int] | None:
    """TRL ≤ 1.x scripts' ``device_map`` for 4-/8-bit models (this process's GPU; None without CUDA)."""
    warn_once(
        "get_kbit_device_map",
        "`get_kbit_device_map` is no longer part of TRL's API: pass `quantization_config=get_quantization_config("
        "model_args)` to the trainer (or `model_init_kwargs`), which places the quantized model itself. posttrain "
        "still returns the old device map.",
        stacklevel=2,
    )
    import torch

    if not torch.cuda.is_available():
        return None
    from accelerate import PartialState

    return {"": PartialState().local_process_index}


def __getattr__(name: str) -> Any:
    """The old top-level ORPO/CPO names, imported on first use (``DataCollatorForCompletionOnlyLM`` lives in
    ``posttrain._legacy_collator``, above this module, and ``posttrain.__getattr__`` resolves it)."""
    if name in _EXPERIMENTAL_AT_TOP:
        module = _EXPERIMENTAL_AT_TOP[name]
        warn_once(
            name,
            f"`posttrain.{name}` (TRL ≤ 0.28's top-level name) moved to `{module}` in TRL 0.29; import it from there.",
        )
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_EXPERIMENTAL_AT_TOP = {
    "ORPOConfig": "posttrain.experimental.orpo",
    "ORPOTrainer": "posttrain.experimental.orpo",
    "CPOConfig": "posttrain.experimental.cpo",
    "CPOTrainer": "posttrain.experimental.cpo",
}
# names posttrain's top level resolves through this module
TOP_LEVEL = ("setup_chat_format", "get_kbit_device_map", "DataCollatorForCompletionOnlyLM", *_EXPERIMENTAL_AT_TOP)
