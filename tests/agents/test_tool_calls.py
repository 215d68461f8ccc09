"""Parsing tool calls: the Hermes/Qwen and Llama-3 JSON formats, malformed calls, parser detection, the registry."""

from __future__ import annotations

import pytest

from posttrain.agents.tool_calls import (
    TOOL_CALL_PARSERS,
    ToolCall,
    assistant_message,
    detect_tool_call_parser,
    parse_tool_calls,
)
from posttrain.models.tiny import build_tiny_tokenizer


def test_hermes_single_and_multiple_calls_with_surrounding_text():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "mul", "parameters": {"a": 3, "b": 4}}</tool_call> done'
    )
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me compute.\n\n done"
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("mul", {"a": 3, "b": 4}, None),
    ]


def test_hermes_no_call_is_plain_content():
    assert parse_tool_calls("  The answer is 4.  ") == ("The answer is 4.", [])


@pytest.mark.parametrize(
    "body, name, message",
    [
        ('{"name": "add", "arguments": {"a": 1,}}', "add", "not valid JSON"),
        ('{"arguments": {"a": 1}}', "", 'no "name"'),
        ('{"name": "add", "arguments": [1, 2]}', "add", "must be a JSON object, got list"),
        ('["add"]', "", "must be a JSON object, got list"),
        ('{"name": "add", "arguments": "not json"}', "add", "string that is not a JSON object"),
    ],
)
def test_hermes_malformed_calls_are_returned_with_an_error(body, name, message):
    content, calls = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert content == ""
    assert len(calls) == 1 and calls[0].arguments is None
    assert calls[0].name == name
    assert message in calls[0].error
    assert calls[0].raw == body


def test_hermes_string_encoded_arguments_and_missing_arguments():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls[0].arguments == {"x": 1} and calls[0].error is None
    _, calls = parse_tool_calls('<tool_call>{"name": "ping"}</tool_call>')
    assert calls[0].arguments == {} and calls[0].error is None


def test_hermes_unclosed_tag_is_a_malformed_call():
    content, calls = parse_tool_calls('Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}')
    assert content == "Sure."
    assert calls[0].name == "add" and calls[0].arguments is None
    assert "missing its closing </tool_call>" in calls[0].error


def test_llama3_json_format():
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "neg", "parameters": {"x": 2}}', "llama3_json"
    )
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1}), ("neg", {"x": 2})]
    assert parse_tool_calls("Just text.", "llama3_json") == ("Just text.", [])
    _, calls = parse_tool_calls('{"name": "add", "parameters": {"a": ', "llama3_json")
    assert calls[0].error is not None


def test_assistant_message_matches_chat_template_form():
    message, calls = assistant_message('Hi<tool_call>{"name": "f", "arguments": {"q": "x"}}</tool_call>')
    assert message == {
        "role": "assistant",
        "content": "Hi",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"q": "x"}}}],
    }
    assert calls == [ToolCall("f", {"q": "x"}, '{"name": "f", "arguments": {"q": "x"}}')]
    # A malformed call keeps its raw text as string arguments (for callers of the parser), so re-rendering shows
    # what the model wrote; the assistant message of such a turn is plain text (see the test below).
    assert ToolCall("f", None, '{"name": "f", "arguments": {', "bad").to_message_dict()["function"]["arguments"] == (
        '{"name": "f", "arguments": {'
    )
    assert assistant_message("plain")[0] == {"role": "assistant", "content": "plain"}


def test_detect_parser_for_tiny_chatml_and_llama_like_templates():
    tok = build_tiny_tokenizer()
    assert detect_tool_call_parser(tok) == "hermes"
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}<|python_tag|>{{ {'name': c.function.name, "
        "'parameters': c.function.arguments} | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert detect_tool_call_parser(tok) == "llama3_json"


def test_unknown_format_raises_and_registry_extends():
    tok = build_tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="No registered tool-call parser"):
        detect_tool_call_parser(tok)

    import json

    def parse_call_lines(text):
        calls = []
        for line in text.splitlines():
            if line.startswith("CALL "):
                name, _, args = line[5:].partition(" ")
                calls.append(ToolCall(name, json.loads(args), line))
        return "", calls

    TOOL_CALL_PARSERS.add("call_lines", parse_call_lines)
    try:
        assert detect_tool_call_parser(tok) == "call_lines"
        assert parse_tool_calls('CALL f {"a": 1}', "call_lines")[1][0].arguments == {"a": 1}
    finally:
        TOOL_CALL_PARSERS._items.pop("call_lines")
    with pytest.raises(ValueError, match="Unknown tool call parser 'nope'"):
        parse_tool_calls("x", "nope")


def test_coerce_arguments_follows_the_schema_types():
    from posttrain.agents.tool_calls import coerce_arguments

    schema = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "i": {"type": "integer"},
                    "x": {"type": "number"},
                    "flag": {"type": "boolean"},
                    "s": {"type": "string"},
                    "maybe": {"type": "integer", "nullable": True},
                    "items": {"type": "array"},
                    "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                },
            },
        },
    }
    raw = {"i": "7", "x": "2.5", "flag": "true", "s": "7", "maybe": "null", "items": "[1, 2]", "either": "x",
           "other": "9"}  # fmt: skip
    assert coerce_arguments(raw, schema) == {
        "i": 7, "x": 2.5, "flag": True, "s": "7", "maybe": None, "items": [1, 2], "either": "x", "other": "9",
    }  # fmt: skip
    assert coerce_arguments({"i": "3.0", "x": "4"}, schema) == {"i": 3, "x": 4}
    assert coerce_arguments({"i": "3.5", "x": "nan", "flag": "maybe"}, schema) == {"i": "3.5", "x": "nan", "flag": "maybe"}
    assert coerce_arguments({"i": 5}, schema) == {"i": 5}  # non-strings are left alone


def test_assistant_message_treats_malformed_markup_as_plain_text():
    from posttrain.agents.tool_calls import assistant_message

    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{bad}</tool_call>'
    assert assistant_message(text) == ({"role": "assistant", "content": text}, [])
    message, calls = assistant_message('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert [c.name for c in calls] == ["f"] and message["tool_calls"][0]["function"]["arguments"] == {"a": 1}
