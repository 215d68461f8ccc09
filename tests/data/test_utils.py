"""TRL data utilities (posttrain.data.utils, re-exported by posttrain.data_utils)."""

import json

import pytest
from datasets import Dataset, DatasetDict

from posttrain.data_utils import (
    apply_chat_template,
    extract_prompt,
    is_conversational,
    is_conversational_from_value,
    maybe_apply_chat_template,
    maybe_convert_to_chatml,
    maybe_extract_prompt,
    maybe_unpair_preference_dataset,
    remove_none_values,
    truncate_dataset,
    unpair_preference_dataset,
)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


GEN = "<|im_start|>assistant\n"


def turn(role, text):
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def test_is_conversational():
    assert is_conversational({"prompt": [user("Hi")]})
    assert is_conversational({"messages": [user("Hi")], "text": "x"})
    assert is_conversational({"chosen": [assistant("a")], "rejected": [assistant("b")]})
    assert not is_conversational({"prompt": "The sky is"})
    assert not is_conversational({"prompt": []})  # empty list: not conversational (TRL raises IndexError)
    assert not is_conversational({"conversations": [{"from": "human", "value": "Hi"}]})
    assert not is_conversational({"other": [user("Hi")]})


def test_is_conversational_from_value_and_convert_to_chatml():
    row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}], "id": 1}
    assert is_conversational_from_value(row)
    assert not is_conversational_from_value({"messages": [user("Hi")]})
    out = maybe_convert_to_chatml(row)
    assert out is row  # mutates and returns, as TRL
    assert out == {"messages": [user("Hi"), assistant("Yo")], "id": 1}
    pc = maybe_convert_to_chatml(
        {"prompt": [{"from": "user", "value": "Hi"}], "completion": [{"from": "assistant", "value": "Yo"}]}
    )
    assert pc == {"prompt": [user("Hi")], "completion": [assistant("Yo")]}
    assert maybe_convert_to_chatml({"text": "plain"}) == {"text": "plain"}


def test_apply_chat_template_language_modeling_and_prompt_only(tok):
    row = {"messages": [system("S"), user("Hi"), assistant("Yo")]}
    assert apply_chat_template(row, tok) == {
        "text": turn("system", "S") + turn("user", "Hi") + turn("assistant", "Yo")
    }
    assert apply_chat_template({"prompt": [user("Hi")]}, tok) == {"prompt": turn("user", "Hi") + GEN}
    # last message from the assistant -> continue it (no end-of-turn, no new generation prompt)
    cont = apply_chat_template({"prompt": [user("Hi"), assistant("The answer is")]}, tok)
    assert cont == {"prompt": turn("user", "Hi") + GEN + "The answer is"}
    # last message from a tool -> generation prompt
    tool = {"role": "tool", "content": "42"}
    assert apply_chat_template({"prompt": [user("Hi"), tool]}, tok)["prompt"].endswith(GEN)
    with pytest.raises(ValueError, match="last message has role 'system'"):
        apply_chat_template({"prompt": [system("S")]}, tok)


def test_apply_chat_template_completion_types(tok):
    prompt = [user("Hi")]
    out = apply_chat_template({"prompt": prompt, "completion": [assistant("Yo")]}, tok)
    assert out == {"prompt": turn("user", "Hi") + GEN, "completion": "Yo<|im_end|>\n"}
    out = apply_chat_template({"prompt": prompt, "chosen": [assistant("A")], "rejected": [assistant("B")]}, tok)
    assert out == {"prompt": turn("user", "Hi") + GEN, "chosen": "A<|im_end|>\n", "rejected": "B<|im_end|>\n"}
    out = apply_chat_template({"prompt": prompt, "completion": [assistant("Yo")], "label": False}, tok)
    assert out["label"] is False and out["completion"] == "Yo<|im_end|>\n"
    implicit = {"chosen": [user("Hi"), assistant("A")], "rejected": [user("Hi"), assistant("B")]}
    out = apply_chat_template(implicit, tok)
    assert out == {
        "chosen": turn("user", "Hi") + turn("assistant", "A"),
        "rejected": turn("user", "Hi") + turn("assistant", "B"),
    }
    with pytest.raises(ValueError, match="needs lists of messages"):
        apply_chat_template({"prompt": "The sky is", "completion": " blue."}, tok)
    with pytest.raises(KeyError, match="Invalid keys"):
        apply_chat_template({"prompt": prompt, "chosen": [assistant("A")]}, tok)


