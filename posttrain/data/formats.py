"""Dataset formats and types: detection, validation and the errors every trainer raises for bad data.

A dataset has a *format* (standard = plain strings, conversational = lists of ``{"role", "content"}`` messages) and
a *type*, given by its columns (TRL's "Dataset formats and types"):

=============================  ==================================================  =======================
type                           columns                                             used by
=============================  ==================================================  =======================
``language_modeling``          ``text`` (or ``dataset_text_field``) / ``messages``  SFT
                               (ShareGPT ``conversations`` from/value accepted)
``prompt_only``                ``prompt``                                          GRPO, RLOO, distillation
``prompt_completion``          ``prompt``, ``completion``                          SFT
``preference``                 ``prompt``, ``chosen``, ``rejected``; or implicit   DPO, KTO, reward
                               prompt: ``chosen``, ``rejected``
``unpaired_preference``        ``prompt``, ``completion``, ``label``               KTO
``stepwise_supervision``       ``prompt``, ``completions``, ``labels``             PRM
``tokenized_*``                ``input_ids`` / ``chosen_ids``+``rejected_ids`` /   pre-tokenized data
                               ``prompt_ids``+``completion_ids``+``label``
=============================  ==================================================  =======================

``detect_format`` says which format a dataset (or one row) is in; ``validate_format`` checks it against the types a
trainer accepts and otherwise raises a ``DataFormatError`` naming the columns found, the accepted types and an
example row of each. ``check_row`` validates the values of one row (strings vs messages, roles, labels) and names the
row index and column of the first problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LANGUAGE_MODELING = "language_modeling"
PROMPT_ONLY = "prompt_only"
PROMPT_COMPLETION = "prompt_completion"
PREFERENCE = "preference"
UNPAIRED_PREFERENCE = "unpaired_preference"
STEPWISE_SUPERVISION = "stepwise_supervision"
TOKENIZED_LANGUAGE_MODELING = "tokenized_language_modeling"
TOKENIZED_PREFERENCE = "tokenized_preference"
TOKENIZED_UNPAIRED_PREFERENCE = "tokenized_unpaired_preference"

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
# Columns whose value is either a string (standard) or a list of messages (conversational).
TEXT_OR_MESSAGES_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages")


class DataFormatError(ValueError):
    """A dataset, or one of its rows, does not have the columns or values a trainer needs.

    ``row`` (index in the dataset, when known) and ``column`` are kept as attributes so callers can re-raise with
    more context; the message always names them when they are known.
    """

    def __init__(self, message: str, *, row: int | None = None, column: str | None = None):
        self.row = row
        self.column = column
        self.problem = message
        super().__init__(_locate(message, row, column))

    def with_row(self, row: int) -> DataFormatError:
        """A copy of this error that names ``row`` (used when the row index is only known to the caller)."""
        return DataFormatError(self.problem, row=row, column=self.column)

    def __reduce__(self):
        # keep row/column when the error crosses a process boundary (dataset.map with num_proc)
        return _rebuild_data_format_error, (self.problem, self.row, self.column)


def _rebuild_data_format_error(problem: str, row: int | None, column: str | None) -> DataFormatError:
    return DataFormatError(problem, row=row, column=column)


def _locate(message: str, row: int | None, column: str | None) -> str:
    where = []
    if row is not None:
        where.append(f"row {row}")
    if column is not None:
        where.append(f"column {column!r}")
    if not where:
        return message
    location = ", ".join(where)
    return f"{location[0].upper()}{location[1:]}: {message}"


@dataclass(frozen=True)
class DatasetFormat:
    """The detected type and format of a dataset or row.

    Attributes:
        type: One of the type names above (e.g. ``"preference"``).
        conversational: ``True`` when the text columns hold lists of messages.
        implicit_prompt: For ``preference``: ``True`` when there is no ``prompt`` column (the prompt is the common
            start of ``chosen`` and ``rejected``).
        sharegpt: ``True`` for ShareGPT ``conversations`` rows (``from``/``value`` keys), converted to ``messages``.
    """

    type: str
    conversational: bool
    implicit_prompt: bool = False
    sharegpt: bool = False

    @property
    def is_tokenized(self) -> bool:
        return self.type.startswith("tokenized_")

    def __str__(self) -> str:
        if self.is_tokenized:
            return self.type.replace("_", " ")
        kind = "conversational" if self.conversational else "standard"
        name = self.type.replace("_", " ")
        if self.type == PREFERENCE:
            name += " (implicit prompt)" if self.implicit_prompt else " (explicit prompt)"
        return f"{kind} {name}"


@dataclass(frozen=True)
class _TypeSpec:
    name: str
    columns: str
    standard_example: dict
    conversational_example: dict | None = None


_USER = {"role": "user", "content": "What color is the sky?"}
_BLUE = {"role": "assistant", "content": "It is blue."}
_GREEN = {"role": "assistant", "content": "It is green."}

TYPE_SPECS: dict[str, _TypeSpec] = {
    spec.name: spec
    for spec in [
        _TypeSpec(LANGUAGE_MODELING, "text (or your dataset_text_field) | messages", {"text": "The sky is blue."},
                  {"messages": [_USER, _BLUE]}),
        _TypeSpec(PROMPT_ONLY, "prompt", {"prompt": "The sky is"}, {"prompt": [_USER]}),
        _TypeSpec(PROMPT_COMPLETION, "prompt, completion", {"prompt": "The sky is", "completion": " blue."},
                  {"prompt": [_USER], "completion": [_BLUE]}),
        _TypeSpec(PREFERENCE, "prompt, chosen, rejected (or implicit prompt: chosen, rejected)",
                  {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
                  {"prompt": [_USER], "chosen": [_BLUE], "rejected": [_GREEN]}),
        _TypeSpec(UNPAIRED_PREFERENCE, "prompt, completion, label",
                  {"prompt": "The sky is", "completion": " blue.", "label": True},
                  {"prompt": [_USER], "completion": [_BLUE], "label": True}),
        _TypeSpec(STEPWISE_SUPERVISION, "prompt, completions, labels",
                  {"prompt": "Which number is larger, 9.8 or 9.11?",
                   "completions": ["The fractional part of 9.8 is 0.8.", "So 9.11 is larger."],
                   "labels": [True, False]}),
        _TypeSpec(TOKENIZED_LANGUAGE_MODELING, "input_ids (optional labels, completion_mask, assistant_masks)",
                  {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}),
        _TypeSpec(TOKENIZED_PREFERENCE, "chosen_ids, rejected_ids (optional prompt_ids, margin)",
                  {"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]}),
        _TypeSpec(TOKENIZED_UNPAIRED_PREFERENCE, "prompt_ids, completion_ids, label",
                  {"prompt_ids": [1, 2], "completion_ids": [3, 4], "label": True}),
    ]
}  # fmt: skip
ALL_TYPES = tuple(TYPE_SPECS)


# ----------------------------------------------------------------------------------------------------------------
# Detection


def is_messages(value: Any) -> bool:
    """True iff ``value`` is a non-empty list whose first item is a dict with a ``role`` key."""
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], Mapping) and "role" in value[0]


def _type_from_columns(columns: Iterable[str], text_field: str = "text") -> tuple[str, bool] | None:
    """(type, implicit_prompt) from column names, most specific first; ``None`` if no type fits."""
    cols = set(columns)
    if {"chosen_ids", "rejected_ids"} <= cols or {"chosen_input_ids", "rejected_input_ids"} <= cols:
        return TOKENIZED_PREFERENCE, "prompt_ids" not in cols
    if {"prompt_ids", "completion_ids", "label"} <= cols:
        return TOKENIZED_UNPAIRED_PREFERENCE, False
    if "input_ids" in cols:
        return TOKENIZED_LANGUAGE_MODELING, False
    if {"prompt", "completions", "labels"} <= cols:
        return STEPWISE_SUPERVISION, False
    if {"prompt", "completion", "label"} <= cols:
        return UNPAIRED_PREFERENCE, False
    if {"chosen", "rejected"} <= cols:
        return PREFERENCE, "prompt" not in cols
    if {"prompt", "completion"} <= cols:
        return PROMPT_COMPLETION, False
    if "prompt" in cols:
        return PROMPT_ONLY, False
    if "messages" in cols or "conversations" in cols or text_field in cols:
        return LANGUAGE_MODELING, False
    return None


def _row_is_conversational(row: Mapping[str, Any]) -> tuple[bool, bool]:
    """(conversational, sharegpt) for one row."""
    for key in TEXT_OR_MESSAGES_COLUMNS:
        if key in row and is_messages(row[key]):
            return True, False
    conv = row.get("conversations")
    if isinstance(conv, list) and conv and isinstance(conv[0], Mapping) and {"from", "value"} <= set(conv[0]):
        return True, True
    return False, False


def _feature_is_conversational(feature: Any) -> bool:
    """Best effort from ``datasets`` features, for empty datasets: a list of structs with a ``role`` field."""
    inner = getattr(feature, "feature", None)
    if isinstance(feature, list) and feature:
        inner = feature[0]
    return isinstance(inner, Mapping) and "role" in inner


IMAGE_COLUMNS = ("image", "images")


def is_vision_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` (or any split of a dict of them) has an ``image`` or ``images`` column."""
    splits = dataset.values() if isinstance(dataset, Mapping) and not hasattr(dataset, "column_names") else [dataset]
    return any(d is not None and set(IMAGE_COLUMNS) & set(column_names(d) or []) for d in splits)


