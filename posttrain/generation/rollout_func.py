"""The user's ``rollout_func`` as a generation backend (TRL's experimental ``GRPOTrainer(rollout_func=...)``).

TRL calls ``rollout_func(prompts, trainer)`` with the raw per-process prompts of the batch (strings or message
lists, *not* chat-templated and *not* deduplicated: each prompt appears once per generation, as the repeat sampler
laid them out) and expects a dict with

- ``prompt_ids``, ``completion_ids``, ``logprobs`` (required; a missing key is a ``ValueError``; ``logprobs=None``
  says the generator has none, and the pipeline then cannot apply importance-sampling correction),
- ``env_mask`` (optional; 1 = model-generated token, 0 = environment/tool token; it becomes the tool mask),
- any other key (e.g. ``logprob_token_ids`` or reward kwargs), passed through per row.

Because the function wants prompts rather than token ids, the pipeline should call
``RolloutFuncBackend.generate_from_prompts(prompts)``. The protocol method ``generate(prompt_ids, ...)`` also works
but hands the function the *decoded prompt text* (with special tokens, i.e. already templated), so use it only with
functions that accept text.

Completions from a rollout function are not cut at the first EOS (a multi-turn rollout contains several turns, each
ending with EOS); ``finished`` is whether the last token is an EOS.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.generation.base import Completions, SamplingConfig

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")

_warned = False


class RolloutFuncBackend:
    """Wrap ``rollout_func(prompts, trainer) -> dict`` (TRL's contract, see the module docstring).

    Args:
        rollout_func: The user's function.
        trainer: Passed through as the function's second argument (TRL passes the trainer).
        tokenizer: Used for EOS ids (when no ``SamplingConfig`` is given) and by ``generate`` to decode prompt ids;
            defaults to ``trainer.processing_class``.
    """

    warn_experimental = True  # False where the function is a trainer's own `_generate` (not TRL's experimental API)

    def __init__(self, rollout_func: Callable[[list, Any], Mapping[str, Any]], trainer: Any, tokenizer: Any = None):
        if not callable(rollout_func):
            raise TypeError(f"rollout_func must be callable, got {type(rollout_func).__name__}.")
        self.rollout_func = rollout_func
        self.trainer = trainer
        self.tokenizer = tokenizer if tokenizer is not None else getattr(trainer, "processing_class", None)

    @classmethod
    def from_components(
        cls, model: Any = None, tokenizer: Any = None, *, rollout_func: Callable, trainer: Any = None
    ) -> RolloutFuncBackend:
        """``get_backend("rollout_func", model, tokenizer, rollout_func=..., trainer=...)`` entry point."""
        return cls(rollout_func, trainer, tokenizer=tokenizer)

    def sync_weights(self, model: Any) -> None:
        """No-op: the rollout function owns its generator (the pipeline syncs any vLLM engine before calling it)."""

    def generate_from_prompts(
        self, prompts: list[Any], sampling: SamplingConfig | None = None, num_generations: int = 1
    ) -> Completions:
        """Call ``rollout_func`` on raw prompts and validate what it returns.

        Args:
            prompts: Raw prompts (text or message lists), as TRL passes them (already one per generation).
            sampling: Only its ``eos_token_ids`` are used (for ``finished``); the function samples as it likes.
            num_generations: Repeat each prompt this many times first (``[p0, p0, ..., p1, ...]``); keep 1 when
                the prompts are already repeated, as in TRL.

        Returns:
            ``Completions`` with one row per (repeated) prompt; ``env_mask`` and every other returned key are in
            ``extra``.
        """
        global _warned
        if self.warn_experimental and not _warned and os.environ.get("TRL_EXPERIMENTAL_SILENCE") != "1":
            _warned = True
            warnings.warn(
                "rollout_func is experimental and its contract may change (set TRL_EXPERIMENTAL_SILENCE=1 to "
                "silence this warning).",
                UserWarning,
                stacklevel=2,
            )
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
        prompts = [p for p in prompts for _ in range(num_generations)]
        result = self.rollout_func(prompts, self.trainer)
        if not isinstance(result, Mapping):
            raise TypeError(
                f"rollout_func must return a dict with keys {list(REQUIRED_KEYS)}, got {type(result).__name__}."
            )
        missing = [k for k in REQUIRED_KEYS if k not in result]
        if missing:
            raise ValueError(
                f"rollout_func's output is missing required key(s) {missing}; it must return a dict with "
                f"{list(REQUIRED_KEYS)} (one entry per prompt) and optionally 'env_mask' and extra fields."
            )
        n = len(prompts)
        out = {k: _rows(k, v, n) for k, v in result.items() if not (k == "logprobs" and v is None)}
        completion_ids = [[int(t) for t in row] for row in out["completion_ids"]]
        prompt_ids = [[int(t) for t in row] for row in out["prompt_ids"]]
        logprobs = None
        if "logprobs" in out:
            logprobs = [[float(x) for x in row] for row in out["logprobs"]]
            _check_per_token("logprobs", logprobs, completion_ids)
        extra = {k: v for k, v in out.items() if k not in REQUIRED_KEYS}
        if "env_mask" in extra:
            _check_per_token("env_mask", extra["env_mask"], completion_ids)
        eos = set(sampling.eos_token_ids) if sampling is not None else _tokenizer_eos(self.tokenizer)
        finished = [bool(c) and c[-1] in eos for c in completion_ids]
        return Completions(completion_ids, logprobs, finished, prompt_ids, extra)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, num_generations: int = 1) -> Completions:
        """Protocol entry: decode ``prompt_ids`` to text (special tokens kept) and call ``generate_from_prompts``.

        The function then sees templated prompt text instead of TRL's raw prompts; prefer
        ``generate_from_prompts`` when the raw prompts are at hand.
        """
        if self.tokenizer is None:
            raise ValueError(
                "RolloutFuncBackend.generate needs a tokenizer to decode prompt_ids; pass tokenizer=... or call "
                "generate_from_prompts(prompts) with the raw prompts."
            )
        texts = self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
        return self.generate_from_prompts(texts, sampling, num_generations)


def _rows(key: str, value: Any, n: int) -> list:
    """``value`` as a per-row list of length ``n`` (tensors/arrays converted), else a ``ValueError``."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"{len(value)} rows" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(f"rollout_func returned {key!r} with {got}; expected a list with one entry per prompt ({n}).")
    return [v.tolist() if hasattr(v, "tolist") else v for v in value]


def _check_per_token(key: str, values: list[list], completion_ids: list[list[int]]) -> None:
    for i, (v, c) in enumerate(zip(values, completion_ids)):
        if len(v) != len(c):
            raise ValueError(
                f"rollout_func returned {key}[{i}] with {len(v)} values but completion_ids[{i}] has {len(c)} "
                f"tokens; {key} needs one value per completion token."
            )


def _tokenizer_eos(tokenizer: Any) -> set[int]:
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    eos = getattr(tok, "eos_token_id", None)
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
