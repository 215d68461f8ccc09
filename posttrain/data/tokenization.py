"""Tokenization helpers shared by the trainers (SFT, DPO, KTO, reward, GRPO/RLOO).

Each ``tokenize_*`` function takes one row and a tokenizer and returns plain ``list[int]`` columns, so it can be used
with ``dataset.map(fn, fn_kwargs={"tokenizer": tok, ...})`` or, to get row indices in error messages,
``map_with_row_index(dataset, fn, fn_kwargs=...)``:

=============================  ====================================================================================
``tokenize_lm``                ``text`` / ``messages`` → ``input_ids`` [, ``assistant_masks``]
``tokenize_prompt_completion`` ``prompt`` + ``completion`` → ``input_ids``, ``completion_mask`` [, ``assistant_masks``]
``tokenize_preference``        (``prompt``,) ``chosen``, ``rejected`` → ``prompt_ids``, ``chosen_ids``, ``rejected_ids``
``tokenize_unpaired``          ``prompt``, ``completion``, ``label`` → ``prompt_ids``, ``completion_ids``, ``label``
``tokenize_reward_pair``       (``prompt``,) ``chosen``, ``rejected`` → full ``chosen_ids``, ``rejected_ids``
``tokenize_prompt``            ``prompt`` → ``prompt_ids``, ``prompt_text`` (online RL)
=============================  ====================================================================================

Rules (TRL's): standard completions get the EOS token appended when missing (``add_eos``); conversational prompts
are rendered with ``add_generation_prompt=True`` when their last message is from the user or a tool and with
``continue_final_message=True`` when it is from the assistant; a completion is the *suffix* of the tokenized
prompt+completion after ``len(prompt_ids)`` tokens, and a warning is issued once when the tokenized prompt is not a
prefix of it. Per-row ``tools`` (list or JSON string) and ``chat_template_kwargs`` columns override the
trainer-level arguments. Bad rows raise ``DataFormatError`` naming the row index (when known) and column.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from posttrain.data.chat_templates import (
    get_chat_template,
    prompt_generation_flags,
    render_chat,
    resolve_template_kwargs,
    resolve_tools,
    validate_assistant_only_loss_template,
)
from posttrain.data.formats import DataFormatError, check_messages, check_text, is_messages
from posttrain.data.utils import is_conversational_from_value, maybe_convert_to_chatml, maybe_extract_prompt

IGNORE_INDEX = -100

_WARNED: set[str] = set()
_CHECKED_TEMPLATES: set[int] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces


class _RowContext:
    """What every tokenize function needs for one row: tools, template kwargs and the row index for errors."""

    def __init__(self, example: Mapping[str, Any], tokenizer: Any, tools: Any, chat_template_kwargs: Any, row: Any):
        self.tokenizer = tokenizer
        self.row = row
        row_tools = example.get("tools")
        self.tools = resolve_tools(row_tools if row_tools is not None else tools, row=row)
        self.template_kwargs = resolve_template_kwargs(
            chat_template_kwargs, example.get("chat_template_kwargs"), row=row
        )

    def render_ids(self, messages: Sequence[Mapping[str, Any]], *, column: str, **flags: Any) -> dict[str, list[int]]:
        get_chat_template(self.tokenizer, self.template_kwargs.get("chat_template"))  # no template: not a row error
        try:
            return render_chat(
                self.tokenizer, messages, tools=self.tools, tokenize=True, **flags, **self.template_kwargs
            )
        except DataFormatError:
            raise
        except Exception as err:  # template errors (raise_exception, undefined fields) point at this row's data
            raise DataFormatError(
                f"the chat template failed to render this row: {type(err).__name__}: {err}",
                row=self.row,
                column=column,
            ) from err

    def render_text(self, messages: Sequence[Mapping[str, Any]], *, column: str, **flags: Any) -> str:
        get_chat_template(self.tokenizer, self.template_kwargs.get("chat_template"))
        try:
            return render_chat(
                self.tokenizer, messages, tools=self.tools, tokenize=False, **flags, **self.template_kwargs
            )
        except DataFormatError:
            raise
        except Exception as err:
            raise DataFormatError(
                f"the chat template failed to render this row: {type(err).__name__}: {err}",
                row=self.row,
                column=column,
            ) from err

    def prompt_ids(self, prompt: Sequence[Mapping[str, Any]]) -> list[int]:
        add_gen, cont = prompt_generation_flags(prompt, row=self.row)
        return self.render_ids(prompt, column="prompt", add_generation_prompt=add_gen, continue_final_message=cont)[
            "input_ids"
        ]


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text)["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return list(ids)


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "add_eos=True but the tokenizer has no EOS token. Set `tokenizer.eos_token` (or the trainer's "
            "`eos_token`), or pass add_eos=False."
        )
    return eos


def _with_eos(ids: list[int], tokenizer: Any, add_eos: bool) -> list[int]:
    if add_eos:
        eos = _eos_id(tokenizer)
        if not ids or ids[-1] != eos:
            ids = [*ids, eos]
    return ids


def _row_format(example: Mapping[str, Any], columns: Sequence[str], row: int | None) -> bool:
    """True when the row is conversational; checks every column is in the same format and well formed."""
    for column in columns:
        if column not in example:
            raise DataFormatError(
                f"the column is missing; this function needs columns {list(columns)}.", row=row, column=column
            )
    conversational = is_messages(example[columns[0]])
    for column in columns:
        value = example[column]
        if conversational:
            if isinstance(value, str):
                raise DataFormatError(
                    f"the value is a string but {columns[0]!r} is a list of messages; all text columns of a row must be in the "
                    "same format (all strings, or all lists of messages).",
                    row=row,
                    column=column,
                )
            check_messages(value, row=row, column=column)
        else:
            if is_messages(value):
                raise DataFormatError(
                    f"the value is a list of messages but {columns[0]!r} is not; all text columns of a row must be in the same "
                    "format (all strings, or all lists of messages).",
                    row=row,
                    column=column,
                )
            check_text(value, row=row, column=column)
    return conversational


def _suffix_after_prompt(prompt_ids: list[int], full_ids: list[int], what: str) -> list[int]:
    if full_ids[: len(prompt_ids)] != prompt_ids:
        _warn_once(
            f"prefix:{what}",
            f"Mismatch between the tokenized prompt and the start of the tokenized prompt+{what}. This can come from "
            "tokenizer merges across the boundary, whitespace, or special-token handling; the first len(prompt_ids) "
            f"tokens of prompt+{what} are treated as the prompt. Check your data and template if this is unexpected.",
        )
    return full_ids[len(prompt_ids) :]


def _check_assistant_only(tokenizer: Any, template_kwargs: Mapping[str, Any]) -> None:
    template = get_chat_template(tokenizer, template_kwargs.get("chat_template"))
    key = hash(template)
    if key not in _CHECKED_TEMPLATES:
        validate_assistant_only_loss_template(tokenizer, template)
        _CHECKED_TEMPLATES.add(key)


def _check_assistant_mask(messages: Sequence[Mapping[str, Any]], mask: Sequence[int], row: int | None, column: str):
    if any(mask):
        return
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataFormatError(
            "assistant_only_loss=True but the conversation has no assistant message, so no token would be trained. "
            "Drop the row or add the assistant reply.",
            row=row,
            column=column,
        )
    raise DataFormatError(
        "assistant_only_loss=True but the chat template marked no assistant token (is every assistant turn inside "
        "`{% generation %}` ... `{% endgeneration %}`?).",
        row=row,
        column=column,
    )


# ----------------------------------------------------------------------------------------------------------------
# Public tokenize functions


def tokenize_lm(
    example: Mapping[str, Any],
    tokenizer: Any,
    *,
    dataset_text_field: str = "text",
    assistant_only_loss: bool = False,
    add_eos: bool = True,
    tools: list | str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    row_index: int | None = None,
) -> dict[str, list[int]]:
    """Tokenize a language-modeling row.

    Standard rows: ``tokenizer(example[dataset_text_field])`` with EOS appended when missing (``add_eos``).
    Conversational rows (``messages``, or ShareGPT ``conversations``): the chat template over the full
    conversation, with ``tools`` and ``chat_template_kwargs``.

    Args:
        example: Row with ``dataset_text_field`` or ``messages``/``conversations`` (optional ``tools``,
            ``chat_template_kwargs`` columns override the arguments).
        tokenizer: Tokenizer (with a chat template for conversational rows).
        assistant_only_loss: Also return ``assistant_masks`` (1 on assistant tokens, end-of-turn included).
            Conversational rows only; the template must have ``{% generation %}`` markers (checked once).
        add_eos: Append EOS to standard text.
        row_index: Row index, for error messages.

    Returns:
        ``{"input_ids": list[int]}`` plus ``"assistant_masks"`` when ``assistant_only_loss``.
    """
    if is_conversational_from_value(example):
        converted = maybe_convert_to_chatml({"conversations": [dict(m) for m in example["conversations"]]})
        example = {**{k: v for k, v in example.items() if k != "conversations"}, **converted}
    if "messages" in example:
        messages = example["messages"]
        check_messages(messages, row=row_index, column="messages")
        ctx = _RowContext(example, tokenizer, tools, chat_template_kwargs, row_index)
        if assistant_only_loss:
            _check_assistant_only(tokenizer, ctx.template_kwargs)
        out = ctx.render_ids(messages, column="messages", return_assistant_tokens_mask=assistant_only_loss)
        if assistant_only_loss:
            _check_assistant_mask(messages, out["assistant_masks"], row_index, "messages")
        return out
    if dataset_text_field not in example:
        raise DataFormatError(
            f"the row has neither {dataset_text_field!r} nor 'messages' (columns: {sorted(example)}). Set "
            "`dataset_text_field` to your text column, or provide conversational 'messages'.",
            row=row_index,
            column=dataset_text_field,
        )
    text = example[dataset_text_field]
    check_text(text, row=row_index, column=dataset_text_field)
    if assistant_only_loss:
        raise DataFormatError(
            "assistant_only_loss=True only works with conversational data ('messages'); this row is standard text. "
            "Use completion-only loss with prompt/completion columns instead.",
            row=row_index,
            column=dataset_text_field,
        )
    return {"input_ids": _with_eos(_encode(tokenizer, text), tokenizer, add_eos)}


def tokenize_prompt_completion(
    example: Mapping[str, Any],
    tokenizer: Any,
    *,
    add_eos: bool = True,
    tools: list | str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    assistant_only_loss: bool = False,
    row_index: int | None = None,
) -> dict[str, list[int]]:
    """Tokenize a prompt-completion row into one sequence with a completion mask.

    ``input_ids`` = tokens of prompt+completion (standard: ``prompt + completion`` text, EOS appended when missing;
    conversational: the chat template over ``prompt + completion``). ``completion_mask`` is 0 on the first
    ``len(prompt_ids)`` tokens (the prompt tokenized alone, conversational prompts with the generation prompt) and
    1 after. Warns once if the prompt tokens are not a prefix of the full tokens.

    Returns:
        ``{"input_ids", "completion_mask"}`` (+ ``"assistant_masks"`` with ``assistant_only_loss``, conversational).
    """
    conversational = _row_format(example, ("prompt", "completion"), row_index)
    if conversational:
        ctx = _RowContext(example, tokenizer, tools, chat_template_kwargs, row_index)
        if assistant_only_loss:
            _check_assistant_only(tokenizer, ctx.template_kwargs)
        prompt_ids = ctx.prompt_ids(example["prompt"])
        messages = list(example["prompt"]) + list(example["completion"])
        full = ctx.render_ids(messages, column="completion", return_assistant_tokens_mask=assistant_only_loss)
        input_ids = full["input_ids"]
    else:
        if assistant_only_loss:
            raise DataFormatError(
                "assistant_only_loss=True only works with conversational data; use completion-only loss for "
                "standard prompt/completion rows.",
                row=row_index,
                column="prompt",
            )
        prompt_ids = _encode(tokenizer, example["prompt"])
        input_ids = _with_eos(_encode(tokenizer, example["prompt"] + example["completion"]), tokenizer, add_eos)
    completion_ids = _suffix_after_prompt(prompt_ids, input_ids, "completion")
    n_prompt = len(input_ids) - len(completion_ids)
    out = {"input_ids": input_ids, "completion_mask": [0] * n_prompt + [1] * len(completion_ids)}
    if conversational and assistant_only_loss:
        _check_assistant_mask(messages, full["assistant_masks"], row_index, "completion")
        out["assistant_masks"] = full["assistant_masks"]
    return out


def _tokenize_prompt_and_completions(
    example: Mapping[str, Any],
    tokenizer: Any,
    completion_columns: Sequence[str],
    *,
    add_eos: bool,
    tools: Any,
    chat_template_kwargs: Any,
    row_index: int | None,
) -> dict[str, list[int]]:
    """``prompt_ids`` and, for each completion column X, ``X_ids`` = suffix of tokenize(prompt + X)."""
    conversational = _row_format(example, ("prompt", *completion_columns), row_index)
    out: dict[str, list[int]] = {}
    if conversational:
        ctx = _RowContext(example, tokenizer, tools, chat_template_kwargs, row_index)
        prompt_ids = ctx.prompt_ids(example["prompt"])
        for column in completion_columns:
            full = ctx.render_ids(list(example["prompt"]) + list(example[column]), column=column)["input_ids"]
            out[f"{column}_ids"] = _suffix_after_prompt(prompt_ids, full, column)
    else:
        prompt_ids = _encode(tokenizer, example["prompt"])
        for column in completion_columns:
            full = _encode(tokenizer, example["prompt"] + example[column])
            out[f"{column}_ids"] = _with_eos(_suffix_after_prompt(prompt_ids, full, column), tokenizer, add_eos)
    return {"prompt_ids": prompt_ids, **out}


def tokenize_preference(
    example: Mapping[str, Any],
    tokenizer: Any,
    *,
    add_eos: bool = True,
    tools: list | str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    row_index: int | None = None,
) -> dict[str, list[int]]:
    """Tokenize a preference row (explicit or implicit prompt) for DPO-style training.

    Implicit prompts are extracted first (``maybe_extract_prompt``). ``chosen_ids``/``rejected_ids`` are the
    suffixes of tokenize(prompt + chosen/rejected) after ``len(prompt_ids)`` tokens; standard completions get EOS.

    Returns:
        ``{"prompt_ids", "chosen_ids", "rejected_ids"}``.
    """
    for column in ("chosen", "rejected"):
        if column not in example:
            raise DataFormatError("the column is missing; preference rows need 'chosen' and 'rejected'.",
                                  row=row_index, column=column)  # fmt: skip
    example = {**example, **maybe_extract_prompt(example)}
    return _tokenize_prompt_and_completions(
        example,
        tokenizer,
        ("chosen", "rejected"),
        add_eos=add_eos,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        row_index=row_index,
    )


def tokenize_unpaired(
    example: Mapping[str, Any],
    tokenizer: Any,
    *,
    add_eos: bool = True,
    tools: list | str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    row_index: int | None = None,
) -> dict[str, Any]:
    """Tokenize an unpaired-preference row (KTO).

    Returns:
        ``{"prompt_ids", "completion_ids", "label"}`` (``label`` as a bool; completion ids as for
        ``tokenize_preference``).
    """
    label = example.get("label")
    if isinstance(label, bool) or (isinstance(label, int) and label in (0, 1)):
        label = bool(label)
    else:
        raise DataFormatError(
            f"expected a bool (True = desirable completion), got {label!r}.", row=row_index, column="label"
        )
    out = _tokenize_prompt_and_completions(
        example,
        tokenizer,
        ("completion",),
        add_eos=add_eos,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        row_index=row_index,
    )
    out["label"] = label
    return out


def tokenize_reward_pair(
    example: Mapping[str, Any],
    tokenizer: Any,
    *,
    add_eos: bool = True,
    tools: list | str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    row_index: int | None = None,
) -> dict[str, list[int]]:
    """Tokenize a preference row as two full sequences for reward modelling.

    Implicit prompt (recommended): ``chosen``/``rejected`` tokenized whole. Explicit prompt: the prompt is
    prepended first (standard: text concatenation; conversational: message lists). Standard sequences get EOS;
    conversational ones are rendered with the chat template over the full conversation.

    Returns:
        ``{"chosen_ids", "rejected_ids"}``.
    """
    columns = ("prompt", "chosen", "rejected") if "prompt" in example else ("chosen", "rejected")
    conversational = _row_format(example, columns, row_index)
    out = {}
    if conversational:
        ctx = _RowContext(example, tokenizer, tools, chat_template_kwargs, row_index)
        for column in ("chosen", "rejected"):
            messages = list(example.get("prompt") or []) + list(example[column])
            out[f"{column}_ids"] = ctx.render_ids(messages, column=column)["input_ids"]
    else:
        for column in ("chosen", "rejected"):
            text = example.get("prompt", "") + example[column]
            out[f"{column}_ids"] = _with_eos(_encode(tokenizer, text), tokenizer, add_eos)
    return out


def tokenize_prompt(
    example: Mapping[str, Any],
    tokenizer: Any,
    *,
    tools: list | str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    row_index: int | None = None,
) -> dict[str, Any]:
    """Tokenize a prompt for online RL (GRPO/RLOO/distillation).

    Standard prompts are tokenized as is; conversational prompts are rendered with the generation prompt (or
    continuing a final assistant message) and the rendered text is tokenized without adding special tokens, as
    ``apply_chat_template(tokenize=True)`` does.

    Returns:
        ``{"prompt_ids": list[int], "prompt_text": str}`` (the rendered prompt, for logging and text backends).
    """
    if "prompt" not in example:
        raise DataFormatError("the column is missing; prompt-only rows need 'prompt'.", row=row_index, column="prompt")
    prompt = example["prompt"]
    if is_messages(prompt) or (isinstance(prompt, list) and not prompt):
        check_messages(prompt, row=row_index, column="prompt")
        ctx = _RowContext(example, tokenizer, tools, chat_template_kwargs, row_index)
        add_gen, cont = prompt_generation_flags(prompt, row=row_index)
        text = ctx.render_text(prompt, column="prompt", add_generation_prompt=add_gen, continue_final_message=cont)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"prompt_ids": list(ids), "prompt_text": text}
    check_text(prompt, row=row_index, column="prompt")
    return {"prompt_ids": _encode(tokenizer, prompt), "prompt_text": prompt}


# ----------------------------------------------------------------------------------------------------------------
# Sequences and labels


def truncate_sequence(
    ids: Sequence[int], max_length: int | None, mode: Literal["keep_start", "keep_end"] = "keep_start"
) -> list[int]:
    """Cut a token sequence to ``max_length``: ``keep_start`` keeps ``ids[:max_length]``, ``keep_end`` keeps the last
    ``max_length`` tokens. ``max_length=None`` returns the sequence unchanged."""
    ids = list(ids)
    if max_length is None:
        return ids
    if max_length < 0:
        raise ValueError(f"max_length must be >= 0 or None, got {max_length}.")
    if mode == "keep_start":
        return ids[:max_length]
    if mode == "keep_end":
        return ids[len(ids) - max_length :] if max_length < len(ids) else ids
    raise ValueError(f"Unknown truncation_mode {mode!r}. Valid: 'keep_start', 'keep_end'.")


def prompt_overflows(prompt_len: int, max_length: int | None) -> bool:
    """True when the prompt alone fills ``max_length`` (no room for a single completion token): such rows are
    dropped by DPO/KTO (``keep_start`` truncation) instead of being trained on an empty completion."""
    return max_length is not None and prompt_len >= max_length


def build_labels(
    input_ids: Any,
    completion_mask: Any = None,
    assistant_masks: Any = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> Any:
    """Labels for causal-LM loss: ``input_ids`` where every given mask is 1, ``ignore_index`` (-100) elsewhere.

    ``labels[t] = input_ids[t] if completion_mask[t] == 1 and assistant_masks[t] == 1 else -100`` (masks that are
    ``None`` are not applied). Works on one sequence (``list[int]``) or on tensors of any shape, e.g. ``(B, T)``.
    """
    import torch

    if isinstance(input_ids, torch.Tensor):
        labels = input_ids.clone()
        for mask in (completion_mask, assistant_masks):
            if mask is not None:
                labels[torch.as_tensor(mask, device=labels.device) == 0] = ignore_index
        return labels
    labels = list(input_ids)
    for name, mask in (("completion_mask", completion_mask), ("assistant_masks", assistant_masks)):
        if mask is None:
            continue
        if len(mask) != len(labels):
            raise ValueError(f"{name} has {len(mask)} entries but input_ids has {len(labels)}; they must match.")
        labels = [t if m else ignore_index for t, m in zip(labels, mask)]
    return labels


# ----------------------------------------------------------------------------------------------------------------
# Mapping with row indices


class _WithRowIndex:
    """Picklable ``(example, idx) -> fn(example, row_index=idx, **kwargs)`` adapter for ``dataset.map``."""

    def __init__(self, fn: Callable[..., dict], kwargs: Mapping[str, Any]):
        self.fn = fn
        self.kwargs = dict(kwargs)

    def __call__(self, example: Mapping[str, Any], idx: int) -> dict:
        try:
            return self.fn(example, row_index=idx, **self.kwargs)
        except DataFormatError as err:
            raise (err if err.row is not None else err.with_row(idx)) from None


def map_with_row_index(
    dataset: Any, fn: Callable[..., dict], *, fn_kwargs: Mapping[str, Any] | None = None, **map_kwargs
):
    """``dataset.map(fn)`` where ``fn`` also receives ``row_index=<index of the row>``, so data errors name the row.

    Example:
        >>> ds = map_with_row_index(ds, tokenize_lm, fn_kwargs={"tokenizer": tok}, remove_columns=ds.column_names)
    """
    return dataset.map(_WithRowIndex(fn, fn_kwargs or {}), with_indices=True, **map_kwargs)
