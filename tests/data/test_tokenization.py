"""Tokenization helpers shared by the trainers (posttrain.data.tokenization)."""

import json
import warnings

import pytest
import torch
from datasets import Dataset

from posttrain.data.formats import DataFormatError
from posttrain.data.tokenization import (
    build_labels,
    map_with_row_index,
    prompt_overflows,
    tokenize_lm,
    tokenize_preference,
    tokenize_prompt,
    tokenize_prompt_completion,
    tokenize_reward_pair,
    tokenize_unpaired,
    truncate_sequence,
)
from posttrain.models.tiny import build_tiny_tokenizer

EOS = 258  # <|im_end|>
TOOLS = [{"type": "function", "function": {"name": "lights", "parameters": {"type": "object", "properties": {}}}}]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


def ids_of(text):
    return list(text.encode("utf-8"))  # byte-level tokenizer: one id per byte


def masked_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


# ---------------------------------------------------------------------------------------------- tokenize_lm


def test_tokenize_lm_standard_text(tok):
    assert tokenize_lm({"text": "héllo"}, tok) == {"input_ids": ids_of("héllo") + [EOS]}
    assert tokenize_lm({"text": "done<|im_end|>"}, tok)["input_ids"] == ids_of("done") + [EOS]  # no second EOS
    assert tokenize_lm({"text": "x"}, tok, add_eos=False)["input_ids"] == ids_of("x")
    assert tokenize_lm({"text": ""}, tok)["input_ids"] == [EOS]
    assert tokenize_lm({"body": "ab", "text": 3}, tok, dataset_text_field="body")["input_ids"] == ids_of("ab") + [EOS]


def test_tokenize_lm_bad_rows_name_row_and_column(tok):
    with pytest.raises(DataFormatError, match=r"Row 5, column 'text': expected a string.*got NoneType"):
        tokenize_lm({"text": None}, tok, row_index=5)
    with pytest.raises(DataFormatError, match=r"Row 1, column 'content': .*dataset_text_field"):
        tokenize_lm({"prompt": "x"}, tok, dataset_text_field="content", row_index=1)
    with pytest.raises(DataFormatError, match=r"Row 2, column 'messages': message 0 has role 'bot'"):
        tokenize_lm({"messages": [{"role": "bot", "content": "x"}]}, tok, row_index=2)
    with pytest.raises(
        DataFormatError, match=r"^Column 'text': assistant_only_loss=True only works with conversational"
    ):
        tokenize_lm({"text": "x"}, tok, assistant_only_loss=True)


def test_tokenize_lm_conversational_multi_turn_with_system(tok):
    messages = [system("Be brief."), user("Hi"), assistant("Yo"), user("Again?"), assistant("Sure ✓")]
    out = tokenize_lm({"messages": messages}, tok, assistant_only_loss=True)
    expected = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert out["input_ids"] == expected
    # assistant content and its end-of-turn token are trained; the ChatML newline after it is not
    assert masked_text(tok, out["input_ids"], out["assistant_masks"]) == "Yo<|im_end|>Sure ✓<|im_end|>"
    assert "assistant_masks" not in tokenize_lm({"messages": messages}, tok)


def test_tokenize_lm_sharegpt_and_none_fields(tok):
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}
    chatml = {"messages": [user("Hi"), assistant("Yo")]}
    assert tokenize_lm(sharegpt, tok) == tokenize_lm(chatml, tok)
    # other columns of a ShareGPT row (per-row tools) still apply
    assert "# Tools" in tok.decode(tokenize_lm({**sharegpt, "tools": TOOLS}, tok)["input_ids"])
    with_nones = {"messages": [{**user("Hi"), "tool_calls": None}, {**assistant("Yo"), "name": None}]}
    assert tokenize_lm(with_nones, tok) == tokenize_lm(chatml, tok)


def test_tokenize_lm_tools_per_row_and_argument(tok):
    messages = [
        user("Lights on"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "lights", "arguments": {}}}],
        },
        {"role": "tool", "name": "lights", "content": "ok"},
        assistant("Done"),
    ]
    by_arg = tokenize_lm({"messages": messages}, tok, tools=TOOLS, assistant_only_loss=True)
    by_list = tokenize_lm({"messages": messages, "tools": TOOLS}, tok, assistant_only_loss=True)
    by_json = tokenize_lm({"messages": messages, "tools": json.dumps(TOOLS)}, tok, assistant_only_loss=True)
    assert by_arg == by_list == by_json
    assert "# Tools" in tok.decode(by_arg["input_ids"])
    no_tools = tokenize_lm({"messages": messages, "tools": None}, tok)
    assert "# Tools" not in tok.decode(no_tools["input_ids"])
    trained = masked_text(tok, by_arg["input_ids"], by_arg["assistant_masks"])
    assert trained == '<tool_call>{"name": "lights", "arguments": {}}</tool_call><|im_end|>Done<|im_end|>'
    with pytest.raises(DataFormatError, match=r"Row 3, column 'tools'"):
        tokenize_lm({"messages": messages, "tools": "{not json"}, tok, row_index=3)


