"""Chat-template utilities: rendering helpers shared by the data layer, capability probes and template swaps.

Rendering helpers (used by ``utils.apply_chat_template`` and ``tokenization``): ``render_chat`` wraps
``tokenizer.apply_chat_template`` and accepts per-row ``tools`` (a list, or a JSON string as stored by
``datasets`` < 4.7) and ``chat_template_kwargs``; message keys whose value is ``None`` (Arrow fills missing struct
fields with nulls) are dropped before rendering so templates see the keys as undefined, as in the original rows.

TRL's ``trl.chat_template_utils``: ``clone_chat_template``, ``get_training_chat_template``, ``supports_tool_calling``,
``is_chat_template_prefix_preserving``, ``is_chat_template_stop_token_trained``, ``has_generation_markers``.

Known template families live in the ``CHAT_TEMPLATE_FAMILIES`` registry: ``"chatml"`` (Qwen2/Qwen2.5 style),
``"qwen3"`` (Qwen3 hybrid thinking), ``"llama3_1"`` (Llama 3.1/3.3 Instruct) and ``"llama3_2"`` (Llama 3.2 Instruct).
A template belongs to a family when it is one of the family's bundled originals (``templates/<name>.jinja``,
compared as exact strings) or, failing that, when it renders the family's probe conversations exactly as the
family's training template does; so any template that renders ChatML exactly (with a system message) is
``"chatml"``. Each family's ``templates/<name>_training.jinja`` wraps every assistant turn, end-of-turn token
included, in ``{% generation %}`` markers and is prefix-preserving; its header comment says what it changes.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.formats import DataFormatError
from posttrain.registry import Registry

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ----------------------------------------------------------------------------------------------------------------
# Rendering helpers


def get_chat_template(tokenizer: Any, chat_template: str | None = None) -> str:
    """The chat template string in use: ``chat_template`` if given, else the tokenizer's (``"default"`` entry of a
    dict of named templates). Raises ``ValueError`` when there is none."""
    if chat_template is not None:
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    if template is None and hasattr(tokenizer, "tokenizer"):  # processors keep it on the inner tokenizer too
        template = getattr(tokenizer.tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("default") or next(iter(template.values()), None)
    if not template:
        raise ValueError(
            "The tokenizer has no chat template, so conversational data cannot be rendered. Set "
            "`tokenizer.chat_template`, or pass `chat_template_path` (a .jinja file or a tokenizer with a template)."
        )
    return template


def has_generation_markers(chat_template: str | dict[str, str] | None) -> bool:
    """True iff the template contains ``{% generation %}`` markers (needed for assistant-only loss masks).

    A template shipped as named variants (a dict) is checked on its ``default`` variant, as in TRL.
    """
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    return bool(_GENERATION_RE.search(chat_template or ""))


def resolve_tools(tools: Any, *, row: int | None = None, column: str = "tools") -> list | None:
    """Normalise a ``tools`` value: JSON string → list; empty list/string → ``None`` (TRL treats ``[]`` as no tools).

    Raises ``DataFormatError`` naming the row and column when the value is not a list of tool schemas.
    """
    if tools is None:
        return None
    if isinstance(tools, str):
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise DataFormatError(
                f"'tools' is a string but not valid JSON ({err.msg} at char {err.pos}). Store a list of JSON "
                "schemas, or json.dumps(list_of_schemas).",
                row=row,
                column=column,
            ) from None
    if isinstance(tools, Mapping):
        tools = [tools]
    if not isinstance(tools, (list, tuple)):
        raise DataFormatError(
            f"expected a list of tool JSON schemas (or a JSON string of one), got {type(tools).__name__}.",
            row=row,
            column=column,
        )
    tools = [_drop_none(t) if isinstance(t, Mapping) else t for t in tools]
    return list(tools) or None


def resolve_template_kwargs(
    base: Mapping[str, Any] | None, row_kwargs: Any = None, *, row: int | None = None
) -> dict[str, Any]:
    """Merge trainer-level ``chat_template_kwargs`` with a row's ``chat_template_kwargs`` column (row wins).

    The row value may be a dict (``None`` fields, as Arrow fills them, are dropped) or a JSON string.
    """
    merged = dict(base or {})
    if row_kwargs is None:
        return merged
    if isinstance(row_kwargs, str):
        try:
            row_kwargs = json.loads(row_kwargs) if row_kwargs.strip() else {}
        except json.JSONDecodeError:
            raise DataFormatError(
                "expected a dict (or a JSON object string) of keyword arguments for the chat template.",
                row=row,
                column="chat_template_kwargs",
            ) from None
    if not isinstance(row_kwargs, Mapping):
        raise DataFormatError(
            f"expected a dict of chat-template keyword arguments, got {type(row_kwargs).__name__}.",
            row=row,
            column="chat_template_kwargs",
        )
    merged.update({k: v for k, v in row_kwargs.items() if v is not None})
    return merged


def _drop_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def clean_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages without ``None``-valued keys (at any depth), as the rows were before Arrow storage."""
    return [_drop_none(m) for m in messages]


