"""``POST /v1/chat/completions`` for ``posttrain serve``: OpenAI's chat API, with the token ids RL needs.

An agent that runs its own loop (any program speaking the OpenAI API: Harbor's installed agents, an OpenEnv
client, a script using the ``openai`` package) calls this endpoint; the trainer needs, for every call, the exact
prompt ids the model saw, the ids it sampled and their sampling log-probs, and which weights produced them.

Request (OpenAI's fields; unknown fields are refused by name): ``messages`` (roles ``system``/``developer``,
``user``, ``assistant`` — with ``tool_calls`` whose ``arguments`` are a JSON string, as OpenAI sends them — and
``tool`` with ``tool_call_id``; ``content`` a string or a list of ``{"type": "text"}`` parts), ``tools`` (OpenAI's
function schema, rendered through the model's chat template), ``tool_choice`` (``"auto"``/``"none"``), ``n``,
``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens`` (default: what is left of the context, at
most 1024), ``seed``, ``stop`` (strings: the completion ends at the token that completes one; the text stops before
it), ``logprobs`` (bool) + ``top_logprobs`` (0..20), and vLLM's extras ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``, ``return_token_ids``.

Response: OpenAI's ``chat.completion`` object — ``choices[].message`` with ``content`` and ``tool_calls`` (parsed
from the generated text with the parser that reads back the chat template's own tool-call format,
``posttrain.agents.tool_calls.detect_tool_call_parser``; a turn whose calls do not parse is plain content, as TRL's
tool loop treats it), ``finish_reason`` (``"stop"``, ``"length"``, or ``"tool_calls"`` when the turn ended with
calls), ``logprobs.content`` when asked, ``usage`` — plus, as vLLM returns them with ``return_token_ids``, the
top-level ``prompt_token_ids`` and per choice ``token_ids`` (always here: RL needs them), and posttrain's
``token_logprobs`` per choice (the sampled tokens' processed log-probs, always) and ``version`` (the weights).
The rendered prompt is served exactly as ``/v1/completions`` serves its token ids: the same seed gives the same
tokens and log-probs, and unseeded requests share engine batches with other requests.

Capture mode (``posttrain.serving.capture``): a call made under a rollout id (``X-Rollout-Id`` header,
``rollout_id`` field, or the base URL ``/rollouts/<id>/v1``) is recorded — prompt ids, each choice's ids, log-probs,
finish reason and message, the weight version — and ``GET`` / ``DELETE /v1/rollouts/<id>`` return the calls.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from posttrain.serving.capture import ROLLOUT_HEADER, CaptureStore, check_rollout_id
from posttrain.serving.engine import GenerationRequest, RequestError

MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 1024  # when neither max_tokens nor max_completion_tokens is given (capped by the context)
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatCompletionBody(BaseModel):
    """``POST /v1/chat/completions`` (OpenAI's field names and defaults, vLLM's extras; unknown fields refused)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[Any]
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    n: int = Field(1, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    stream: bool = False
    user: str | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    rollout_id: str | None = None  # capture mode (posttrain): see ``posttrain.serving.capture``
    # keep_routing's return_routing is a /v1/completions extension only: named here to answer a clear 400
    return_routing: bool = False


# -- validation -----------------------------------------------------------------------------------------------------
def _text_content(content: Any, where: str) -> str:
    """A message's ``content`` as text: a string, ``None`` (empty), or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"{where}.content",
                    f"{where}.content[{k}] is a {kind!r} part; this endpoint takes text content only (a string or "
                    '{"type": "text", "text": ...} parts).',
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content", f"{where}.content must be a string or a list of text parts, got "
                       f"{type(content).__name__}.")  # fmt: skip


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant message's tool call in chat-template form (arguments decoded from OpenAI's JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise RequestError(where, f'{where} must be {{"type": "function", "function": {{"name": ..., "arguments": '
                           '"<JSON object>"}}, "id": ...} with a non-empty name.')  # fmt: skip
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise RequestError(
                f"{where}.function.arguments",
                f"{where}.function.arguments is not valid JSON ({err.msg} at char {err.pos}); send the JSON text of "
                "an object, as the API returned it.",
            ) from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments", f"{where}.function.arguments must encode a JSON object.")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Check OpenAI ``messages`` and convert them to what chat templates render (text content, decoded tool-call
    arguments); raise ``RequestError`` naming ``messages[i]...`` for anything malformed."""
    if not messages:
        raise RequestError("messages", "messages is empty; send at least one message.")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(where, f"{where} must be an object with a role and content.")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role", f"{where}.role is {role!r}; it must be one of {', '.join(ROLES)}.")
        converted: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                     "content": _text_content(message.get("content"), where)}  # fmt: skip
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls", f"{where}.tool_calls must be a list of tool calls.")
            converted["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool":
            if message.get("tool_call_id") is not None:
                converted["tool_call_id"] = str(message["tool_call_id"])
            if message.get("name") is not None:
                converted["name"] = str(message["name"])
        elif message.get("name") is not None and isinstance(message["name"], str):
            converted["name"] = message["name"]
        unknown = sorted(set(message) - {"role", "content", "tool_calls", "tool_call_id", "name", "refusal"})
        if unknown:
            raise RequestError(f"{where}.{unknown[0]}", f"{where} has unknown field(s) {unknown}.")
        out.append(converted)
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Check OpenAI function tools (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""
    if not tools:
        return None
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(
                where, f'{where} must be {{"type": "function", "function": {{...}}}} (function tools only).'
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function", f"{where}.function must be an object with a name.")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function.name", f"{where}.function.name must be a non-empty string.")
        if name in seen:
            raise RequestError(f"{where}.function.name", f"{where}.function.name {name!r} is given twice.")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and (
            not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
        ):
            raise RequestError(f"{where}.function.parameters",
                               f"{where}.function.parameters must be a JSON schema of type 'object'.")  # fmt: skip
        if "description" in function and not isinstance(function["description"], str):
            raise RequestError(f"{where}.function.description", f"{where}.function.description must be a string.")
    return [{"type": "function", "function": dict(t["function"])} for t in tools]


# -- rendering and parsing ------------------------------------------------------------------------------------------
def tool_call_parser(engine: Any) -> str | None:
    """The registered tool-call parser that reads the engine's chat template back (``None``: calls are not parsed);
    detected once per engine and kept on it."""
    from posttrain.agents.tool_calls import detect_tool_call_parser

    if not hasattr(engine, "_chat_tool_call_parser"):
        try:
            engine._chat_tool_call_parser = detect_tool_call_parser(engine.tokenizer)
        except ValueError:
            engine._chat_tool_call_parser = None
    return engine._chat_tool_call_parser


def render_prompt(engine: Any, body: ChatCompletionBody) -> tuple[list[int], list[dict[str, Any]] | None]:
    """The prompt's token ids as the chat template renders ``messages`` and ``tools``, and the checked tools."""
    from posttrain.data.chat_templates import render_chat

    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not getattr(getattr(tokenizer, "tokenizer", tokenizer), "chat_template", None):
        raise RequestError("messages", f"The served model ({engine.model_name!r}) has no chat template; use "
                           "/v1/completions with a prompt, or serve a model whose tokenizer has one.")  # fmt: skip
    messages = chat_messages(body.messages)
    tools = chat_tools(body.tools)
    if body.add_generation_prompt and body.continue_final_message:
        raise RequestError("continue_final_message",
                           "continue_final_message=true needs add_generation_prompt=false.")  # fmt: skip
    if body.continue_final_message and messages[-1]["role"] != "assistant":
        raise RequestError("continue_final_message", "continue_final_message=true needs a final assistant message.")
    try:
        out = render_chat(
            tokenizer, messages, tools=tools, tokenize=True, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, **(body.chat_template_kwargs or {}),
        )  # fmt: skip
    except RequestError:
        raise
    except Exception as err:  # the template refused the conversation (e.g. roles out of the order it allows)
        raise RequestError("messages", f"The model's chat template cannot render these messages: {err}") from None
    ids = out["input_ids"]
    if not ids:
        raise RequestError("messages", "The chat template rendered these messages to no tokens.")
    return ids, tools


def chat_request(
    engine: Any, body: ChatCompletionBody, prompt_ids: list[int], temperature_floor: float = 1e-5
) -> GenerationRequest:
    """The engine request for a rendered chat prompt (the same one ``/v1/completions`` would build: a temperature
    below ``temperature_floor`` is served as greedy)."""
    if body.stream:
        raise RequestError("stream", "stream=true is not supported; send stream=false (the default).")
    if body.return_routing:
        raise RequestError(
            "return_routing", "return_routing=true (keep_routing) is not recorded for chat calls: captured agent "
            "rows merge several calls, and the training rows agent_rollout_func builds carry no MoE routing "
            "(keep_routing refuses rollout_func). Request /v1/completions with return_routing for routing replay, "
            "or train the agent with keep_routing=False.",
        )  # fmt: skip
    if body.model is not None and body.model != engine.model_name:
        raise RequestError(
            "model", f"The model {body.model!r} is not served here; this server serves {engine.model_name!r}."
        )
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name):
            raise RequestError(name, f"{name} is not supported; use repetition_penalty (vLLM's) instead.")
    if isinstance(body.tool_choice, dict) or body.tool_choice not in (None, "auto", "none"):
        raise RequestError("tool_choice", f"tool_choice={body.tool_choice!r} is not supported; use 'auto' or 'none'.")
    if body.top_logprobs is not None and body.top_logprobs > MAX_TOP_LOGPROBS:
        raise RequestError("top_logprobs", f"top_logprobs={body.top_logprobs} is more than {MAX_TOP_LOGPROBS}.")
    if body.top_logprobs and not body.logprobs:
        raise RequestError("top_logprobs", "top_logprobs needs logprobs=true.")
    if (body.max_tokens is not None and body.max_completion_tokens is not None
            and body.max_tokens != body.max_completion_tokens):  # fmt: skip
        raise RequestError("max_completion_tokens", "max_tokens and max_completion_tokens differ; send one of them.")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops):
        raise RequestError("stop", "stop strings must be non-empty.")
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        room = (engine.max_model_len - len(prompt_ids)) if engine.max_model_len else DEFAULT_MAX_TOKENS
        if room < 1:
            raise RequestError("messages", f"The messages render to {len(prompt_ids)} tokens: no room is left in the "
                               f"model's context length {engine.max_model_len}; send a shorter conversation.")  # fmt: skip
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    return GenerationRequest(
        prompts=[prompt_ids], n=body.n, max_tokens=max_tokens, temperature=0.0 if body.temperature < temperature_floor else body.temperature,
        top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, logprobs=True,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0, seed=body.seed,
    )  # fmt: skip


