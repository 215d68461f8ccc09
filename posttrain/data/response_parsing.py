"""Response parsing: generated token ids → an assistant message dict (TRL's ``add_response_schema`` and
``parse_response`` in ``trl.chat_template_utils``).

Built on transformers' declarative response parser (``tokenizer.response_template`` and
``tokenizer.parse_response``): ``add_response_schema`` detects the chat-template family and sets the family's
``response_template`` on the tokenizer (saved with it by ``save_pretrained``); ``parse_response`` decodes the
generated ids and returns ``{"role": "assistant", "content": ...}`` plus ``reasoning_content`` (Qwen3 ``<think>``)
and ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``) when the model wrote them.

Families with a response template: ``"chatml"`` (Qwen2/Qwen2.5: ``<tool_call>`` JSON; ``<think>`` stays in
``content``, as format rewards expect), ``"qwen3"`` (``<think>`` → ``reasoning_content``, ``<tool_call>`` JSON),
``"llama3_1"`` and ``"llama3_2"`` (a bare JSON object ``{"name": ..., "parameters": ...}``, optionally after
``<|python_tag|>``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from posttrain.data.chat_templates import CHAT_TEMPLATE_FAMILIES, detect_chat_template_family

_QWEN_END = r"\s*(?:<\|im_end\|>|<\|endoftext\|>)"
_LLAMA_END = r"\s*(?:<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>)"
# Leading \s* keeps separator newlines out of the implicit content region (an empty region would overwrite it).
_TOOL_CALL_TAGS = {
    "open_pattern": r"\s*<tool_call>",
    "close": "</tool_call>",
    "repeats": True,
    "content": "json",
    "transform": {"type": "function", "function": "{content}"},
}

# transformers' ``response_template`` specs (version 1), one per chat-template family.
RESPONSE_TEMPLATES: dict[str, dict[str, Any]] = {
    "chatml": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "tool_calls": _TOOL_CALL_TAGS,
            "content": {"close_pattern": _QWEN_END, "content": "text"},
        },
    },
    "qwen3": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
            "tool_calls": _TOOL_CALL_TAGS,
            "content": {"close_pattern": _QWEN_END, "content": "text"},
        },
    },
}
# Llama 3.1/3.2 write a tool call as the whole message: one JSON object (key "parameters"), maybe after
# <|python_tag|>. The open anchor is zero-width at the start of the reply so the JSON body keeps its braces.
RESPONSE_TEMPLATES["llama3_1"] = RESPONSE_TEMPLATES["llama3_2"] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"^\s*(?:<\|python_tag\|>\s*)?(?=\{\s*\"name\"\s*:)",
            "close_pattern": _LLAMA_END,
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": _LLAMA_END, "content": "text"},
    },
}

# End-of-turn / end-of-text tokens stripped from the end of a completion before parsing.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def _inner_tokenizer(processing_class: Any) -> Any:
    """The text tokenizer of a processor (VLMs keep the response template there), else the tokenizer itself."""
    inner = getattr(processing_class, "tokenizer", None)
    return inner if inner is not None and hasattr(inner, "decode") else processing_class


def _has_response_parser() -> bool:
    try:
        from transformers.utils.chat_parsing import response_templates  # noqa: F401
    except ImportError:
        return False
    return True


def add_response_schema(processing_class: Any) -> Any:
    """Set ``response_template`` on the tokenizer for its chat-template family, so ``parse_response`` can parse
    generations into messages with ``reasoning_content`` and ``tool_calls``.

    A tokenizer that already has a ``response_template`` (the checkpoint ships one, or you set it) is left alone.
    Processors get it on their inner tokenizer. Returns ``processing_class``.

    Raises:
        ValueError: The chat template is not of a family with a response template; the message lists the known
            families and says how to set ``tokenizer.response_template`` yourself.
        ImportError: transformers is too old for declarative response templates (needs ``transformers>=5.13``).
    """
    tokenizer = _inner_tokenizer(processing_class)
    if getattr(tokenizer, "response_template", None) is not None:
        return processing_class
    family = detect_chat_template_family(tokenizer)
    if family not in RESPONSE_TEMPLATES:
        known = ", ".join(name for name in CHAT_TEMPLATE_FAMILIES.names() if name in RESPONSE_TEMPLATES)
        raise ValueError(
            f"No response parser is known for this chat template (it renders like "
            f"{'the ' + repr(family) + ' family' if family else 'no known family'}; families with a parser: "
            f"{known}). Set `tokenizer.response_template` to a transformers response-template dict for your model "
            "(see posttrain.data.response_parsing.RESPONSE_TEMPLATES for examples), or use a tokenizer whose chat "
            "template is one of the known families."
        )
    if not _has_response_parser():
        raise ImportError(
            "add_response_schema needs transformers' declarative response parser (transformers>=5.13); upgrade "
            "transformers."
        )
    tokenizer.response_template = copy.deepcopy(RESPONSE_TEMPLATES[family])
    return processing_class


def _flat_ids(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = list(ids)
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise ValueError(f"parse_response takes one sequence of token ids, got a batch of {len(ids)}.")
        ids = ids[0]
    return [int(i) for i in ids]


def _stop_ids(tokenizer: Any) -> set[int]:
    """EOS, padding and the end-of-turn tokens the tokenizer knows."""
    stop: set[int] = set()
    for attr in ("eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            stop.add(value)
        elif isinstance(value, (list, tuple)):
            stop.update(v for v in value if isinstance(v, int))
    vocab = tokenizer.get_vocab()
    stop.update(vocab[t] for t in _STOP_TOKENS if t in vocab)
    return stop


def _strip_stop_ids(tokenizer: Any, ids: list[int]) -> list[int]:
    stop = _stop_ids(tokenizer)
    end = len(ids)
    while end and ids[end - 1] in stop:
        end -= 1
    return ids[:end]


def _stop_strings(tokenizer: Any) -> list[str]:
    strings = list(_STOP_TOKENS)
    for attr in ("eos_token", "pad_token"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, str) and value:
            strings.append(value)
    return strings


def _normalize_tool_call(call: Any, index: int) -> dict[str, Any]:
    """``{"type": "function", "function": {"name": str, "arguments": dict}}``; raises ``ValueError`` if invalid."""
    if not isinstance(call, Mapping):
        raise ValueError(f"tool call {index} is a {type(call).__name__}, not an object")
    function = call.get("function", call)
    if not isinstance(function, Mapping):
        raise ValueError(f"tool call {index} has a non-object 'function'")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call {index} has no function name")
    arguments = function.get("arguments", function.get("parameters"))  # Llama 3 writes "parameters"
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, Mapping):
        raise ValueError(f"tool call {index} has arguments of type {type(arguments).__name__}, not an object")
    return {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}


def _normalize(message: Mapping[str, Any], tokenizer: Any) -> dict[str, Any]:
    out = dict(message)
    out["role"] = "assistant"
    content = out.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"parsed content is a {type(content).__name__}, not text")
    stops = _stop_strings(tokenizer)
    stripped = True
    while stripped:
        stripped = False
        for stop in stops:
            if content.endswith(stop):
                content = content[: -len(stop)].rstrip()
                stripped = True
    out["content"] = content
    if "reasoning_content" in out and not out["reasoning_content"]:
        del out["reasoning_content"]
    calls = out.pop("tool_calls", None) or []
    if calls:
        out["tool_calls"] = [_normalize_tool_call(c, i) for i, c in enumerate(calls)]
    return out


def parse_response(tokenizer: Any, ids: Any, prefix: Any = None, tools: list | None = None) -> dict[str, Any]:
    """Parse generated token ids into an assistant message.

    Trailing EOS, padding and end-of-turn tokens are dropped, the rest is decoded (special tokens kept, so the
    parser sees tags such as ``<|python_tag|>``) and parsed with the tokenizer's ``response_template``. ``content``
    is always a string (``""`` when the model only called tools); ``tool_calls`` entries have dict ``arguments``
    (``{}`` when missing); an empty ``reasoning_content`` is dropped. When parsing fails (bad tool-call JSON, no
    function name...) the result is ``{"role": "assistant", "content": <decoded text>}``.

    Args:
        tokenizer: Tokenizer (or processor) with a ``response_template`` (see ``add_response_schema``).
        ids: Generated token ids (completion only), a list or a 1-D tensor.
        prefix: The prompt before generation (text or ids), so that what the chat template pre-writes (e.g. an
            empty ``<think></think>`` block) is taken into account. ``None`` parses the completion alone.
        tools: The tools the model was given (schemas or functions, as ``apply_chat_template`` takes them):
            tool-call arguments are typed by the called tool's JSON schema (``"7"`` → ``7`` for an integer
            parameter, ``"7"`` stays a string for a string one). ``None``: arguments as the parser reads them.

    Raises:
        ValueError: The tokenizer has no ``response_template``; call ``add_response_schema(tokenizer)`` first.
    """
    tok = _inner_tokenizer(tokenizer)
    if getattr(tok, "response_template", None) is None:
        raise ValueError(
            "The tokenizer has no `response_template`, so generations cannot be parsed into messages. Call "
            "`add_response_schema(tokenizer)` first (known families: "
            f"{', '.join(sorted(set(RESPONSE_TEMPLATES)))}), or set `tokenizer.response_template`."
        )
    ids = _strip_stop_ids(tok, _flat_ids(ids))
    try:
        text = tok.decode(ids, skip_special_tokens=False).rstrip()
        if prefix is None:
            prefix_text = ""
        elif isinstance(prefix, str):
            prefix_text = prefix
        else:
            prefix_text = tok.decode(_flat_ids(prefix), skip_special_tokens=False)
        kwargs = {"tools": tools} if tools else {}
        return _normalize(tok.parse_response(text, prefix=prefix_text, **kwargs), tok)
    except Exception:  # any parse failure falls back to the raw text, as TRL does
        return {"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}