def prompt_generation_flags(
    prompt: Sequence[Mapping[str, Any]], *, row: int | None = None, column: str = "prompt"
) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)`` for a conversational prompt, TRL's rule.

    The last message's role decides: ``user``/``tool`` → open a new assistant turn; ``assistant`` → continue that
    message (the completion extends it); anything else raises ``DataFormatError``.
    """
    if not prompt:
        raise DataFormatError("the prompt has no messages. Give it at least one user message.", row=row, column=column)
    role = prompt[-1].get("role")
    if role in ("user", "tool"):
        return True, False
    if role == "assistant":
        return False, True
    raise DataFormatError(
        f"the prompt's last message has role {role!r}; it must be 'user' or 'tool' (a new assistant turn follows) "
        "or 'assistant' (the completion continues it).",
        row=row,
        column=column,
    )


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Any = None,
    tokenize: bool = False,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    return_assistant_tokens_mask: bool = False,
    **template_kwargs: Any,
) -> Any:
    """Render ``messages`` with the tokenizer's chat template.

    Returns the text when ``tokenize=False``; otherwise a dict with ``input_ids`` (a flat ``list[int]``) and, when
    ``return_assistant_tokens_mask=True``, ``assistant_masks`` (1 on tokens inside ``{% generation %}``).
    """
    messages = clean_messages(messages)
    tools = resolve_tools(tools)
    if not tokenize:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
    out = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=True,
        return_dict=True,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        return_assistant_tokens_mask=return_assistant_tokens_mask,
        **template_kwargs,
    )
    result = {"input_ids": _flat(out["input_ids"])}
    if return_assistant_tokens_mask:
        result["assistant_masks"] = _flat(out["assistant_masks"])
    return result


def _flat(ids: Any) -> list[int]:
    """Token ids as a flat list (processors return a batch of one; tensors become lists)."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise ValueError(f"Expected one sequence of token ids, got a batch of {len(ids)}.")
        ids = ids[0]
    return list(ids)


# ----------------------------------------------------------------------------------------------------------------
# Probes

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_name",
        "description": "A probe tool.",
        "parameters": {
            "type": "object",
            "properties": {"probe_arg_key": {"type": "string", "description": "A probe argument."}},
            "required": ["probe_arg_key"],
        },
    },
}
_PROBE_USER = {"role": "user", "content": "What is the probe?"}


def _probe_tool_call_messages(json_string_arguments: bool = False) -> list[dict]:
    arguments: Any = {"probe_arg_key": "probe_arg_value"}
    if json_string_arguments:
        arguments = json.dumps(arguments)
    call = {"type": "function", "function": {"name": "probe_tool_name", "arguments": arguments}}
    return [
        _PROBE_USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "probe_tool_name", "content": "probe_tool_content"},
    ]


def _render_tool_conversation(tokenizer: Any, messages_for: Callable[[bool], list], **kwargs) -> Any:
    """Render with dict arguments, retrying with JSON-string arguments for templates that concatenate strings."""
    try:
        return tokenizer.apply_chat_template(messages_for(False), tools=[_PROBE_TOOL], **kwargs)
    except TypeError:
        return tokenizer.apply_chat_template(messages_for(True), tools=[_PROBE_TOOL], **kwargs)


