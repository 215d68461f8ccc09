"""Response parsing (``add_response_schema`` / ``parse_response``) for the ChatML, Qwen3 and Llama 3 families, on
hand-written token ids from the offline tiny tokenizer with each family's special tokens."""

import pytest
import torch

import posttrain.chat_template_utils as chat_template_utils
from posttrain.chat_template_utils import (
    CHAT_TEMPLATE_FAMILIES,
    RESPONSE_TEMPLATES,
    add_response_schema,
    parse_response,
)
from posttrain.models.tiny import build_tiny_tokenizer

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
LLAMA_SPECIALS += ["<|python_tag|>", "<|end_of_text|>"]


def family_tokenizer(name: str, template: str = "original"):
    """Tiny byte-level tokenizer carrying the family's chat template and special tokens (one token each)."""
    tok = build_tiny_tokenizer()  # ChatML specials and <think>/<tool_call> tags; template = posttrain's ChatML
    if name == "chatml":
        return tok
    if name.startswith("llama"):
        tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    family = CHAT_TEMPLATE_FAMILIES.get(name)
    tok.chat_template = family.original_templates()[0] if template == "original" else family.training_template()
    return tok


def ids_of(tok, *pieces: str) -> list[int]:
    """Token ids written by hand: special/tag tokens by id, text as bytes."""
    vocab = tok.get_vocab()
    out: list[int] = []
    for piece in pieces:
        if piece in vocab and piece.startswith("<"):
            out.append(vocab[piece])
        else:
            out.extend(tok.encode(piece, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def qwen3():
    return add_response_schema(family_tokenizer("qwen3"))


@pytest.fixture(scope="module")
def llama():
    return add_response_schema(family_tokenizer("llama3_1"))


@pytest.fixture(scope="module")
def chatml():
    return add_response_schema(family_tokenizer("chatml"))


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_exported_with_trl_names():
    assert {"add_response_schema", "parse_response"} <= set(chat_template_utils.__all__)


@pytest.mark.parametrize(
    ("name", "template"),
    [("chatml", "training")] + [(n, t) for n in ("qwen3", "llama3_1", "llama3_2") for t in ("original", "training")],
)
def test_add_response_schema_sets_the_family_template(name, template):
    tok = family_tokenizer(name, template)
    assert add_response_schema(tok) is tok
    assert tok.response_template == RESPONSE_TEMPLATES[name]
    assert tok.response_template is not RESPONSE_TEMPLATES[name]  # a copy: editing it leaves the registry alone


def test_add_response_schema_keeps_an_existing_template_and_uses_inner_tokenizers():
    tok = family_tokenizer("qwen3")
    own = {"start_anchor": "x", "fields": {"content": {"content": "text"}}}
    tok.response_template = own
    assert add_response_schema(tok).response_template is own

    class Processor:  # VLM processors keep the text tokenizer on .tokenizer
        tokenizer = family_tokenizer("llama3_2")

    processor = Processor()
    assert add_response_schema(processor) is processor
    assert processor.tokenizer.response_template == RESPONSE_TEMPLATES["llama3_2"]


def test_add_response_schema_unknown_template_names_the_fix():
    tok = build_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"no known family.*chatml, llama3_1, llama3_2, qwen3.*response_template"):
        add_response_schema(tok)


def test_parse_response_without_a_schema_says_to_add_one():
    with pytest.raises(ValueError, match=r"add_response_schema\(tokenizer\)"):
        parse_response(family_tokenizer("qwen3"), [1, 2, 3])


def test_qwen3_reasoning_and_content(qwen3):
    ids = ids_of(qwen3, "<think>", "\nLet me add: 2+2.\n", "</think>", "\n\nIt is 4 — vier ☀.", "<|im_end|>")
    assert parse_response(qwen3, ids) == {
        "role": "assistant",
        "reasoning_content": "Let me add: 2+2.",
        "content": "It is 4 — vier ☀.",
    }


def test_qwen3_tool_calls_missing_arguments_and_empty_content(qwen3):
    ids = ids_of(
        qwen3,
        "<think>",
        "\nTwo calls.\n",
        "</think>",
        "\n\n",
        "<tool_call>",
        '\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n',
        "</tool_call>",
        "\n",
        "<tool_call>",
        '\n{"name": "now"}\n',
        "</tool_call>",
        "<|im_end|>",
    )
    assert parse_response(qwen3, ids) == {
        "role": "assistant",
        "reasoning_content": "Two calls.",
        "content": "",
        "tool_calls": [call("add", {"a": 2, "b": 3}), call("now", {})],
    }


def test_qwen3_prefix_with_thinking_disabled(qwen3):
    prompt = qwen3.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = ids_of(qwen3, "Hello!", "<|im_end|>")
    expected = {"role": "assistant", "content": "Hello!"}
    assert parse_response(qwen3, ids, prefix=prompt) == expected
    assert parse_response(qwen3, ids, prefix=qwen3.encode(prompt, add_special_tokens=False)) == expected


def test_trailing_end_of_turn_eos_and_padding_are_stripped(qwen3):
    ids = ids_of(qwen3, "Done.", "<|im_end|>", "<|endoftext|>", "<|pad|>", "<|pad|>")
    assert parse_response(qwen3, ids) == {"role": "assistant", "content": "Done."}
    assert parse_response(qwen3, ids_of(qwen3, "<|im_end|>")) == {"role": "assistant", "content": ""}
    assert parse_response(qwen3, []) == {"role": "assistant", "content": ""}


def test_tensor_ids(qwen3):
    ids = ids_of(qwen3, "Done.", "<|im_end|>")
    assert parse_response(qwen3, torch.tensor(ids)) == {"role": "assistant", "content": "Done."}
    assert parse_response(qwen3, torch.tensor([ids])) == {"role": "assistant", "content": "Done."}


@pytest.mark.parametrize(
    "body",
    [
        '\n{"name": "add", "arguments": {"a": 2}\n',  # broken JSON
        '\n{"arguments": {"a": 2}}\n',  # no function name
        '\n{"name": "add", "arguments": [1, 2]}\n',  # arguments not an object
    ],
)
def test_unparseable_tool_call_falls_back_to_the_decoded_text(qwen3, body):
    ids = ids_of(qwen3, "Sure.\n", "<tool_call>", body, "</tool_call>", "<|im_end|>")
    assert parse_response(qwen3, ids) == {
        "role": "assistant",
        "content": f"Sure.\n<tool_call>{body}</tool_call>",
    }


def test_chatml_keeps_think_in_content_and_parses_string_arguments(chatml):
    ids = ids_of(chatml, "<think>", "2+2", "</think>", "It is 4.", "<|im_end|>")
    assert parse_response(chatml, ids) == {"role": "assistant", "content": "<think>2+2</think>It is 4."}
    ids = ids_of(chatml, "<tool_call>", '{"name": "f", "arguments": "{\\"x\\": 2}"}', "</tool_call>", "<|im_end|>")
    assert parse_response(chatml, ids) == {"role": "assistant", "content": "", "tool_calls": [call("f", {"x": 2})]}


def test_llama_content_and_json_tool_calls(llama):
    assert parse_response(llama, ids_of(llama, "Grüß dich!", "<|eot_id|>")) == {
        "role": "assistant",
        "content": "Grüß dich!",
    }
    weather = call("get_weather", {"city": "Paris"})
    json_call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for ids in (
        ids_of(llama, json_call, "<|eot_id|>"),
        ids_of(llama, "<|python_tag|>", json_call, "<|eom_id|>"),
        ids_of(llama, '{"name": "get_weather", "arguments": {"city": "Paris"}}', "<|eot_id|>"),
    ):
        assert parse_response(llama, ids) == {"role": "assistant", "content": "", "tool_calls": [weather]}
    # JSON inside a sentence is content, not a call
    ids = ids_of(llama, 'Write {"name": "x"} to call x.', "<|eot_id|>")
    assert parse_response(llama, ids) == {"role": "assistant", "content": 'Write {"name": "x"} to call x.'}


@pytest.mark.parametrize("name", ["chatml", "qwen3", "llama3_1", "llama3_2"])
def test_round_trip_through_the_training_template(name):
    # what the training template renders for an assistant turn parses back into the same message
    tok = add_response_schema(family_tokenizer(name, "training"))
    user = [{"role": "user", "content": "Add 2 and 3, s'il te plaît."}]
    replies = [
        {"role": "assistant", "content": "C'est 5 ☀."},
        {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 2, "b": 3})]},
    ]
    if name == "qwen3":
        replies.append({"role": "assistant", "reasoning_content": "2+3=5", "content": "5."})
    kwargs = {"date_string": "26 Jul 2024"} if name.startswith("llama") else {}
    for reply in replies:
        prompt = tok.apply_chat_template(user, tokenize=True, add_generation_prompt=True, return_dict=True, **kwargs)
        full = tok.apply_chat_template([*user, reply], tokenize=True, return_dict=True, **kwargs)
        prompt_ids, full_ids = prompt["input_ids"], full["input_ids"]
        assert full_ids[: len(prompt_ids)] == prompt_ids
        assert parse_response(tok, full_ids[len(prompt_ids) :], prefix=prompt_ids) == reply