def column_names(data: Any) -> list[str]:
    """Column names of a row (dict), a ``datasets.Dataset``/``IterableDataset``, a list of rows or a list of names.

    ``IterableDataset`` objects without known columns are peeked at (the first row is read).
    """
    names = getattr(data, "column_names", None)
    if isinstance(names, Mapping):  # DatasetDict: {split: [names]}
        names = next(iter(names.values()), [])
    if names is not None:
        return list(names)
    if isinstance(data, Mapping):
        return list(data.keys())
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)) and all(isinstance(x, str) for x in data):
        return list(data)
    first = _first_row(data)
    if first is None and not hasattr(data, "__iter__"):
        raise TypeError(f"Cannot read column names from {type(data).__name__}; pass a dict row or a datasets.Dataset.")
    return list(first) if first is not None else []


def _first_row(data: Any) -> Mapping[str, Any] | None:
    """The first row of a row, dataset or list of rows (``None`` when empty or when ``data`` is a list of names)."""
    if isinstance(data, Mapping):
        return data
    if hasattr(data, "column_names") and hasattr(data, "__len__"):  # datasets.Dataset
        return data[0] if len(data) > 0 else None
    if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        return None
    for row in data:  # IterableDataset or a list of rows
        return row if isinstance(row, Mapping) else None
    return None