def supports_tool_calling(processing_class: Any) -> bool:
    """True iff the chat template renders a tool call (name, argument key and value) and a tool response.

    Renders user → assistant(tool_calls) → tool with four sentinel strings; any template error means ``False``.
    """
    try:
        text = _render_tool_conversation(processing_class, _probe_tool_call_messages, tokenize=False)
    except Exception:  # any template error (undefined variables, raise_exception) means "not supported"
        return False
    return all(s in text for s in ("probe_tool_name", "probe_arg_key", "probe_arg_value", "probe_tool_content"))


def is_chat_template_prefix_preserving(processing_class: Any) -> bool:
    """True iff appending messages never re-renders earlier ones (needed by the tool-calling loop and multi-turn).

    Checks, at the token level: [user, assistant] is a prefix of [user, assistant, user] + generation prompt; and,
    when the template supports tools, [user, assistant(tool_calls)] is a prefix of the same + tool message +
    generation prompt.
    """
    tok = processing_class
    plain = [_PROBE_USER, {"role": "assistant", "content": "It is a probe."}]
    try:
        short = _flat(tok.apply_chat_template(plain, tokenize=True, return_dict=True)["input_ids"])
        long = _flat(
            tok.apply_chat_template(
                [*plain, {"role": "user", "content": "And then?"}],
                tokenize=True,
                return_dict=True,
                add_generation_prompt=True,
            )["input_ids"]
        )
    except Exception:
        return False
    if long[: len(short)] != short:
        return False
    if not supports_tool_calling(tok):
        return True
    short = _flat(
        _render_tool_conversation(tok, lambda js: _probe_tool_call_messages(js)[:2], tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    long = _flat(
        _render_tool_conversation(
            tok, _probe_tool_call_messages, tokenize=True, return_dict=True, add_generation_prompt=True
        )["input_ids"]
    )
    return long[: len(short)] == short


def is_chat_template_stop_token_trained(processing_class: Any, chat_template: str | None = None) -> bool:
    """True iff the assistant mask of a rendered turn ends on an added (end-of-turn) token.

    With ``return_assistant_tokens_mask=True``, takes the last non-whitespace masked token of an assistant turn and
    checks it is one of the tokenizer's added tokens (e.g. ``<|im_end|>``): only then does assistant-only loss
    teach the model to stop. ``False`` when the template yields no mask at all, or cannot render the probe (a jinja
    ``TemplateError``, e.g. ``raise_exception``; no template), as TRL.
    """
    from jinja2 import TemplateError

    tok = processing_class
    messages = [_PROBE_USER, {"role": "assistant", "content": "It is a probe."}]
    try:
        template = get_chat_template(tok, chat_template)
        out = tok.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
    except (TemplateError, TypeError, ValueError):
        return False
    ids, mask = _flat(out["input_ids"]), _flat(out["assistant_masks"])
    masked = [i for i, m in zip(ids, mask) if m]
    added = set(getattr(tok, "added_tokens_decoder", {}) or {})
    for token_id in reversed(masked):
        if tok.decode([token_id]).strip() == "" and token_id not in added:
            continue  # trailing newline/space inside the generation block
        return token_id in added
    return False


def validate_assistant_only_loss_template(processing_class: Any, chat_template: str | None = None) -> None:
    """Check up front that ``assistant_only_loss=True`` can work with this template.

    Raises:
        ValueError: The template has no ``{% generation %}`` markers, so every assistant mask would be all zeros.
            The message says how to fix it (``get_training_chat_template`` or ``chat_template_path``).

    Warns (``UserWarning``) when the end-of-turn token falls outside the assistant mask: the model would then never
    be trained to stop.
    """
    template = get_chat_template(processing_class, chat_template)
    if not has_generation_markers(template):
        try:
            family = detect_chat_template_family(processing_class)
        except Exception:
            family = None
        hint = (
            f" This template renders like the known {family!r} family: use "
            "`tokenizer.chat_template = get_training_chat_template(tokenizer)` to swap in its training version."
            if family
            else " Pass `chat_template_path` pointing to a template whose assistant turns are wrapped in "
            "`{% generation %}` ... `{% endgeneration %}`."
        )
        raise ValueError(
            "assistant_only_loss=True needs a chat template with `{% generation %}` markers around assistant "
            "output, so that `return_assistant_tokens_mask=True` can mark the assistant tokens; this template has "
            "none." + hint
        )
    if not is_chat_template_stop_token_trained(processing_class, template):
        warnings.warn(
            "With this chat template the assistant's end-of-turn token is not inside the `{% generation %}` block, "
            "so assistant-only loss never trains the model to stop. Move the end-of-turn token (e.g. <|im_end|>) "
            "inside `{% endgeneration %}`.",
            UserWarning,
            stacklevel=2,
        )


# ----------------------------------------------------------------------------------------------------------------
# Template families and training templates


Probe = tuple[tuple[tuple[str, str], ...], bool]


@functools.cache
def _read_template(file: str) -> str:
    return (TEMPLATES_DIR / file).read_text()


@dataclass(frozen=True)
class ChatTemplateFamily:
    """A known chat-template family: how to recognise it and where its training template lives.

    Attributes:
        name: Registry key.
        training_template_file: File in ``posttrain/data/templates`` with generation markers.
        required_probes: Conversations that must render identically with the original and the training template
            for the tokenizer to belong to the family.
        optional_probes: Conversations where a difference is allowed but reported in a warning (e.g. a default
            system prompt the original adds when none is given).
        original_template_files: The model's own templates (verbatim, one file per shipped revision); a tokenizer
            whose template equals one of them belongs to the family without probing.
    """

    name: str
    training_template_file: str
    required_probes: tuple[Probe, ...]
    optional_probes: tuple[tuple[str, Probe], ...] = ()
    original_template_files: tuple[str, ...] = ()

    def training_template(self) -> str:
        return _read_template(self.training_template_file)

    def original_templates(self) -> list[str]:
        """The bundled original templates, newest revision first."""
        return [_read_template(f) for f in self.original_template_files]


def _conv(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(pairs)


_SYSTEM = ("system", "You are a probe.")
_THOUGHT = "<think>\nA probe thought.\n</think>\n\nHello!"

CHAT_TEMPLATE_FAMILIES: Registry[ChatTemplateFamily] = Registry("chat template family")
CHAT_TEMPLATE_FAMILIES.add(
    "chatml",
    ChatTemplateFamily(
        name="chatml",
        training_template_file="chatml_training.jinja",
        required_probes=(
            (_conv(_SYSTEM, ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")), False),
            (_conv(_SYSTEM, ("user", "Hi")), True),
            (_conv(_SYSTEM, ("user", "Hi"), ("assistant", "Hello!")), False),
        ),
        optional_probes=(("conversations without a system message", (_conv(("user", "Hi")), True)),),
    ),
)
CHAT_TEMPLATE_FAMILIES.add(
    "qwen3",
    ChatTemplateFamily(
        name="qwen3",
        training_template_file="qwen3_training.jinja",
        required_probes=(
            (_conv(_SYSTEM, ("user", "Hi")), True),
            (_conv(_SYSTEM, ("user", "Hi"), ("assistant", "Hello!")), False),
            (_conv(("user", "Hi"), ("assistant", _THOUGHT)), False),
        ),
        optional_probes=(
            (
                "assistant turns before the last user message (kept with their <think> block, so that earlier "
                "turns do not change when messages are appended)",
                (_conv(_SYSTEM, ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")), True),
            ),
        ),
        original_template_files=("qwen3.jinja", "qwen3_v0.jinja"),
    ),
)
_LLAMA3_PROBES: tuple[Probe, ...] = (
    (_conv(_SYSTEM, ("user", "Hi")), True),
    (_conv(_SYSTEM, ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")), True),
    (_conv(("user", "Hi"), ("assistant", "Hello!")), False),
)
CHAT_TEMPLATE_FAMILIES.add(
    "llama3_1",
    ChatTemplateFamily(
        name="llama3_1",
        training_template_file="llama3_1_training.jinja",
        required_probes=_LLAMA3_PROBES,
        original_template_files=("llama3_1.jinja",),
    ),
)
CHAT_TEMPLATE_FAMILIES.add(
    "llama3_2",
    ChatTemplateFamily(
        name="llama3_2",
        training_template_file="llama3_2_training.jinja",
        required_probes=_LLAMA3_PROBES,
        original_template_files=("llama3_2.jinja",),
    ),
)


def _render_probe(tokenizer: Any, probe: Probe, template: str | None) -> str:
    pairs, add_generation_prompt = probe
    messages = [{"role": r, "content": c} for r, c in pairs]
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def detect_chat_template_family(processing_class: Any, chat_template: str | None = None) -> str | None:
    """Name of the known family this tokenizer's template belongs to, or ``None``.

    First by identity: the template (surrounding whitespace ignored) is one of a family's bundled originals or its
    training template. Then by rendering: the family's training template renders every probe conversation
    exactly as this template does (families are tried in registry order, ``"chatml"`` first).
    """
    template = get_chat_template(processing_class, chat_template)
    stripped = template.strip()
    for name, family in CHAT_TEMPLATE_FAMILIES.items():
        known = [*family.original_templates(), family.training_template()]
        if any(stripped == t.strip() for t in known):
            return name
    for name, family in CHAT_TEMPLATE_FAMILIES.items():
        training = family.training_template()
        try:
            if all(
                _render_probe(processing_class, p, template) == _render_probe(processing_class, p, training)
                for p in family.required_probes
            ):
                return name
        except Exception:  # a template that cannot render a probe is not in this family
            continue
    return None


def get_training_chat_template(processing_class: Any = None, tokenizer: Any = None) -> str | None:
    """A chat template fit for training, or ``None`` when the current one already is.

    The current template is fit when it has ``{% generation %}`` markers and, if it supports tool calling, is
    prefix-preserving. Otherwise the training template of its known family (``CHAT_TEMPLATE_FAMILIES``) is
    returned; differences on optional probes (e.g. the original adds a default system prompt, or renders tools in
    another layout) are reported in a warning.

    Args:
        processing_class: Tokenizer (or processor) whose ``chat_template`` is checked.
        tokenizer: Deprecated alias of ``processing_class`` (TRL's old keyword).

    Raises:
        ValueError: The template is not fit for training and belongs to no known family.
    """
    if tokenizer is not None:
        warnings.warn("`tokenizer=` is deprecated; pass `processing_class`.", FutureWarning, stacklevel=2)
        processing_class = tokenizer if processing_class is None else processing_class
    if processing_class is None:
        raise TypeError("get_training_chat_template() needs a tokenizer or processor: pass `processing_class`.")
    template = get_chat_template(processing_class)
    markers = has_generation_markers(template)
    tools = supports_tool_calling(processing_class)
    if markers and (not tools or is_chat_template_prefix_preserving(processing_class)):
        return None
    family_name = detect_chat_template_family(processing_class)
    if family_name is None:
        problems = []
        if not markers:
            problems.append("has no `{% generation %}` markers (needed for assistant-only loss)")
        if tools and not is_chat_template_prefix_preserving(processing_class):
            problems.append("is not prefix-preserving when tool messages are appended (needed for tool calling)")
        raise ValueError(
            f"The tokenizer's chat template {' and '.join(problems) or 'is not fit for training'}, and it does not "
            f"render like any known family ({', '.join(CHAT_TEMPLATE_FAMILIES.names())}). Write a training version "
            "of it (wrap each assistant turn, end-of-turn token included, in `{% generation %}` ... "
            "`{% endgeneration %}`) and pass it with `chat_template_path`."
        )
    family = CHAT_TEMPLATE_FAMILIES.get(family_name)
    training = family.training_template()
    differing = []
    for label, probe in family.optional_probes:
        try:
            if _render_probe(processing_class, probe, template) != _render_probe(processing_class, probe, training):
                differing.append(label)
        except Exception:
            differing.append(label)
    if tools:
        try:
            kwargs = dict(tokenize=False, add_generation_prompt=True)
            original = _render_tool_conversation(processing_class, _probe_tool_call_messages, **kwargs)
            patched = _render_tool_conversation(
                processing_class, _probe_tool_call_messages, chat_template=training, **kwargs
            )
            if original != patched:
                differing.append("tool-calling conversations")
        except Exception:
            differing.append("tool-calling conversations")
    if differing:
        warnings.warn(
            f"Using posttrain's {family_name!r} training template. It renders {' and '.join(differing)} differently "
            "from the tokenizer's original template; the new template is saved with the model, so training and "
            "inference stay consistent.",
            UserWarning,
            stacklevel=2,
        )
    return training


# ----------------------------------------------------------------------------------------------------------------
# Cloning and loading templates


def clone_chat_template(
    model: Any,
    tokenizer: Any,
    source_tokenizer_path: str | Any,
    resize_to_multiple_of: int | None = 64,
) -> tuple[Any, Any, list[int]]:
    """Copy the chat template of another tokenizer, adding its special tokens and resizing the embeddings.

    Steps: set ``tokenizer.chat_template`` from the source; add the source's added tokens missing from the target;
    take the source's EOS token (also written to ``model.config`` and ``model.generation_config``); resize the
    embeddings to ``len(tokenizer)`` rounded up to ``resize_to_multiple_of``; fill the rounding gap with
    ``<extra_id_N>`` tokens so that vocabulary size equals embedding rows.

    Args:
        model: Model whose embeddings are resized.
        tokenizer: Tokenizer that receives the template and tokens.
        source_tokenizer_path: Path or hub id of the tokenizer to copy from (or a tokenizer object).
        resize_to_multiple_of: Round the embedding size up to this multiple (``None`` = no rounding).

    Returns:
        ``(model, tokenizer, added_token_ids)``: ids of every token added to ``tokenizer``.
    """
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    if isinstance(source_tokenizer_path, (str, Path)):
        source = AutoTokenizer.from_pretrained(str(source_tokenizer_path))
    else:
        source = source_tokenizer_path
    tokenizer.chat_template = get_chat_template(source)
    vocab = tokenizer.get_vocab()
    missing = [t for t in source.added_tokens_decoder.values() if t.content not in vocab]
    added_contents = [t.content for t in missing]
    # Special-ness is kept, so skip_special_tokens decodes as the source does.
    if missing:
        tokenizer.add_tokens(missing)
    if source.eos_token is not None:
        tokenizer.eos_token = source.eos_token
        model.config.eos_token_id = tokenizer.eos_token_id
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.eos_token_id = tokenizer.eos_token_id
    model.resize_token_embeddings(new_num_tokens=len(tokenizer), pad_to_multiple_of=resize_to_multiple_of)
    num_rows = model.get_input_embeddings().weight.shape[0]
    idx = 0
    while len(tokenizer) < num_rows:
        token = f"<extra_id_{idx}>"
        idx += 1
        if tokenizer.add_tokens(AddedToken(token, special=False, normalized=False)) == 1:
            added_contents.append(token)
    if len(tokenizer) != num_rows:
        raise RuntimeError(
            f"After cloning the chat template the tokenizer has {len(tokenizer)} tokens but the model has "
            f"{num_rows} embedding rows."
        )
    added_token_ids = tokenizer.convert_tokens_to_ids(added_contents)
    return model, tokenizer, list(added_token_ids)


def load_chat_template_file(path: str | Path) -> str:
    """Read a ``.jinja`` / ``.j2`` chat template file."""
    path = Path(path)
    if path.suffix not in (".jinja", ".j2"):
        raise ValueError(f"Chat template files must end in .jinja or .j2, got {path.name!r}.")
    return path.read_text()


def apply_chat_template_path(model: Any, tokenizer: Any, chat_template_path: str | Path) -> tuple[Any, Any, list[int]]:
    """SFT/Reward ``chat_template_path``: a ``.jinja``/``.j2`` file sets the template; anything else is a tokenizer
    path whose template is cloned with ``clone_chat_template``. Returns ``(model, tokenizer, added_token_ids)``."""
    path = Path(chat_template_path)
    if path.suffix in (".jinja", ".j2"):
        tokenizer.chat_template = load_chat_template_file(path)
        return model, tokenizer, []
    return clone_chat_template(model, tokenizer, str(chat_template_path))