def test_tokenize_lm_chat_template_kwargs_per_row(tok):
    template = "{{ prefix }}{% for m in messages %}{{ m.content }}{% endfor %}"
    row = {"messages": [user("a"), assistant("b")], "chat_template_kwargs": {"prefix": "R"}}
    out = tokenize_lm(row, tok, chat_template_kwargs={"chat_template": template, "prefix": "C"})
    assert out["input_ids"] == ids_of("Rab")
    row_json = {**row, "chat_template_kwargs": json.dumps({"prefix": "J"})}
    assert tokenize_lm(row_json, tok, chat_template_kwargs={"chat_template": template})["input_ids"] == ids_of("Jab")


def test_tokenize_lm_assistant_only_loss_checks():
    tok = build_tiny_tokenizer()
    tok.chat_template = tok.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    with pytest.raises(ValueError, match="generation"):
        tokenize_lm({"messages": [user("a"), assistant("b")]}, tok, assistant_only_loss=True)
    good = build_tiny_tokenizer()
    with pytest.raises(DataFormatError, match=r"Row 4, column 'messages': .*no assistant message"):
        tokenize_lm({"messages": [user("a")]}, good, assistant_only_loss=True, row_index=4)


def test_tokenize_lm_without_chat_template_is_not_a_row_error():
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template") as info:
        tokenize_lm({"messages": [user("a")]}, tok, row_index=0)
    assert not isinstance(info.value, DataFormatError)


def test_tokenize_lm_template_error_names_row(tok):
    with pytest.raises(DataFormatError, match=r"Row 0, column 'messages': the chat template failed"):
        tokenize_lm(
            {"messages": [user("a")]},
            tok,
            chat_template_kwargs={"chat_template": "{{ raise_exception('x') }}"},
            row_index=0,
        )


# ------------------------------------------------------------------------------- tokenize_prompt_completion


def test_tokenize_prompt_completion_standard(tok):
    out = tokenize_prompt_completion({"prompt": "The sky is", "completion": " blue.", "id": 7}, tok)
    assert out["input_ids"] == ids_of("The sky is blue.") + [EOS]
    assert out["completion_mask"] == [0] * 10 + [1] * 7
    assert masked_text(tok, out["input_ids"], out["completion_mask"]) == " blue.<|im_end|>"
    empty = tokenize_prompt_completion({"prompt": "Q", "completion": ""}, tok)
    assert empty == {"input_ids": ids_of("Q") + [EOS], "completion_mask": [0, 1]}
    no_eos = tokenize_prompt_completion({"prompt": "Q", "completion": "A"}, tok, add_eos=False)
    assert no_eos == {"input_ids": ids_of("QA"), "completion_mask": [0, 1]}