def _cut_at_stop(engine: Any, ids: list[int], stops: list[str], skip: bool) -> tuple[int, str, str] | None:
    """``(k, text, stop)`` when a stop string occurs in the decoded completion: ``ids[:k]`` is the shortest prefix whose
    text contains one (the token that completes it is kept, as vLLM keeps it in ``token_ids``), ``text`` the text
    before the first stop string."""
    full = engine.decode(ids, skip)
    hits = [full.find(s) for s in stops if s in full]
    if not hits:
        return None
    lo, hi = 1, len(ids)
    while lo < hi:  # the shortest prefix whose text holds a stop string (containment only grows with the prefix)
        mid = (lo + hi) // 2
        if any(s in engine.decode(ids[:mid], skip) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = engine.decode(ids[:lo], skip)
    first, stop = min((text.find(s), s) for s in stops if s in text)
    return lo, text[:first], stop


def _openai_logprobs(
    engine: Any, token_ids: list[int], logprobs: list[float], top: list | None, n_top: int, floor: float
) -> dict:
    """OpenAI's ``choices[].logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""

    def entry(token: int, lp: float) -> dict[str, Any]:
        text = engine.decode([token], False)
        return {"token": text, "logprob": max(lp, floor), "bytes": list(text.encode("utf-8"))}

    content = []
    for k, (token, lp) in enumerate(zip(token_ids, logprobs)):
        item = entry(token, lp)
        item["top_logprobs"] = [entry(t, v) for t, v in (top[k] if top else [])][:n_top]
        content.append(item)
    return {"content": content}  # -inf (a token the warpers filtered out) is reported as ``floor``


def chat_choice(engine: Any, body: ChatCompletionBody, index: int, seq: Any, tools: list | None,
                parser: str | None, logprob_floor: float = -9999.0) -> tuple[dict[str, Any], int]:  # fmt: skip
    """One ``choices[]`` entry for a generated sequence, and its completion-token count."""
    from posttrain.agents.tool_calls import assistant_message

    ids, lps, top, finish = list(seq.token_ids), list(seq.logprobs or []), seq.top_logprobs, seq.finish_reason
    stop_reason: int | str | None = seq.stop_reason
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    ends_with_stop_token = finish == "stop" and ids and seq.stop_reason is None  # EOS: not part of the text
    cut = _cut_at_stop(engine, ids, stops, body.skip_special_tokens) if stops else None
    if cut is not None:
        k, text, stop_reason = cut  # vLLM reports the matched stop string as the stop_reason
        ids, lps, top, finish = ids[:k], lps[:k], (top[:k] if top else top), "stop"
    else:
        text = engine.decode(ids[:-1] if ends_with_stop_token else ids, body.skip_special_tokens)
    message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
    if tools and parser is not None and body.tool_choice != "none":
        schemas = {t["function"]["name"]: t for t in tools}
        parsed, calls = assistant_message(text, parser, schemas)
        if calls:
            message["content"] = parsed["content"] or None
            message["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments or {})}}
                for c in calls
            ]  # fmt: skip
            if finish == "stop":
                finish = "tool_calls"
    choice = {
        "index": index,
        "message": message,
        "logprobs": _openai_logprobs(engine, ids, lps, top, body.top_logprobs or 0, logprob_floor)
        if body.logprobs
        else None,
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "token_ids": ids,
        "token_logprobs": lps,
    }
    return choice, len(ids)


# -- the route ------------------------------------------------------------------------------------------------------
def add_chat_routes(
    app: FastAPI, state: Any, engine: Any, *, busy: Callable[[], JSONResponse], error_response: Callable[..., JSONResponse],
    temperature_floor: float, logprob_floor: float,
) -> None:  # fmt: skip
    """Register ``POST /v1/chat/completions`` on ``app``: ``state`` is the server's ``ServerState`` (admission,
    the engine thread and its batching), ``busy`` its 429 answer, ``error_response`` its error shape; the floors are
    the server's (``app.py`` passes them, so this module does not import it back)."""

    captures = CaptureStore()
    app.state.chat_captures = captures

    def rollout_of(body: ChatCompletionBody, request: Request, from_path: str | None) -> str | None:
        """The rollout id a call is captured under: the URL's, the ``X-Rollout-Id`` header's or the body's (when
        several are given they must agree)."""
        given = {name: value for name, value in (("rollout_id", body.rollout_id),
                                                  ("X-Rollout-Id", request.headers.get(ROLLOUT_HEADER)),
                                                  ("path", from_path)) if value is not None}  # fmt: skip
        if not given:
            return None
        if len(set(given.values())) > 1:
            raise RequestError("rollout_id", f"The call names different rollout ids: {given}; give one.")
        return check_rollout_id(next(iter(given.values())))

    async def serve(body: ChatCompletionBody, request: Request, from_path: str | None = None) -> JSONResponse:
        rollout_id = rollout_of(body, request, from_path)
        prompt_ids, tools = await run_in_threadpool(render_prompt, engine, body)
        gen = chat_request(engine, body, prompt_ids, temperature_floor)
        engine.check(gen)
        if not state.admit():
            return busy()

        def fn() -> tuple[int, list]:
            return state.version, engine.generate(gen)

        result = await state.run(request, fn, gen)
        if result is None:
            return error_response(499, "Client disconnected.", None, "ClientDisconnected")
        version, groups = result
        state.count("completed")
        parser = tool_call_parser(engine) if tools else None

        def build() -> tuple[list, int]:
            choices, used = [], 0
            for j, seq in enumerate(groups[0]):
                choice, count = chat_choice(engine, body, j, seq, tools, parser, logprob_floor)
                choices.append(choice)
                used += count
            return choices, used

        choices, completion_tokens = await run_in_threadpool(build)
        answer = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": engine.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
            "prompt_token_ids": prompt_ids,
            "version": version,
        }  # fmt: skip
        if rollout_id is not None:
            answer["rollout_id"] = rollout_id
            answer["capture_index"] = captures.record(rollout_id, {
                "id": answer["id"],
                "prompt_token_ids": prompt_ids,
                "completions": [{"token_ids": c["token_ids"], "logprobs": c["token_logprobs"],
                                 "finish_reason": c["finish_reason"], "message": c["message"]} for c in choices],
                "version": version,
            })  # fmt: skip
        return JSONResponse(answer)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody, request: Request):
        return await serve(body, request)

    @app.post("/rollouts/{rollout_id}/v1/chat/completions")
    async def rollout_chat_completions(rollout_id: str, body: ChatCompletionBody, request: Request):
        """The same endpoint under a per-rollout base URL (``http://host:port/rollouts/<id>/v1``): every call is
        captured under ``<id>`` without the agent having to send a header or field."""
        return await serve(body, request, rollout_id)

    def captured(rollout_id: str, pop: bool) -> JSONResponse:
        calls = captures.get(check_rollout_id(rollout_id), pop=pop)
        if calls is None:
            return error_response(404, f"No chat calls were captured under rollout id {rollout_id!r} (or they were "
                                  "collected already).", "rollout_id", "NotFoundError")  # fmt: skip
        return JSONResponse({"rollout_id": rollout_id, "calls": calls, "version": state.version})

    @app.get("/v1/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str):
        """The calls captured under ``rollout_id``, in the order they were answered."""
        return captured(rollout_id, pop=False)

    @app.delete("/v1/rollouts/{rollout_id}")
    async def collect_rollout(rollout_id: str):
        """The calls captured under ``rollout_id``, forgotten by the server (collect once per rollout)."""
        return captured(rollout_id, pop=True)