def detect_format(data: Any, *, text_field: str = "text") -> DatasetFormat:
    """Which type and format a dataset, or one row, is in.

    Args:
        data: A row (``dict``), a ``datasets.Dataset`` / ``IterableDataset`` / ``DatasetDict`` (its first split is
            inspected), or a list of column names (then ``conversational`` is ``False``).
        text_field: Name of the text column for standard language-modeling data (SFT's ``dataset_text_field``).

    Returns:
        A ``DatasetFormat``. Column priority follows TRL: pre-tokenized columns first, then stepwise supervision,
        unpaired preference, preference, prompt-completion, prompt-only, language modeling.

    Raises:
        DataFormatError: No known type fits the columns; the message names the columns found and lists every type.
    """
    if hasattr(data, "column_names") and isinstance(data.column_names, Mapping):  # DatasetDict
        data = next(iter(data.values()))
    names = column_names(data)
    found = _type_from_columns(names, text_field)
    if found is None:
        raise DataFormatError(_no_match_message(names, ALL_TYPES, text_field=text_field))
    type_, implicit = found
    if type_.startswith("tokenized_"):
        return DatasetFormat(type_, conversational=False, implicit_prompt=implicit)
    row = _first_row(data)
    if row is not None:
        conversational, sharegpt = _row_is_conversational(row)
    else:
        features = getattr(data, "features", None) or {}
        conversational = any(_feature_is_conversational(features.get(k)) for k in (*TEXT_OR_MESSAGES_COLUMNS,))
        sharegpt = "conversations" in features
        conversational = conversational or sharegpt
    return DatasetFormat(type_, conversational=conversational, implicit_prompt=implicit, sharegpt=sharegpt)


