"""Parsing tool calls out of generated text: the ``TOOL_CALL_PARSERS`` registry and its built-in formats.

A parser turns the decoded text of one assistant turn into ``(content, calls)``: the text outside the tool-call
markup and a list of :class:`ToolCall`. A call whose markup is there but whose JSON is broken, whose ``name`` is
missing or whose arguments are not a JSON object is still returned, with ``error`` set, so callers can see it.
:func:`assistant_message` (what the tool loop uses) then treats the whole turn as plain text with no calls, as
TRL's ``parse_response`` does when a response does not parse: such a turn is final, it is not a failed call (an
untrained model that emits stray ``<tool_call>`` tokens would otherwise report phantom tool failures).
String arguments are cast with the called tool's JSON schema (``"7"`` → ``7`` for an ``integer`` parameter, as
transformers' ``parse_response(tools=...)`` does): :func:`coerce_arguments`.

Built-in formats:

- ``"hermes"`` — Hermes / Qwen2.5 / Qwen3 / posttrain's tiny ChatML template:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (any whitespace inside the tags; several calls in
  one turn; ``"parameters"`` accepted for ``"arguments"``; a ``<tool_call>`` left open at the end of the turn is a
  malformed call).
- ``"llama3_json"`` — Llama 3.1/3.2 JSON tool calling: the whole turn is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls separated by ``;``).

Add a format with ``@TOOL_CALL_PARSERS.register("name")`` on a function ``(text) -> (content, list[ToolCall])``;
:func:`detect_tool_call_parser` then finds it for any chat template it can read back.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.registry import Registry

ToolCallParser = Callable[[str], "tuple[str, list[ToolCall]]"]

TOOL_CALL_PARSERS: Registry[ToolCallParser] = Registry("tool call parser")


@dataclass
class ToolCall:
    """One tool call found in a completion.

    Attributes:
        name: The tool's name (``""`` when the call was too malformed to name one).
        arguments: The keyword arguments (a dict), or ``None`` when they could not be parsed.
        raw: The call's text as generated (the JSON between the tags for ``"hermes"``).
        error: Why the call is malformed, or ``None`` for a well-formed call.
    """

    name: str
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None

    def to_message_dict(self) -> dict[str, Any]:
        """The call in chat-template form: ``{"type": "function", "function": {"name", "arguments"}}``.

        Malformed calls keep their raw argument text as a string, so re-rendering shows what the model wrote.
        """
        arguments: Any = self.arguments if self.arguments is not None else self.raw
        return {"type": "function", "function": {"name": self.name, "arguments": arguments}}


def call_from_json(raw: str, *, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    """Build a :class:`ToolCall` from the JSON object text of one call (``{"name": ..., "arguments": {...}}``).

    Arguments given as a JSON *string* holding an object (some models double-encode) are decoded too.
    """
    text = raw.strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        name_match = re.search(r'"name"\s*:\s*"([^"]*)"', text)
        return ToolCall(
            name_match.group(1) if name_match else "",
            None,
            raw,
            f"The tool call is not valid JSON ({err.msg} at char {err.pos}). Write "
            '{"name": <tool-name>, "arguments": {<key>: <value>, ...}}.',
        )
    if not isinstance(obj, dict):
        return ToolCall("", None, raw, f"The tool call must be a JSON object, got {type(obj).__name__}.")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", None, raw, 'The tool call has no "name" (a non-empty string).')
    arguments: Any = {}
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name, None, raw, f"The arguments of {name!r} are a string that is not a JSON object.")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(
            name, None, raw, f"The arguments of {name!r} must be a JSON object, got {type(arguments).__name__}."
        )
    return ToolCall(name, arguments, raw)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


@TOOL_CALL_PARSERS.register("hermes")
def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3, posttrain's tiny ChatML)."""
    calls = [call_from_json(m.group(1)) for m in _HERMES_BLOCK.finditer(text)]
    content = _HERMES_BLOCK.sub("", text)
    open_at = content.find(_HERMES_OPEN)
    if open_at != -1:  # an opening tag never closed: the model meant to call, but the markup is broken
        raw = content[open_at + len(_HERMES_OPEN) :]
        call = call_from_json(raw)
        call.error = "The tool call is missing its closing </tool_call> tag." + (
            f" {call.error}" if call.error else ""
        )
        call.arguments = None
        calls.append(call)
        content = content[:open_at]
    return content.strip(), calls


_PYTHON_TAG = "<|python_tag|>"


