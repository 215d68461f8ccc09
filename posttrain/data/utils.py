"""TRL's public data utilities (``trl.data_utils`` and friends), with TRL's semantics.

Row functions (use with ``dataset.map``): ``is_conversational``, ``is_conversational_from_value``,
``maybe_convert_to_chatml``, ``apply_chat_template``, ``maybe_apply_chat_template``, ``extract_prompt``,
``maybe_extract_prompt``, ``remove_none_values``. Dataset functions: ``unpair_preference_dataset``,
``maybe_unpair_preference_dataset``, ``truncate_dataset``, ``get_dataset_column_names`` (``pack_dataset`` lives in
``posttrain.data.packing``).

Deliberate differences from TRL, all on inputs where TRL crashes or silently does something unhelpful:
``is_conversational`` does not fail on empty lists; ``extract_prompt`` handles empty strings and a difference at
the very first element; ``truncate_dataset`` slices only token-level columns (lists of numbers), never message
lists; ``apply_chat_template`` also reads a row's ``tools`` column when no ``tools`` argument is given, and cuts the prompt at
the prefix shared by *all* renders (so ``prompt + chosen`` and ``prompt + rejected`` both equal their full renders);
``maybe_convert_to_chatml`` also maps ShareGPT's ``human``/``gpt`` roles to ``user``/``assistant``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from posttrain.data.chat_templates import prompt_generation_flags, render_chat, resolve_template_kwargs
from posttrain.data.formats import DataFormatError, is_messages

T = TypeVar("T")

_CONVERSATIONAL_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
_CHAT_TEMPLATE_KEY_SETS = (
    {"messages"},  # language modeling
    {"prompt"},  # prompt-only
    {"prompt", "completion"},  # prompt-completion
    {"prompt", "chosen", "rejected"},  # preference
    {"chosen", "rejected"},  # preference with implicit prompt
    {"prompt", "completion", "label"},  # unpaired preference
)


def is_conversational(example: Mapping[str, Any]) -> bool:
    """True iff one of ``prompt``/``chosen``/``rejected``/``completion``/``messages`` holds a list of messages
    (a list whose first item is a dict with a ``role`` key).

    Example:
        >>> is_conversational({"prompt": [{"role": "user", "content": "What color is the sky?"}]})
        True
        >>> is_conversational({"prompt": "The sky is"})
        False
    """
    return any(is_messages(example[key]) for key in _CONVERSATIONAL_KEYS if key in example)


def is_conversational_from_value(example: Mapping[str, Any]) -> bool:
    """True iff the row is ShareGPT-style: ``conversations`` is a list whose first item has ``from`` and ``value``."""
    conv = example.get("conversations")
    return isinstance(conv, list) and bool(conv) and isinstance(conv[0], Mapping) and {"from", "value"} <= set(conv[0])


def maybe_convert_to_chatml(example: dict[str, Any]) -> dict[str, Any]:
    """Convert ShareGPT turns to ChatML messages: in ``prompt``/``completion``/``chosen``/``rejected``/``messages``/
    ``conversations``, rename ``from`` → ``role`` and ``value`` → ``content``; rename ``conversations`` →
    ``messages``. ShareGPT role names ``human``/``gpt`` become ``user``/``assistant``. Mutates and returns.

    Example:
        >>> maybe_convert_to_chatml({"conversations": [{"from": "user", "value": "Hi"}]})
        {'messages': [{'role': 'user', 'content': 'Hi'}]}
    """
    roles = {"human": "user", "gpt": "assistant"}
    for key in ("prompt", "completion", "chosen", "rejected", "messages", "conversations"):
        value = example.get(key)
        if isinstance(value, list):
            for message in value:
                if isinstance(message, dict):
                    if "from" in message:
                        message["role"] = roles.get(message["from"], message["from"])
                        del message["from"]
                    if "value" in message:
                        message["content"] = message.pop("value")
    if "conversations" in example:
        example["messages"] = example.pop("conversations")
    return example


def common_prefix_length(ids: Sequence[Any], other_ids: Sequence[Any]) -> int:
    """Number of leading items ``ids`` and ``other_ids`` share (TRL's ``trl.data_utils.common_prefix_length``).

    Some chat templates render a prompt alone (with the generation prompt) differently from the same prompt followed
    by a completion; the completion then starts after this common prefix, not after the tokenized prompt.
    """
    n = 0
    for x, y in zip(ids, other_ids):
        if x != y:
            break
        n += 1
    return n


def _common_prefix(a: str, b: str) -> str:
    return a[: common_prefix_length(a, b)]


def apply_chat_template(
    example: Mapping[str, Any], processing_class: Any, tools: list | str | None = None, **template_kwargs: Any
) -> dict[str, Any]:
    """Render a conversational row to text, keeping its dataset type.

    ``messages`` → ``text`` (full conversation). ``prompt`` → rendered with a generation prompt when its last
    message is from the user or a tool, or continuing the final message when it is from the assistant (other roles
    raise ``ValueError``). ``completion``/``chosen``/``rejected`` with an explicit prompt are rendered as prompt+X;
    the prompt is then cut to the common *character* prefix of all renders (some templates, e.g. DeepSeek-R1's,
    render the generation prompt differently from a finished turn) and X is the rest of its render. Implicit-prompt
    ``chosen``/``rejected`` are rendered standalone. ``label`` is passed through.

    Args:
        example: A row with one of the key sets {messages}, {prompt}, {prompt, completion}, {prompt, chosen,
            rejected}, {chosen, rejected}, {prompt, completion, label} (other keys are ignored).
        processing_class: Tokenizer (or processor) with a chat template.
        tools: Tool schemas (list or JSON string; ``[]`` = none). Default: the row's ``tools`` column, if any.
        **template_kwargs: Extra chat-template variables; the row's ``chat_template_kwargs`` column overrides them.

    Raises:
        KeyError: The row's keys are none of the supported sets.
    """
    keys = {k for k in example if k in ("prompt", "chosen", "rejected", "completion", "messages", "label")}
    if keys not in _CHAT_TEMPLATE_KEY_SETS:
        raise KeyError(
            f"Invalid keys in the example: {sorted(keys)}. Expected one of: "
            + "; ".join(str(sorted(s)) for s in _CHAT_TEMPLATE_KEY_SETS)
        )
    for key in keys - {"label"}:
        if not is_messages(example[key]):
            raise DataFormatError(
                f"apply_chat_template needs lists of messages, got {type(example[key]).__name__}. Use "
                "maybe_apply_chat_template to leave standard rows unchanged.",
                column=key,
            )
    if tools is None:
        tools = example.get("tools")
    kwargs = resolve_template_kwargs(template_kwargs, example.get("chat_template_kwargs"))

    def render(messages, **flags):
        return render_chat(processing_class, messages, tools=tools, tokenize=False, **flags, **kwargs)

    output: dict[str, Any] = {}
    if "messages" in example:
        output["text"] = render(example["messages"])
    if "prompt" in example:
        add_generation_prompt, continue_final_message = prompt_generation_flags(example["prompt"])
        prompt = render(
            example["prompt"],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        fulls = {
            key: render(list(example["prompt"]) + list(example[key]))
            for key in ("chosen", "rejected", "completion")
            if key in example
        }
        for full in fulls.values():
            prompt = _common_prefix(prompt, full)
        output["prompt"] = prompt
        output.update({key: full[len(prompt) :] for key, full in fulls.items()})
    else:
        for key in ("chosen", "rejected"):
            if key in example:
                output[key] = render(example[key])
    if "label" in example:
        output["label"] = example["label"]
    return output


def maybe_apply_chat_template(
    example: Mapping[str, Any], processing_class: Any, tools: list | str | None = None, **template_kwargs: Any
) -> Mapping[str, Any]:
    """``apply_chat_template`` for conversational rows; standard rows are returned unchanged."""
    if is_conversational(example):
        return apply_chat_template(example, processing_class, tools, **template_kwargs)
    return example


def _split_index(chosen: Any, rejected: Any) -> int:
    """Length of the shared prompt: the longest common prefix, capped so both completions keep at least their last
    element; a space just before the split goes to the completions (``" blue."``, not ``"The sky is "``)."""
    n = min(len(chosen), len(rejected))
    idx = 0
    while idx < n and chosen[idx] == rejected[idx]:
        idx += 1
    idx = min(idx, max(n - 1, 0))
    if idx > 0 and isinstance(chosen, str) and chosen[idx - 1] == " ":
        idx -= 1
    return idx


def extract_prompt(example: Mapping[str, Any]) -> dict[str, Any]:
    """Split an implicit-prompt preference row into ``prompt``, ``chosen`` and ``rejected``.

    The prompt is the longest common prefix of ``chosen`` and ``rejected`` (message-wise for conversations,
    character-wise for strings).

    Example:
        >>> extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."})
        {'prompt': 'The sky is', 'chosen': ' blue.', 'rejected': ' green.'}
    """
    chosen, rejected = example["chosen"], example["rejected"]
    idx = _split_index(chosen, rejected)
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def maybe_extract_prompt(example: Mapping[str, Any]) -> Mapping[str, Any]:
    """``extract_prompt`` when the prompt is implicit.

    No-op for non-preference rows, and for rows whose ``prompt`` has the same format (standard/conversational) as
    ``chosen``. A ``prompt`` column in the other format (some datasets add a plain-text prompt to conversational
    pairs) is treated as implicit and replaced by the extracted one.
    """
    if "chosen" not in example or "rejected" not in example:
        return example
    if "prompt" in example:
        prompt_conv = is_conversational({"prompt": example["prompt"]})
        chosen_conv = is_conversational({"chosen": example["chosen"]})
        if prompt_conv == chosen_conv:
            return example
    return extract_prompt({"chosen": example["chosen"], "rejected": example["rejected"]})


def _unpair_batch(batch: dict[str, list]) -> dict[str, list]:
    n = len(batch["chosen"])
    out = {"completion": list(batch["chosen"]) + list(batch["rejected"]), "label": [True] * n + [False] * n}
    for key, values in batch.items():
        if key not in ("chosen", "rejected", "completion", "label"):
            out[key] = list(values) + list(values)  # prompt and extra columns: one copy per completion
    return out


def _is_iterable_dataset(dataset: Any) -> bool:
    import datasets

    return isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict))


def unpair_preference_dataset(dataset: T, num_proc: int | None = None, desc: str | None = None, **map_kwargs) -> T:
    """Turn a paired preference dataset into an unpaired one: each pair becomes two rows, ``completion`` = chosen
    with ``label=True`` and ``completion`` = rejected with ``label=False``; ``prompt`` and any extra columns are
    copied to both. Works on ``Dataset``, ``DatasetDict``, ``IterableDataset``.

    Example:
        >>> from datasets import Dataset
        >>> ds = Dataset.from_dict({"prompt": ["The sky is"], "chosen": [" blue."], "rejected": [" green."]})
        >>> unpair_preference_dataset(ds)[:]
        {'prompt': ['The sky is', 'The sky is'], 'completion': [' blue.', ' green.'], 'label': [True, False]}
    """
    if not _is_iterable_dataset(dataset):
        map_kwargs.update(num_proc=num_proc, desc=desc)
    names = get_dataset_column_names(dataset)
    remove = [c for c in ("chosen", "rejected", "completion", "label") if c in names]
    return dataset.map(_unpair_batch, batched=True, remove_columns=remove, **map_kwargs)


def maybe_unpair_preference_dataset(dataset: T, num_proc: int | None = None, desc: str | None = None) -> T:
    """``unpair_preference_dataset`` when the dataset has ``chosen`` and ``rejected`` columns, else unchanged."""
    names = get_dataset_column_names(dataset)
    if "chosen" in names and "rejected" in names:
        return unpair_preference_dataset(dataset, num_proc=num_proc, desc=desc)
    return dataset


def get_dataset_column_names(dataset: Any) -> list[str]:
    """Column names of a ``Dataset``, ``DatasetDict`` (first split) or ``IterableDataset`` (from its features, or its
    first row when the features are unknown)."""
    from posttrain.data.formats import column_names

    return column_names(dataset)


def _is_token_list_type(pa_type: Any) -> bool:
    import pyarrow as pa

    if not (pa.types.is_list(pa_type) or pa.types.is_large_list(pa_type)):
        return False
    value_type = pa_type.value_type
    return pa.types.is_integer(value_type) or pa.types.is_floating(value_type) or pa.types.is_boolean(value_type)


def _truncate_table(table: Any, max_length: int) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = [pc.list_slice(col, 0, max_length) if _is_token_list_type(col.type) else col for col in table.columns]
    return pa.Table.from_arrays(columns, names=table.column_names)


def _truncate_batch(batch: dict[str, list], max_length: int) -> dict[str, list]:
    out = {}
    for key, values in batch.items():
        first = next((v for v in values if v is not None), None)
        is_tokens = isinstance(first, list) and (not first or isinstance(first[0], (int, float, bool)))
        out[key] = [v[:max_length] if v is not None else v for v in values] if is_tokens else values
    return out


def truncate_dataset(dataset: T, max_length: int, map_kwargs: dict[str, Any] | None = None) -> T:
    """Truncate every token-level column (lists of ints/floats/bools, e.g. ``input_ids``, ``labels``,
    ``completion_mask``) to its first ``max_length`` items.

    ``Dataset`` objects are sliced in Arrow (``list_slice``) and keep their format; other datasets use a batched
    ``map``. Message lists and string columns are left alone.
    """
    import datasets

    if max_length is None or max_length < 0:
        raise ValueError(f"max_length must be a non-negative int, got {max_length!r}.")
    map_kwargs = dict(map_kwargs or {})
    if isinstance(dataset, datasets.DatasetDict):
        return datasets.DatasetDict({k: truncate_dataset(v, max_length, map_kwargs) for k, v in dataset.items()})
    if isinstance(dataset, datasets.Dataset):
        fmt = dataset.format
        out = dataset.with_format("arrow").map(_truncate_table, batched=True, fn_kwargs={"max_length": max_length},
                                               **map_kwargs)  # fmt: skip
        return out.with_format(
            fmt["type"], columns=fmt["columns"], output_all_columns=fmt["output_all_columns"], **fmt["format_kwargs"]
        )
    return dataset.map(_truncate_batch, batched=True, fn_kwargs={"max_length": max_length}, **map_kwargs)


def remove_none_values(example: T) -> T:
    """Recursively drop dict entries whose value is ``None`` (list items are kept).

    ``datasets`` stores rows with different keys under one schema and fills the missing keys with ``None``; chat
    templates that test ``is defined`` then misbehave. Apply per row, or on the fly with
    ``dataset.with_transform(remove_none_values)``.

    Example:
        >>> remove_none_values({"role": "user", "content": "Hi", "tool_calls": None})
        {'role': 'user', 'content': 'Hi'}
    """
    if isinstance(example, list):
        return [remove_none_values(v) if isinstance(v, (dict, list)) else v for v in example]
    if isinstance(example, Mapping):
        return {
            k: remove_none_values(v) if isinstance(v, (dict, list)) else v for k, v in example.items() if v is not None
        }
    return example