def example_rows(type_name: str) -> list[dict]:
    """The documented example rows (standard, then conversational when it exists) of a dataset type."""
    spec = TYPE_SPECS[type_name]
    rows = [spec.standard_example]
    if spec.conversational_example is not None:
        rows.append(spec.conversational_example)
    if type_name == PREFERENCE:
        rows.append({"chosen": "The sky is blue.", "rejected": "The sky is green."})
    return rows


def _no_match_message(names: Sequence[str], accepted: Sequence[str], *, trainer: str | None = None,
                      text_field: str = "text", detected: DatasetFormat | None = None) -> str:  # fmt: skip
    who = trainer or "This trainer"
    lines = []
    if detected is None:
        lines.append(f"The dataset's columns {sorted(names)} do not match any dataset type {who} accepts.")
    else:
        lines.append(
            f"The dataset's columns {sorted(names)} make it a {detected} dataset, which {who} does not accept."
        )
    lines.append("Accepted types, with their columns and an example row:")
    for name in accepted:
        spec = TYPE_SPECS[name]
        cols = spec.columns.replace("text (or your dataset_text_field)", text_field)
        examples = " or ".join(json.dumps(row, ensure_ascii=False) for row in example_rows(name))
        lines.append(f"  - {name} [{cols}]: {examples}")
    lines.append(
        "Rename or add columns to match one of these (dataset.rename_column / dataset.map), or convert the type "
        "(e.g. posttrain.data_utils.unpair_preference_dataset, extract_prompt)."
    )
    return "\n".join(lines)


def validate_format(
    data: Any,
    accepted: Sequence[str],
    *,
    trainer: str | None = None,
    text_field: str = "text",
    check_first_row: bool = True,
) -> DatasetFormat:
    """Detect the dataset's format and check that the trainer accepts it.

    Args:
        data: A dataset or row, as for ``detect_format``.
        accepted: Type names the trainer accepts (e.g. ``["language_modeling", "prompt_completion"]``).
        trainer: Trainer name for the error message (e.g. ``"SFTTrainer"``).
        text_field: Text column of standard language-modeling data.
        check_first_row: Also run ``check_row`` on the first row, so a wrong value kind is reported up front.

    Raises:
        DataFormatError: The type is not accepted (or no type fits): the message names the columns found, the
            accepted types and an example row of each.
    """
    unknown = [a for a in accepted if a not in TYPE_SPECS]
    if unknown:
        raise ValueError(f"Unknown dataset type(s) {unknown}. Valid types: {', '.join(ALL_TYPES)}.")
    names = column_names(data)
    try:
        fmt = detect_format(data, text_field=text_field)
    except DataFormatError:
        raise DataFormatError(_no_match_message(names, accepted, trainer=trainer, text_field=text_field)) from None
    if fmt.type not in accepted:
        raise DataFormatError(_no_match_message(names, accepted, trainer=trainer, text_field=text_field, detected=fmt))
    if check_first_row:
        row = _first_row(data)
        if row is not None:
            check_row(row, fmt, row_index=0, text_field=text_field)
    return fmt


# ----------------------------------------------------------------------------------------------------------------
# Row validation