def test_apply_chat_template_prompt_is_common_prefix_of_all_renders(tok):
    # a template whose generation prompt differs from a finished turn (DeepSeek-R1 style <think> prefill)
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant><think>{% endif %}"
    )
    out = apply_chat_template(
        {"prompt": [user("Q")], "chosen": [assistant("A")], "rejected": [assistant("<think>B")]},
        tok,
        chat_template=template,
    )
    assert out["prompt"] == "<user>Q<assistant>"
    assert out["prompt"] + out["chosen"] == "<user>Q<assistant>A"
    assert out["prompt"] + out["rejected"] == "<user>Q<assistant><think>B"


def test_apply_chat_template_tools_and_kwargs(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    row = {"messages": [user("Weather?"), assistant("Sunny")]}
    with_list = apply_chat_template(row, tok, tools=tools)["text"]
    assert "get_weather" in with_list and "# Tools" in with_list
    # per-row tools column, as a JSON string (datasets < 4.7)
    assert apply_chat_template({**row, "tools": json.dumps(tools)}, tok)["text"] == with_list
    # tools=[] is "no tools"
    assert "# Tools" not in apply_chat_template(row, tok, tools=[])["text"]
    # per-row chat_template_kwargs override the call's kwargs
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    out = apply_chat_template(
        {**row, "chat_template_kwargs": {"greeting": "row:"}}, tok, chat_template=template, greeting="call:"
    )
    assert out["text"] == "row:Weather?Sunny"


def test_maybe_apply_chat_template(tok):
    standard = {"prompt": "The sky is", "completion": " blue."}
    assert maybe_apply_chat_template(standard, tok) is standard
    assert maybe_apply_chat_template({"prompt": [user("Hi")]}, tok) == {"prompt": turn("user", "Hi") + GEN}


def test_extract_prompt_standard_and_conversational():
    assert extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."}) == {
        "prompt": "The sky is",
        "chosen": " blue.",
        "rejected": " green.",
    }
    chosen = [user("What color?"), assistant("Blue.")]
    rejected = [user("What color?"), assistant("Green.")]
    assert extract_prompt({"chosen": chosen, "rejected": rejected}) == {
        "prompt": [user("What color?")],
        "chosen": [assistant("Blue.")],
        "rejected": [assistant("Green.")],
    }
    # multi-turn: the prompt is every shared message
    c = [system("S"), user("a"), assistant("b"), user("c"), assistant("d1")]
    r = [system("S"), user("a"), assistant("b"), user("c"), assistant("d2")]
    assert extract_prompt({"chosen": c, "rejected": r})["prompt"] == c[:4]


def test_extract_prompt_edge_cases():
    # identical pairs: each completion keeps its last element
    assert extract_prompt({"chosen": "abc", "rejected": "abc"}) == {"prompt": "ab", "chosen": "c", "rejected": "c"}
    # one is a prefix of the other
    assert extract_prompt({"chosen": "abc", "rejected": "abcd"}) == {"prompt": "ab", "chosen": "c", "rejected": "cd"}
    # nothing shared, and a trailing space in chosen (TRL would index chosen[-1])
    assert extract_prompt({"chosen": "x ", "rejected": "y"}) == {"prompt": "", "chosen": "x ", "rejected": "y"}
    assert extract_prompt({"chosen": "", "rejected": ""}) == {"prompt": "", "chosen": "", "rejected": ""}
    assert extract_prompt({"chosen": "Été chaud", "rejected": "Été froid"}) == {
        "prompt": "Été",
        "chosen": " chaud",
        "rejected": " froid",
    }