@TOOL_CALL_PARSERS.register("llama3_json")
def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.1/3.2 JSON calls: the turn is ``{"name": ..., "parameters": {...}}`` (``;``-separated for several).

    Text that does not start with ``{`` (after an optional ``<|python_tag|>``) is plain content, not a call.
    """
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return text.strip(), []
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    position = 0
    while position < len(body):
        try:
            _, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            calls.append(call_from_json(body[position:]))
            break
        calls.append(call_from_json(body[position:end]))
        position = end
        while position < len(body) and body[position] in " \t\n;":
            position += 1
    return "", calls


def parse_tool_calls(text: str, parser: str | ToolCallParser = "hermes") -> tuple[str, list[ToolCall]]:
    """Split an assistant turn's text into ``(content, calls)`` with a registered parser (or a callable)."""
    return TOOL_CALL_PARSERS.get(parser)(text)


def assistant_message(
    text: str, parser: str | ToolCallParser = "hermes", tools: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], list[ToolCall]]:
    """The assistant message of one generated turn, as TRL's ``parse_response`` gives it, and its calls.

    A turn with any malformed call (``ToolCall.error`` set) is plain text: ``({"role": "assistant", "content":
    text}, [])``, as TRL falls back to the decoded text when the response does not parse. With ``tools``
    (``{name: Tool}`` or ``{name: JSON schema}``), string arguments are cast with the called tool's schema
    (:func:`coerce_arguments`).

    Returns ``({"role": "assistant", "content": ..., ["tool_calls": [...]]}, calls)``.
    """
    content, calls = parse_tool_calls(text, parser)
    if any(call.error is not None for call in calls):
        return {"role": "assistant", "content": text}, []
    if tools:
        for call in calls:
            tool = tools.get(call.name)
            schema = getattr(tool, "schema", tool)
            if isinstance(schema, Mapping) and call.arguments:
                call.arguments = coerce_arguments(call.arguments, schema)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.to_message_dict() for call in calls]
    return message, calls


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows (``type`` as a name or list, ``anyOf``/``oneOf``, ``nullable``)."""
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types.extend(_schema_types(option))
    if schema.get("nullable") and "null" not in types:
        types.append("null")
    return types


def _cast(raw: str, types: list[str]) -> Any:
    """``raw`` read as the first of ``types`` it is a valid literal of; unchanged when none fits (or ``string``)."""
    text = raw.strip()
    for kind in types:
        try:
            if kind == "integer":
                try:
                    return int(text)
                except ValueError:  # whole numbers written as floats ("3.0") are integers too
                    number = float(text)
                    if number.is_integer():
                        return int(number)
            elif kind == "number":
                number = float(text)
                if math.isfinite(number):
                    return int(number) if number.is_integer() and "." not in text else number
            elif kind == "boolean" and text.lower() in ("true", "false", "1", "0"):
                return text.lower() in ("true", "1")
            elif kind == "null" and text in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                value = json.loads(text)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except ValueError:
            continue
    return raw


def coerce_arguments(arguments: dict[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """Cast string-valued ``arguments`` to the types the tool's JSON schema declares for them.

    ``schema`` is the tool's ``{"type": "function", "function": {"parameters": {"properties": ...}}}`` (or the
    ``function`` part). A model often writes ``{"a": "3"}`` for an ``integer`` parameter; TRL (through
    transformers' ``parse_response(tools=...)``) calls the tool with ``3``, and so does posttrain. Values of
    parameters the schema does not describe, ``string`` parameters and strings that are no valid literal of the
    declared type stay as they are. Returns a new dict.
    """
    function = schema.get("function", schema)
    properties = (function.get("parameters") or {}).get("properties") or {}
    out = dict(arguments)
    for key, value in arguments.items():
        types = _schema_types(properties.get(key))
        if isinstance(value, str) and types:
            out[key] = _cast(value, types)
    return out


_PROBE_NAME, _PROBE_KEY, _PROBE_VALUE = "probe_tool_name", "probe_arg_key", "probe_arg_value"


def detect_tool_call_parser(tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """Name of the registered parser that reads back a tool call rendered by ``tokenizer``'s chat template.

    Renders ``[user, assistant(tool_calls=[probe])]`` and tries each parser on the assistant part; the first one
    that recovers the probe's name and arguments wins.

    Raises:
        ValueError: No registered parser understands this template's tool-call format (the message says how to
            register one, or to pass ``tool_call_parser``).
    """
    user = {"role": "user", "content": "Call the probe."}
    call = {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {_PROBE_KEY: _PROBE_VALUE}}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    kwargs = dict(chat_template_kwargs or {})
    try:
        prefix = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True, **kwargs)
        full = tokenizer.apply_chat_template([user, assistant], tokenize=False, **kwargs)
    except Exception as err:
        raise ValueError(f"The chat template cannot render an assistant tool call ({err}).") from err
    turn = full[len(prefix) :] if full.startswith(prefix) else full
    eos = getattr(getattr(tokenizer, "tokenizer", tokenizer), "eos_token", None)
    if eos and eos in turn:
        turn = turn[: turn.rindex(eos)]
    for name, parser in TOOL_CALL_PARSERS.items():
        try:
            _, calls = parser(turn)
        except Exception:
            continue
        probe = calls[0] if len(calls) == 1 else None
        if probe is not None and probe.name == _PROBE_NAME and probe.arguments == {_PROBE_KEY: _PROBE_VALUE}:
            return name
    raise ValueError(
        f"No registered tool-call parser ({', '.join(TOOL_CALL_PARSERS.names())}) reads back the tool calls this "
        f"chat template renders (assistant turn: {turn[:200]!r}). Register one with "
        "@posttrain.agents.TOOL_CALL_PARSERS.register('name') and pass tool_call_parser='name'."
    )