def test_tokenize_prompt_completion_conversational(tok):
    row = {"prompt": [system("S"), user("Hi")], "completion": [assistant("Yo")]}
    out = tokenize_prompt_completion(row, tok)
    full = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)["input_ids"]
    assert out["input_ids"] == full
    assert masked_text(tok, out["input_ids"], out["completion_mask"]) == "Yo<|im_end|>\n"
    with_masks = tokenize_prompt_completion(row, tok, assistant_only_loss=True)
    assert masked_text(tok, with_masks["input_ids"], with_masks["assistant_masks"]) == "Yo<|im_end|>"
    # multi-turn prompt ending with a tool message, and a prompt continuing an assistant message
    tool_row = {
        "prompt": [user("Q"), assistant("calling"), {"role": "tool", "content": "42"}],
        "completion": [assistant("42.")],
    }
    assert masked_text(tok, *tokenize_prompt_completion(tool_row, tok).values()) == "42.<|im_end|>\n"
    cont = {"prompt": [user("Q"), assistant("The answer")], "completion": [assistant(" is 4")]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the continued prompt is a prefix of the full render
        out = tokenize_prompt_completion(cont, tok)
    assert tok.decode(out["input_ids"]).startswith("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nThe answer")


def test_tokenize_prompt_completion_bad_rows(tok):
    with pytest.raises(DataFormatError, match=r"Row 3, column 'completion': the list of messages is empty"):
        tokenize_prompt_completion({"prompt": [user("Q")], "completion": []}, tok, row_index=3)
    with pytest.raises(
        DataFormatError, match=r"Row 1, column 'completion': the value is a list of messages but 'prompt'"
    ):
        tokenize_prompt_completion({"prompt": "Q", "completion": [assistant("A")]}, tok, row_index=1)
    with pytest.raises(DataFormatError, match=r"Row 0, column 'prompt': the prompt's last message has role 'system'"):
        tokenize_prompt_completion({"prompt": [system("S")], "completion": [assistant("A")]}, tok, row_index=0)
    with pytest.raises(DataFormatError, match=r"^Column 'completion': the column is missing"):
        tokenize_prompt_completion({"prompt": "Q"}, tok)
    with pytest.raises(DataFormatError, match=r"^Column 'completion': expected a string"):
        tokenize_prompt_completion({"prompt": "Q", "completion": None}, tok)


def test_prefix_mismatch_warns_once(tok):
    # the generation prompt opens a <think> block that a finished turn does not have
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant><think>{% endif %}"
    )
    kwargs = {"chat_template": template}
    row = {"prompt": [user("Q")], "completion": [assistant("A")]}
    with pytest.warns(UserWarning, match="Mismatch between the tokenized prompt"):
        out = tokenize_prompt_completion(row, tok, chat_template_kwargs=kwargs)
    # completion = suffix after len(prompt_ids), as TRL: the prompt ids ("<user>Q<assistant>" + <think>) are as long
    # as the whole render here, so nothing is left for the completion
    assert out["input_ids"] == ids_of("<user>Q<assistant>A")
    prompt_ids = ids_of("<user>Q<assistant>") + [tok.convert_tokens_to_ids("<think>")]
    assert out["completion_mask"] == [0] * len(prompt_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenize_prompt_completion(row, tok, chat_template_kwargs=kwargs)  # second time: silent


# --------------------------------------------------------------------------- preference / unpaired / reward


def test_tokenize_preference_explicit_standard(tok):
    out = tokenize_preference({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, tok)
    assert out == {
        "prompt_ids": ids_of("The sky is"),
        "chosen_ids": ids_of(" blue.") + [EOS],
        "rejected_ids": ids_of(" green.") + [EOS],
    }


def test_tokenize_preference_implicit_prompt(tok):
    out = tokenize_preference({"chosen": "The sky is blue.", "rejected": "The sky is green."}, tok)
    assert out["prompt_ids"] == ids_of("The sky is") and out["chosen_ids"] == ids_of(" blue.") + [EOS]
    conv = {"chosen": [user("Color?"), assistant("Blue")], "rejected": [user("Color?"), assistant("Green")]}
    out = tokenize_preference(conv, tok)
    assert tok.decode(out["prompt_ids"]) == "<|im_start|>user\nColor?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(out["chosen_ids"]) == "Blue<|im_end|>\n"
    assert tok.decode(out["rejected_ids"]) == "Green<|im_end|>\n"


def test_tokenize_preference_conversational_with_tools_and_extra_columns(tok):
    row = {
        "prompt": [user("Lights?")],
        "chosen": [assistant("On")],
        "rejected": [assistant("Off")],
        "tools": TOOLS,
        "score": 0.3,
    }
    out = tokenize_preference(row, tok)
    assert "# Tools" in tok.decode(out["prompt_ids"])
    assert tok.decode(out["chosen_ids"]) == "On<|im_end|>\n"
    with pytest.raises(DataFormatError, match=r"Row 9, column 'rejected'"):
        tokenize_preference({"prompt": [user("Q")], "chosen": [assistant("A")], "rejected": "B"}, tok, row_index=9)
    with pytest.raises(DataFormatError, match=r"^Column 'rejected': the column is missing"):
        tokenize_preference({"prompt": "Q", "chosen": "A"}, tok)


def test_tokenize_unpaired(tok):
    out = tokenize_unpaired({"prompt": "Q", "completion": "A", "label": 1}, tok)
    assert out == {"prompt_ids": ids_of("Q"), "completion_ids": ids_of("A") + [EOS], "label": True}
    conv = tokenize_unpaired({"prompt": [user("Q")], "completion": [assistant("A")], "label": False}, tok)
    assert conv["label"] is False and tok.decode(conv["completion_ids"]) == "A<|im_end|>\n"
    with pytest.raises(DataFormatError, match=r"Row 2, column 'label': expected a bool"):
        tokenize_unpaired({"prompt": "Q", "completion": "A", "label": None}, tok, row_index=2)


def test_tokenize_reward_pair(tok):
    implicit = {"chosen": [user("Q"), assistant("A")], "rejected": [user("Q"), assistant("B")]}
    explicit = {"prompt": [user("Q")], "chosen": [assistant("A")], "rejected": [assistant("B")]}
    assert tokenize_reward_pair(implicit, tok) == tokenize_reward_pair(explicit, tok)
    full = tok.apply_chat_template(implicit["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert tokenize_reward_pair(implicit, tok)["chosen_ids"] == full
    std = tokenize_reward_pair({"prompt": "The sky is", "chosen": " blue.", "rejected": " red."}, tok)
    assert std["chosen_ids"] == ids_of("The sky is blue.") + [EOS]
    assert tokenize_reward_pair({"chosen": "a", "rejected": "b"}, tok)["rejected_ids"] == ids_of("b") + [EOS]


def test_tokenize_prompt(tok):
    out = tokenize_prompt({"prompt": [system("S"), user("Solve ∑")]}, tok)
    assert (
        out["prompt_text"]
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nSolve ∑<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out["prompt_ids"] == tok(out["prompt_text"], add_special_tokens=False)["input_ids"]
    assert tokenize_prompt({"prompt": "The sky is"}, tok) == {
        "prompt_ids": ids_of("The sky is"),
        "prompt_text": "The sky is",
    }
    with pytest.raises(DataFormatError, match=r"Row 6, column 'prompt': the list of messages is empty"):
        tokenize_prompt({"prompt": []}, tok, row_index=6)
    with pytest.raises(DataFormatError, match=r"^Column 'prompt': the column is missing"):
        tokenize_prompt({"text": "x"}, tok)


# ------------------------------------------------------------------------------------- sequences and labels


def test_truncate_sequence_and_prompt_overflows():
    ids = [1, 2, 3, 4, 5]
    assert truncate_sequence(ids, 3) == [1, 2, 3]
    assert truncate_sequence(ids, 3, "keep_end") == [3, 4, 5]
    assert truncate_sequence(ids, 0, "keep_end") == [] and truncate_sequence(ids, 0) == []
    assert truncate_sequence(ids, None) == ids and truncate_sequence(ids, 9, "keep_end") == ids
    with pytest.raises(ValueError, match="truncation_mode"):
        truncate_sequence(ids, 2, "middle")
    with pytest.raises(ValueError, match="max_length"):
        truncate_sequence(ids, -1)
    assert prompt_overflows(10, 10) and prompt_overflows(11, 10)
    assert not prompt_overflows(9, 10) and not prompt_overflows(10_000, None)


def test_build_labels_lists_and_tensors():
    ids = [5, 6, 7, 8]
    assert build_labels(ids) == ids
    assert build_labels(ids, completion_mask=[0, 0, 1, 1]) == [-100, -100, 7, 8]
    assert build_labels(ids, completion_mask=[0, 1, 1, 1], assistant_masks=[1, 1, 0, 1]) == [-100, 6, -100, 8]
    batch = torch.tensor([[5, 6, 7], [8, 9, 10]])
    labels = build_labels(batch, assistant_masks=torch.tensor([[0, 1, 1], [1, 0, 1]]))
    assert labels.tolist() == [[-100, 6, 7], [8, -100, 10]]
    assert batch.tolist() == [[5, 6, 7], [8, 9, 10]]  # input not modified
    with pytest.raises(ValueError, match="completion_mask has 2 entries"):
        build_labels(ids, completion_mask=[1, 1])


def test_map_with_row_index_names_the_bad_row(tok):
    ds = Dataset.from_dict({"prompt": ["a", "b", "c"], "completion": ["x", None, "z"]})
    with pytest.raises(DataFormatError, match=r"Row 1, column 'completion'"):
        map_with_row_index(ds, tokenize_prompt_completion, fn_kwargs={"tokenizer": tok})
    good = Dataset.from_dict({"prompt": ["a", "b"], "completion": ["x", "y"]})
    out = map_with_row_index(
        good, tokenize_prompt_completion, fn_kwargs={"tokenizer": tok}, remove_columns=["prompt", "completion"]
    )
    assert out[1] == {"input_ids": ids_of("by") + [EOS], "completion_mask": [0, 1, 1]}


def test_tokenize_from_arrow_rows_with_tools_json_type(tok):
    # rows as datasets stores them: tool-call fields unified across rows (None where absent)
    rows = [
        {
            "messages": [
                user("Lights on"),
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "lights", "arguments": {"on": True}}}],
                },
                {"role": "tool", "name": "lights", "content": "ok"},
                assistant("Done"),
            ]
        },
        {"messages": [user("Hi"), assistant("Yo")]},
    ]
    ds = Dataset.from_list(rows)
    out = map_with_row_index(ds, tokenize_lm, fn_kwargs={"tokenizer": tok, "assistant_only_loss": True})
    direct = [tokenize_lm(r, tok, assistant_only_loss=True) for r in rows]
    assert [out[i]["input_ids"] for i in range(2)] == [d["input_ids"] for d in direct]
    assert [out[i]["assistant_masks"] for i in range(2)] == [d["assistant_masks"] for d in direct]