def test_maybe_extract_prompt():
    explicit = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    assert maybe_extract_prompt(explicit) is explicit
    assert maybe_extract_prompt({"prompt": "x"}) == {"prompt": "x"}
    implicit = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    assert maybe_extract_prompt(implicit)["prompt"] == "The sky is"
    # a text prompt next to conversational pairs is treated as implicit
    mixed = {"prompt": "What color?", "chosen": [user("Q"), assistant("A")], "rejected": [user("Q"), assistant("B")]}
    assert maybe_extract_prompt(mixed)["prompt"] == [user("Q")]


def test_unpair_preference_dataset_copies_prompt_and_extra_columns():
    ds = Dataset.from_dict(
        {"prompt": ["p1", "p2"], "chosen": ["c1", "c2"], "rejected": ["r1", "r2"], "source": ["s1", "s2"]}
    )
    out = unpair_preference_dataset(ds)
    assert sorted(out.column_names) == ["completion", "label", "prompt", "source"]
    rows = sorted(zip(out["prompt"], out["completion"], out["label"], out["source"]))
    assert rows == [
        ("p1", "c1", True, "s1"),
        ("p1", "r1", False, "s1"),
        ("p2", "c2", True, "s2"),
        ("p2", "r2", False, "s2"),
    ]
    dd = unpair_preference_dataset(DatasetDict({"train": ds, "test": ds.select([0])}))
    assert len(dd["train"]) == 4 and len(dd["test"]) == 2
    it = unpair_preference_dataset(ds.to_iterable_dataset())
    assert len(list(it)) == 4


def test_unpair_conversational_implicit_prompt():
    ds = Dataset.from_list([{"chosen": [user("Q"), assistant("A")], "rejected": [user("Q"), assistant("B")]}])
    out = unpair_preference_dataset(ds)
    assert out.column_names == ["completion", "label"]
    assert out[0]["completion"] == [user("Q"), assistant("A")] and out[1]["label"] is False


def test_maybe_unpair_preference_dataset():
    unpaired = Dataset.from_dict({"prompt": ["p"], "completion": ["c"], "label": [True]})
    assert maybe_unpair_preference_dataset(unpaired) is unpaired
    paired = Dataset.from_dict({"prompt": ["p"], "chosen": ["c"], "rejected": ["r"]})
    assert len(maybe_unpair_preference_dataset(paired)) == 2


def test_truncate_dataset_slices_token_columns_only():
    messages = [[user("a"), assistant("b"), user("c")]]
    ds = Dataset.from_dict(
        {"input_ids": [[1, 2, 3, 4]], "completion_mask": [[0, 0, 1, 1]], "text": ["abcd"], "messages": messages}
    ).with_format("torch", columns=["input_ids", "completion_mask"], output_all_columns=True)
    out = truncate_dataset(ds, 2)
    assert out.format["type"] == "torch" and out.format["columns"] == ["input_ids", "completion_mask"]
    row = out[0]
    assert row["input_ids"].tolist() == [1, 2] and row["completion_mask"].tolist() == [0, 0]
    assert row["text"] == "abcd" and len(row["messages"]) == 3
    it = truncate_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3]], "text": ["x"]}).to_iterable_dataset(), 1)
    assert list(it) == [{"input_ids": [1], "text": "x"}]
    with pytest.raises(ValueError, match="max_length"):
        truncate_dataset(ds, -1)


def test_remove_none_values():
    batch = {"messages": [[{"role": "user", "content": "Hi", "tool_calls": None}]], "score": [None]}
    assert remove_none_values(batch) == {"messages": [[{"role": "user", "content": "Hi"}]], "score": [None]}
    nested = {"a": {"b": None, "c": [1, None, {"d": None}]}, "e": None}
    assert remove_none_values(nested) == {"a": {"c": [1, None, {}]}}
    assert remove_none_values([None, {"x": None}]) == [None, {}]