def check_messages(messages: Any, *, row: int | None, column: str, allow_empty: bool = False) -> None:
    """Raise ``DataFormatError`` unless ``messages`` is a list of ``{"role", "content"}`` dicts with known roles."""
    if not isinstance(messages, list):
        raise DataFormatError(
            f"expected a list of messages, got {type(messages).__name__}. Use a list of "
            '{"role": ..., "content": ...} dicts.',
            row=row,
            column=column,
        )
    if not messages and not allow_empty:
        raise DataFormatError(
            "the list of messages is empty. Drop this row or give it at least one message.", row=row, column=column
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise DataFormatError(
                f"message {i} is {message!r}; every message must be a dict with a 'role' key "
                "(ShareGPT 'from'/'value' rows are converted only in a 'conversations' column).",
                row=row,
                column=column,
            )
        role = message["role"]
        if role not in MESSAGE_ROLES:
            raise DataFormatError(
                f"message {i} has role {role!r}; valid roles are {', '.join(MESSAGE_ROLES)}.", row=row, column=column
            )
        content = message.get("content")
        if content is None and not message.get("tool_calls") and role != "assistant":
            raise DataFormatError(
                f"message {i} ({role}) has no content. Give it a 'content' string.", row=row, column=column
            )
        if content is not None and not isinstance(content, (str, list)):
            raise DataFormatError(
                f"message {i} has content of type {type(content).__name__}; expected a string (or a list of "
                "content blocks).",
                row=row,
                column=column,
            )


def check_text(value: Any, *, row: int | None, column: str) -> None:
    """Raise ``DataFormatError`` unless ``value`` is a string."""
    if not isinstance(value, str):
        raise DataFormatError(
            f"expected a string in a standard dataset, got {type(value).__name__} ({_short(value)}). "
            "Fix the value or drop the row (e.g. dataset.filter).",
            row=row,
            column=column,
        )


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def check_row(row: Mapping[str, Any], fmt: DatasetFormat, *, row_index: int | None = None, text_field: str = "text"):
    """Validate the values of one row against its dataset format; raise ``DataFormatError`` naming row and column.

    Checks: text columns are strings (standard) or message lists (conversational), in the same format across the
    row's columns; ``label`` is a bool; stepwise ``labels`` match ``completions`` in length.
    """
    if fmt.is_tokenized:
        for key, value in row.items():
            if key.endswith("_ids") and not isinstance(value, (list, tuple)) and not hasattr(value, "tolist"):
                raise DataFormatError(
                    f"expected a list of token ids, got {type(value).__name__}.", row=row_index, column=key
                )
        return
    if fmt.type == LANGUAGE_MODELING:
        if "messages" in row:
            check_messages(row["messages"], row=row_index, column="messages")
        elif "conversations" in row:
            conv = row["conversations"]
            if not isinstance(conv, list) or not conv:
                raise DataFormatError("expected a non-empty list of turns.", row=row_index, column="conversations")
            for i, turn in enumerate(conv):
                if not isinstance(turn, Mapping) or not ({"from", "value"} <= set(turn) or "role" in turn):
                    raise DataFormatError(
                        f"turn {i} is {_short(turn)}; ShareGPT turns need 'from' and 'value' keys.",
                        row=row_index,
                        column="conversations",
                    )
        else:
            check_text(row.get(text_field), row=row_index, column=text_field)
        return
    columns = [c for c in ("prompt", "completion", "chosen", "rejected") if c in row]
    if fmt.type == PREFERENCE and "prompt" in row and is_messages(row["prompt"]) != is_messages(row.get("chosen")):
        # a prompt column in the other format is ignored: the prompt is implicit (see maybe_extract_prompt)
        columns.remove("prompt")
    for column in columns:
        value = row[column]
        if fmt.conversational:
            # an empty completion list is a bad row too: there is nothing to train on
            check_messages(value, row=row_index, column=column)
        else:
            check_text(value, row=row_index, column=column)
    if fmt.type == UNPAIRED_PREFERENCE and not isinstance(row.get("label"), bool):
        label = row.get("label")
        if not (isinstance(label, int) and label in (0, 1)):
            raise DataFormatError(
                f"expected a bool (True = desirable), got {_short(label)}.", row=row_index, column="label"
            )
    if fmt.type == STEPWISE_SUPERVISION:
        completions, labels = row.get("completions"), row.get("labels")
        if not isinstance(completions, list) or not isinstance(labels, list) or len(completions) != len(labels):
            raise DataFormatError(
                "'completions' and 'labels' must be lists of the same length (one bool per step).",
                row=row_index,
                column="labels",
            )
