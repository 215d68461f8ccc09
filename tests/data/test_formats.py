"""Format detection, validation and row checks (posttrain.data.formats)."""

import pickle

import pytest
from datasets import Dataset

from posttrain.data.formats import (
    ALL_TYPES,
    DataFormatError,
    DatasetFormat,
    check_row,
    detect_format,
    example_rows,
    validate_format,
)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


CASES = [
    ({"text": "The sky is blue."}, "language_modeling", False),
    ({"messages": [user("Hi"), assistant("Hello")]}, "language_modeling", True),
    ({"conversations": [{"from": "human", "value": "Hi"}]}, "language_modeling", True),
    ({"prompt": "The sky is"}, "prompt_only", False),
    ({"prompt": [user("Hi")]}, "prompt_only", True),
    ({"prompt": "The sky is", "completion": " blue."}, "prompt_completion", False),
    ({"prompt": [user("Hi")], "completion": [assistant("Yo")]}, "prompt_completion", True),
    ({"prompt": "a", "chosen": "b", "rejected": "c"}, "preference", False),
    ({"chosen": [user("Hi"), assistant("a")], "rejected": [user("Hi"), assistant("b")]}, "preference", True),
    ({"prompt": "a", "completion": "b", "label": True}, "unpaired_preference", False),
    ({"prompt": "a", "completions": ["x", "y"], "labels": [True, False]}, "stepwise_supervision", False),
    ({"input_ids": [1, 2], "text": "ab"}, "tokenized_language_modeling", False),
    ({"chosen_ids": [1], "rejected_ids": [2]}, "tokenized_preference", False),
    ({"prompt_ids": [1], "completion_ids": [2], "label": False}, "tokenized_unpaired_preference", False),
]


@pytest.mark.parametrize("row, type_, conversational", CASES)
def test_detect_format_rows_and_datasets(row, type_, conversational):
    fmt = detect_format(row)
    assert (fmt.type, fmt.conversational) == (type_, conversational)
    # the same answer for a one-row dataset, and for its column names alone (format unknown -> standard)
    ds_fmt = detect_format(Dataset.from_list([row]))
    assert (ds_fmt.type, ds_fmt.conversational) == (type_, conversational)
    assert detect_format(list(row)).type == type_


def test_detect_format_flags_and_str():
    fmt = detect_format({"chosen": "The sky is blue.", "rejected": "The sky is green."})
    assert fmt.implicit_prompt and str(fmt) == "standard preference (implicit prompt)"
    fmt = detect_format({"prompt": [user("Hi")], "chosen": [assistant("a")], "rejected": [assistant("b")]})
    assert not fmt.implicit_prompt and str(fmt) == "conversational preference (explicit prompt)"
    assert detect_format({"conversations": [{"from": "human", "value": "Hi"}]}).sharegpt
    assert detect_format({"input_ids": [1]}).is_tokenized
    assert detect_format({"body": "x"}, text_field="body").type == "language_modeling"


def test_detect_format_extra_columns_and_empty_dataset():
    fmt = detect_format({"prompt": "a", "completion": "b", "source": "web", "id": 3})
    assert fmt.type == "prompt_completion"
    empty = Dataset.from_dict({"prompt": [], "completion": []})
    assert detect_format(empty).type == "prompt_completion"


def test_detect_format_iterable_dataset():
    ds = Dataset.from_list([{"prompt": [user("Hi")]}]).to_iterable_dataset()
    fmt = detect_format(ds)
    assert fmt == DatasetFormat("prompt_only", conversational=True)


def test_detect_format_unknown_names_columns():
    with pytest.raises(DataFormatError) as info:
        detect_format({"question": "q", "answer": "a"})
    message = str(info.value)
    assert "['answer', 'question']" in message
    for type_ in ALL_TYPES:
        assert type_ in message


def test_validate_format_error_names_columns_accepted_types_and_examples():
    ds = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataFormatError) as info:
        validate_format(ds, ["language_modeling", "prompt_completion"], trainer="SFTTrainer")
    message = str(info.value)
    assert "['chosen', 'prompt', 'rejected']" in message
    assert "standard preference (explicit prompt)" in message
    assert "SFTTrainer" in message
    assert "language_modeling" in message and "prompt_completion" in message
    assert '{"text": "The sky is blue."}' in message  # an example row of each accepted type
    assert '"completion": [{"role": "assistant", "content": "It is blue."}]' in message
    assert "preference" not in message.split("Accepted types")[1].split("Rename")[0].replace("prompt_completion", "")


def test_validate_format_accepts_and_checks_first_row():
    ds = Dataset.from_list([{"prompt": "Hi", "completion": "Yo"}])
    assert validate_format(ds, ["prompt_completion"]).type == "prompt_completion"
    bad = Dataset.from_list([{"prompt": "Hi", "completion": None}])
    with pytest.raises(DataFormatError, match=r"Row 0, column 'completion'"):
        validate_format(bad, ["prompt_completion"])
    with pytest.raises(ValueError, match="Unknown dataset type"):
        validate_format(ds, ["prompt-completion"])


@pytest.mark.parametrize(
    "row, column, fragment",
    [
        ({"messages": "hi"}, "messages", "expected a list of messages"),
        ({"messages": []}, "messages", "empty"),
        ({"messages": [{"content": "x"}]}, "messages", "'role' key"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "role 'robot'"),
        ({"messages": [{"role": "user", "content": None}]}, "messages", "no content"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages", "content of type int"),
        ({"text": None}, "text", "expected a string"),
        ({"prompt": "a", "completion": "b", "label": "yes"}, "label", "expected a bool"),
        ({"prompt": "a", "completions": ["x"], "labels": []}, "labels", "same length"),
        ({"input_ids": 5}, "input_ids", "list of token ids"),
    ],
)
def test_check_row_names_row_and_column(row, column, fragment):
    fmt = detect_format(list(row)) if column != "messages" else DatasetFormat("language_modeling", True)
    with pytest.raises(DataFormatError) as info:
        check_row(row, fmt, row_index=7)
    assert info.value.row == 7 and info.value.column == column
    assert str(info.value).startswith(f"Row 7, column {column!r}: ")
    assert fragment in str(info.value)


def test_check_row_accepts_tool_calls_non_ascii_and_mismatched_implicit_prompt():
    messages = [
        user("Allume la lumière ☀"),
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "name": "f", "content": "ok"},
        assistant("Fait ✓"),
    ]
    check_row({"messages": messages}, DatasetFormat("language_modeling", True), row_index=0)
    # a plain-text prompt next to conversational pairs is ignored (treated as implicit)
    row = {"prompt": "x", "chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("c")]}
    check_row(row, detect_format(row), row_index=0)


def test_example_rows_are_detected_as_their_type():
    for type_ in ALL_TYPES:
        for row in example_rows(type_):
            assert detect_format(row).type == type_


def test_data_format_error_survives_pickling():
    err = DataFormatError("bad value", row=3, column="prompt")
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.row, clone.column, str(clone)) == (3, "prompt", str(err))
    assert isinstance(err, ValueError)
    assert str(err.with_row(9)).startswith("Row 9, column 'prompt'")
