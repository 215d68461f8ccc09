"""The ``posttrain serve`` HTTP server: the part of vLLM's OpenAI-compatible API that RL needs, plus weight updates.

Endpoints (FastAPI on uvicorn):

- ``POST /v1/completions`` — vLLM's completions request with token-id prompts (``prompt``: ids, a list of id lists,
  or text), ``n``, ``max_tokens`` (16), ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (0/-1 = off), ``min_p``,
  ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``logprobs`` (0 = the sampled token's log-prob under
  the processed sampling distribution, vLLM's ``processed_logprobs``; N in 1..20 = that and, as vLLM returns it,
  ``logprobs.top_logprobs``: per token a dict of the sampled token and the top-N, ``-9999.0`` for filtered-out
  tokens; null = none), ``seed`` (0 <= seed < 2**64), ``return_token_ids``. A ``temperature`` below 1e-5 is served
  as greedy (0). A prompt may also be vLLM's multimodal token prompt, ``{"prompt_token_ids": [...],
  "multi_modal_data": {"image": [data URL, ...]}}`` (``multimodal_prompts``; images decoded here, rebuilt into
  vision inputs by the engine; 400 ``param="multi_modal_data"`` for what cannot be served). Each choice
  (``index = prompt * n + j``) carries ``token_ids``, ``prompt_token_ids``,
  ``text``, ``logprobs.token_logprobs`` and ``finish_reason`` (``"stop"``/``"length"``). posttrain's extensions under
  top-k / top-p / min-p: ``logprobs.log_kept_mass`` (always) and, with ``"return_sampling_mask": true``,
  ``logprobs.sampling_mask`` — per token the kept support (a list of at most 16 ids, a float logit threshold, or
  null = unknown; ``posttrain.core.sampling_mask``), so the payload grows by at most 16 ints per token. With
  ``"return_routing": true`` (``keep_routing``; posttrain engine, MoE models) each choice carries ``routing`` — the
  top-k experts per router layer of its completion tokens — and the response ``prompt_routing`` (one per prompt, the
  routing of its prefill, shared by the prompt's ``n`` choices; a choice whose prefill routed otherwise carries its
  own ``prompt_routing``), each ``{"dtype", "shape": [tokens, layers, top_k], "data": base64}`` storing
  ``expert + 1`` (0 = not recorded: a completion's last token, never fed back), ``layers · top_k`` bytes per token
  for up to 255 experts (``posttrain.models.moe_routing.routing_to_wire``).
- ``POST /v1/chat/completions`` — OpenAI's chat API (messages, tools through the chat template, parsed
  ``tool_calls``) with vLLM's ``prompt_token_ids`` / ``token_ids`` and the sampled log-probs: ``serving/chat.py``.
- ``GET /health`` (and TRL's ``/health/``) — ``{"status": "ok", "server": "posttrain", "version": ...}``;
  ``GET /v1/models``; ``GET /get_world_size`` (and ``/get_world_size/``).
- ``POST /get_sequence_logprobs/`` — TRL's teacher-scoring request for server distillation: ``sequences`` (token
  ids), ``prompt_lengths``, ``top_logprobs`` (K), ``temperature``; returns, per completion token, the top-K
  ``logprobs`` / ``logprob_token_ids`` and the ``actual_logprobs`` of the sequence's own tokens (posttrain engine).
- ``POST /v1/load_weights`` — a safetensors payload as the body (see ``posttrain.generation.weights`` for why);
  query ``update_id`` + ``chunk`` (0, 1, ...) + ``last=false`` stage a chunk of a larger update, ``last=true``
  (default) applies everything staged for that ``update_id`` at once; ``version=N`` sets the new weight version
  (default: previous + 1). ``chunk_digest`` (SHA-256 of the body) and, on the last chunk, ``update_digest`` are
  checked; every chunk is checked for names, shapes, dtypes and finite values before it is staged (``WeightStaging``:
  a refused chunk discards its update, 400/409 with the reason, and the previous weights keep serving). The answer
  echoes ``update_id``, the digests and the new ``version`` (with ``previous_version``). A payload whose
  safetensors header says ``format: posttrain.lora_adapter.v1`` (``adapter_weights``) is an adapter-only update: the
  posttrain engine wraps its base with the LoRA config from the header and loads the adapter tensors (checked against
  that adapter's names and shapes, whole or not at all); the vLLM engine refuses it (400).
- TRL's ``trl vllm-serve`` API: ``POST /generate/`` (same sampling fields, TRL's response shape),
  ``/reset_prefix_cache/``, and ``/init_communicator/``, ``/update_named_param/``, ``/close_communicator/`` (NCCL
  weight broadcast: served by the vLLM engine; the posttrain engine answers 400 pointing at ``/v1/load_weights``).

Every response carries the weight ``version`` the request was served with (the number of weight updates applied,
or the ``version`` the trainer set). Requests and weight loads run one at a time, in arrival order, on one engine
thread, so a generation never sees half-loaded weights; unseeded requests with equal sampling parameters waiting
back to back share one engine call (see ``ServerState``), seeded ones run alone and stay reproducible.

Errors: a bad request gets a 400 in OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, whose
``param`` and message name the field. At most ``max_queue_size`` requests are admitted (running or waiting); more
get a 429 with ``Retry-After`` (backpressure; the client retries). A client that disconnects while its request
waits has the request dropped before it runs; one that disconnects while it runs costs that one generation and
nothing else. A request body above ``max_request_bytes`` (16 MiB; weight pushes exempt) gets a 413 before it is
parsed. SIGTERM / Ctrl-C shut down gracefully: no new connections, in-flight requests finish (up to
``graceful_timeout`` seconds), then the worker stops. A request still running or queued when ``graceful_timeout``
runs out gets a 503 with ``Retry-After`` (``_ShutdownAs503``; uvicorn would answer a bare 500), so a client retries it
on the next server inside its own deadline; the engine thread is then given ``graceful_timeout`` more to finish its
current job before the process exits without it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from posttrain.serving.engine import GenerationRequest, RequestError

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_SIZE = 64
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
MAX_SEED = 2**64 - 1  # a sampling seed is an unsigned 64-bit integer (torch.Generator.manual_seed's range)
# A temperature in (0, TEMPERATURE_FLOOR) is served as greedy (temperature 0): dividing logits by it overflows to
# inf/NaN, and sampling at it is argmax up to exact ties anyway. Scoring (/get_sequence_logprobs/) refuses it.
TEMPERATURE_FLOOR = 1e-5
MAX_LOGPROBS = 20  # most top log-probs per token (vLLM's default --max-logprobs)
LOGPROB_FLOOR = -9999.0  # what -inf (a token the warpers filtered out) is reported as, as vLLM and OpenAI do


# -- request bodies -------------------------------------------------------------------------------------------------
class TokensPromptBody(BaseModel):
    """One vLLM token prompt with images: ``{"prompt_token_ids": [...], "multi_modal_data": {"image": [...]}}``;
    each image a base64 data URL (``data:image/png;base64,...``) or bare base64 (``image`` may be one image)."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int]
    multi_modal_data: dict[str, Any] | None = None


class CompletionBody(BaseModel):
    """``POST /v1/completions`` (vLLM's field names and defaults; unknown fields are rejected by name)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: list[list[int]] | list[int] | list[str] | str | list[TokensPromptBody] | TokensPromptBody
    n: int = Field(1, ge=1, le=4096)
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    return_token_ids: bool | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    echo: bool = False
    structured_outputs: dict[str, Any] | None = None
    user: str | None = None
    # posttrain's extension (keep_sampling_mask): with logprobs, each token's kept support under top-k/top-p/min-p
    return_sampling_mask: bool = False
    # posttrain's extension (keep_routing): a MoE model's top-k experts per router layer, per prompt/completion token
    return_routing: bool = False


class SequenceLogprobsBody(BaseModel):
    """``POST /get_sequence_logprobs/`` (TRL's teacher-scoring request): full token sequences, where each
    completion starts, how many top log-probs to return per completion token, and the softmax temperature."""

    model_config = ConfigDict(extra="forbid")
    sequences: list[list[int]]
    prompt_lengths: list[int]
    top_logprobs: int = Field(1, ge=0)
    temperature: float = Field(1.0, ge=TEMPERATURE_FLOOR, allow_inf_nan=False)


class TRLGenerateBody(BaseModel):
    """``POST /generate/`` as ``trl vllm-serve`` takes it."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[list[int]] | list[str]
    images: list[Any] | None = None
    n: int = Field(1, ge=1, le=4096)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(0, ge=0)
    structured_outputs_regex: str | None = None
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)
    return_sampling_mask: bool = False  # posttrain's extension, as on /v1/completions
    # keep_routing's return_routing is a /v1/completions extension only: named here to answer a clear 400
    return_routing: bool = False


# -- errors ---------------------------------------------------------------------------------------------------------
def error_response(status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for e in err.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # Union members appear in the location (e.g. prompt.list[int].0); keep the user-facing path.
        loc = [x for x in loc if not (x.startswith(("list[", "str", "int", "dict[")) or x in ("str", "int"))]
        name = ".".join(loc) or "body"
        param = param or (loc[0] if loc else "body")
        parts.append(f"{name}: {e.get('msg')}")
    unique = list(dict.fromkeys(parts))
    return "Invalid request: " + "; ".join(unique[:5]), param


SHUTDOWN_RETRY_AFTER_S = 1


class _ShutdownAs503:
    """ASGI middleware: a request cancelled before its response started gets a 503 + ``Retry-After``.

    uvicorn cancels the requests still running when ``timeout_graceful_shutdown`` runs out, and answers a cancelled
    request with a bare 500, which a client must treat as a server bug; the work was simply not finished before
    shutdown, which is what 503 + ``Retry-After`` says (``GenerationClient`` retries it inside its deadline). The
    engine skips a cancelled job that has not started (its future is cancelled with the request).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started:
                raise
            logger.warning("%s %s not finished before shutdown: answered 503", scope.get("method"), scope.get("path"))
            body = (
                b'{"error": {"message": "The server is shutting down and could not finish this request; retry '
                b'shortly (on the restarted server).", "type": "ServiceUnavailable", "param": null, "code": 503}}'
            )
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"retry-after", str(SHUTDOWN_RETRY_AFTER_S).encode()),
                (b"connection", b"close"), (b"content-length", str(len(body)).encode()),
            ]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """ASGI middleware: a request body above ``max_bytes`` gets 413 before any of it is parsed.

    A ``Content-Length`` over the limit is refused before the body is read; a body without one (chunked) is counted
    as it streams and refused as soon as it passes the limit, so an oversized JSON prompt never reaches the JSON
    parser (whose Python objects cost ~70 times the body's bytes). ``exempt`` paths (the weight pushes, bounded by
    the client's ``chunk_bytes``) are passed through unread.
    """

    def __init__(self, app: Any, max_bytes: int, exempt: tuple[str, ...] = ("/v1/load_weights",)):
        if max_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1 (or None for no limit), got {max_bytes}.")
        self.app, self.max_bytes, self.exempt = app, int(max_bytes), exempt

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, send, int(length))
            return
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                first = message
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(scope, send, None)
                return
            parts.append(body)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                break
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, send: Callable, length: int | None) -> None:
        got = f"{length} bytes" if length is not None else f"more than {self.max_bytes} bytes"
        response = error_response(
            413,
            f"The request body ({got}) is larger than this server's limit of {self.max_bytes} bytes; send fewer or "
            "shorter prompts per request, or restart the server with a larger --max_request_bytes.",
            "body",
            "RequestTooLarge",
        )
        response.headers["Connection"] = "close"

        async def no_body() -> dict:
            return {"type": "http.disconnect"}

        await response(scope, no_body, send)


# -- server state ---------------------------------------------------------------------------------------------------
class _Job:
    """A unit of work for the engine thread; ``gen`` marks a generation that may share a batch with others."""

    __slots__ = ("fn", "future", "gone", "gen")

    def __init__(self, fn: Callable[[], Any], gen: GenerationRequest | None = None):
        self.fn = fn
        self.gen = gen
        self.future: Future = Future()
        self.gone = threading.Event()


def _batch_key(request: GenerationRequest) -> tuple | None:
    """Requests with equal keys can be served by one engine call (their prompts concatenated); seeded ones never."""
    if request.seed is not None or request.extra or request.structured_outputs_regex is not None or request.images:
        return None
    return (request.n, request.max_tokens, request.temperature, request.top_p, request.top_k, request.min_p,
            request.repetition_penalty, tuple(request.stop_token_ids), request.ignore_eos, request.logprobs,
            request.top_logprobs, request.return_sampling_mask, request.return_routing)  # fmt: skip


@dataclasses.dataclass
class _StagedUpdate:
    """The chunks of one weight update received so far (checked, not yet applied)."""

    update_id: str
    tensors: dict[str, Any] = dataclasses.field(default_factory=dict)
    digests: list[str] = dataclasses.field(default_factory=list)
    adapter_config: dict[str, Any] | None = None  # an adapter-only (LoRA) update: its config, from chunk 0

    @property
    def chunks(self) -> int:
        return len(self.digests)


class WeightUpdateConflict(RequestError):
    """A chunk that does not continue the update being staged (answered 409)."""


class WeightStaging:
    """Which weight update is being staged, and which were applied or aborted (bounded memories of both).

    One update is staged at a time. Its chunks must arrive in order (``chunk`` = 0, 1, ...); a chunk 0 of a *new*
    ``update_id`` aborts a half-staged one (its writer gave up, or a second writer started), and every later chunk of
    an aborted update is refused with 409, so two interleaved updates can never be applied as a mixture: at most the
    one that started last is applied, whole. A chunk sent again with the same index and digest (a client retry after
    a lost answer) is answered as the first time, and so is a finished update's last chunk.
    """

    MEMORY = 64

    def __init__(self) -> None:
        self.current: _StagedUpdate | None = None
        self._aborted: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._applied: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.applying: dict[str, asyncio.Future] = {}  # updates handed to the engine, by id: their answer to come
        self._last_digest: dict[str, str] = {}

    @staticmethod
    def _remember(memory: collections.OrderedDict, key: str, value: Any) -> None:
        memory[key] = value
        while len(memory) > WeightStaging.MEMORY:
            memory.popitem(last=False)

    def abort(self, update_id: str, reason: str) -> None:
        """Discard ``update_id`` (staged chunks dropped); its later chunks get 409 naming ``reason``."""
        if self.current is not None and self.current.update_id == update_id:
            self.current = None
        self._remember(self._aborted, update_id, reason)

    def finished(self, update_id: str, last: bool, digest: str | None) -> dict[str, Any] | None:
        """The earlier answer to a repeated last chunk of an applied update; 409 for chunks of a finished one."""
        if update_id in self._aborted:
            raise WeightUpdateConflict(
                "update_id",
                f"Weight update {update_id!r} was aborted ({self._aborted[update_id]}); nothing of it is applied. "
                "Push the weights again under a new update_id.",
            )
        if update_id in self._applied:
            result = self._applied[update_id]
            if last and (digest is None or digest.lower() == result["digest"]):
                return result
            raise WeightUpdateConflict(
                "update_id", f"Weight update {update_id!r} was applied already; push new weights under a new update_id."
            )
        return None

    def stage(
        self, update_id: str, chunk: int | None, digest: str, tensors: dict[str, Any],
        adapter_config: dict[str, Any] | None = None,
    ) -> _StagedUpdate:  # fmt: skip
        """Add a checked chunk to ``update_id`` (``WeightUpdateConflict`` when it does not continue it; every chunk
        of an adapter-only update must carry the same ``adapter_config``, and a full update none)."""
        current = self.current
        if current is not None and current.update_id == update_id:
            index = current.chunks if chunk is None else chunk
            if index == current.chunks - 1 and current.digests[-1] == digest:
                return current  # the same chunk again: a retry
            if index != current.chunks:
                self.abort(update_id, f"chunk {index} arrived where chunk {current.chunks} was expected")
                raise WeightUpdateConflict(
                    "chunk",
                    f"Weight update {update_id!r}: chunk {index} arrived where chunk {current.chunks} was expected; "
                    "the update is discarded (nothing applied). Push it again from chunk 0 under a new update_id.",
                )
        else:
            index = 0 if chunk is None else chunk
            if index != 0:
                raise WeightUpdateConflict(
                    "chunk",
                    f"Weight update {update_id!r}: chunk {index} arrived but the server holds no earlier chunk of it "
                    "(the server restarted, or another update superseded it). Push it again from chunk 0.",
                )
            if current is not None:
                logger.warning("Weight update %s aborted after %d chunk(s): update %s started.",
                               current.update_id, current.chunks, update_id)  # fmt: skip
                self.abort(current.update_id, f"superseded by weight update {update_id!r} before its last chunk")
            current = self.current = _StagedUpdate(update_id, adapter_config=adapter_config)
        if adapter_config != current.adapter_config:
            self.abort(update_id, "its chunks mix adapter-only and full weights (or two adapter configs)")
            raise WeightUpdateConflict(
                "body",
                f"Weight update {update_id!r}: a chunk's adapter config differs from chunk 0's (adapter-only and full "
                "weights, or two LoRA configs, in one update); it is discarded. Push it again under a new update_id.",
            )
        twice = sorted(set(tensors) & set(current.tensors))
        if twice:
            self.abort(update_id, f"tensor {twice[0]!r} was sent twice")
            raise RequestError("body", f"Weight update {update_id!r} sends {twice[0]!r} twice; it is discarded.")
        current.tensors.update(tensors)
        current.digests.append(digest)
        return current

    def take(self, update_id: str) -> None:
        """The staged update is complete: stop staging it (the caller applies it and registers its answer in
        ``applying`` until it is known)."""
        if self.current is not None and self.current.update_id == update_id:
            self._last_digest[update_id] = self.current.digests[-1]
            self.current = None

    def last_digest(self, update_id: str) -> str | None:
        """The digest of the last chunk of an update being applied."""
        return self._last_digest.get(update_id)

    def settled(self, update_id: str) -> None:
        """The update handed to the engine has its answer (applied or failed)."""
        self.applying.pop(update_id, None)
        self._last_digest.pop(update_id, None)

    def applied(self, update_id: str, result: dict[str, Any]) -> None:
        self.settled(update_id)
        self._remember(self._applied, update_id, result)


class ServerState:
    """The engine, the weight version, the engine thread with its FIFO queue, and the admission counter.

    Jobs run one at a time in arrival order. Unseeded generation requests with the same sampling parameters that
    are waiting back to back are served by one engine call (their prompts concatenated, at most
    ``max_batch_prompts`` prompts), which on the group sampler batches their decode steps; a seeded request always
    runs alone, so its tokens depend only on its seed and the weights.
    """

    def __init__(self, engine: Any, max_queue_size: int, version: int = 0, max_batch_prompts: int = 64):
        if max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {max_queue_size}.")
        self.engine = engine
        self.version = version
        self.max_queue_size = max_queue_size
        self.max_batch_prompts = max_batch_prompts
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="posttrain-engine", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self.pending = 0
        self.stats = {"completed": 0, "dropped_disconnected": 0, "rejected_busy": 0, "weight_updates": 0,
                      "engine_calls": 0}  # fmt: skip
        self.weights = WeightStaging()
        self.nccl_params_since_version = False

    def admit(self) -> bool:
        with self._lock:
            if self.pending >= self.max_queue_size:
                self.stats["rejected_busy"] += 1
                return False
            self.pending += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.pending -= 1

    def count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            batch = [job]
            key = _batch_key(job.gen) if job.gen is not None else None
            if key is not None:
                prompts = len(job.gen.prompts)
                while True:  # only this thread takes from the queue, so a peeked job is still there to take
                    with self._queue.mutex:
                        nxt = self._queue.queue[0] if self._queue.queue else None
                    if nxt is None or nxt.gen is None or _batch_key(nxt.gen) != key:
                        break
                    if prompts + len(nxt.gen.prompts) > self.max_batch_prompts:
                        break
                    batch.append(self._queue.get_nowait())
                    prompts += len(nxt.gen.prompts)
            self._run(batch)

    def _run(self, batch: list[_Job]) -> None:
        live = []
        for job in batch:
            if not job.future.set_running_or_notify_cancel():
                self.release()
            elif job.gone.is_set():
                self.count("dropped_disconnected")
                job.future.set_result(None)
                self.release()
            else:
                live.append(job)
        if not live:
            return
        try:
            if len(live) == 1:
                self.count("engine_calls")
                results = [live[0].fn()]
            else:
                merged = dataclasses.replace(live[0].gen, prompts=[p for j in live for p in j.gen.prompts])
                self.count("engine_calls")
                groups = self.engine.generate(merged)
                results, start = [], 0
                for j in live:
                    results.append((self.version, groups[start : start + len(j.gen.prompts)]))
                    start += len(j.gen.prompts)
        except BaseException as err:
            for job in live:
                job.future.set_exception(err)
                self.release()
            return
        for job, result in zip(live, results):
            job.future.set_result(result)
            self.release()

    def shutdown(self, timeout: float | None = None) -> None:
        """Let the queued jobs finish, then stop the engine thread; wait at most ``timeout`` seconds (None: no
        limit) and log an engine job still running then (the thread is a daemon: the process exits without it)."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("The engine thread is still running a job %s s after shutdown began; exiting without it.",
                         timeout)  # fmt: skip

    # -- scheduling from the event loop ---------------------------------------------------------------------------
    async def run(self, request: Request | None, fn: Callable[[], Any], gen: GenerationRequest | None = None) -> Any:
        """Run ``fn`` on the engine thread (after every earlier job); skipped if the client left while it waited.

        Returns ``fn()``'s result, or ``None`` when skipped. The admission slot is released when the job ends.
        ``gen`` (with ``fn`` returning ``(version, engine.generate(gen))``) lets the job share a batch.
        """
        job = _Job(fn, gen)
        self._queue.put(job)
        watcher = asyncio.ensure_future(self._watch(request, job)) if request is not None else None
        try:
            return await asyncio.wrap_future(job.future)
        finally:
            if watcher is not None:
                watcher.cancel()

    def submit(self, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` on the engine thread without waiting for it (errors are logged)."""

        def logged() -> None:
            try:
                fn()
            except Exception:
                logger.exception("Background engine job failed")

        self._queue.put(_Job(logged))

    @staticmethod
    async def _watch(request: Request, job: _Job) -> None:
        while not job.future.running() and not job.future.done():
            if await request.is_disconnected():
                job.gone.set()
                return
            await asyncio.sleep(0.05)


# -- conversion -----------------------------------------------------------------------------------------------------
def multimodal_prompts(prompt: Any) -> tuple[list[list[int]], list[list[Any] | None]] | None:
    """vLLM token prompts with ``multi_modal_data`` (``TokensPromptBody``): their ids and decoded images per prompt;
    None for the other prompt forms. An undecodable image or an unknown modality is a 400 naming the field."""
    from posttrain.generation.images import decode_image

    if isinstance(prompt, TokensPromptBody):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], TokensPromptBody):
        return None
    ids, images = [], []
    for i, entry in enumerate(prompt):
        if not entry.prompt_token_ids:
            raise RequestError("prompt", f"prompt[{i}].prompt_token_ids is empty; every prompt needs at least one token.")
        data = dict(entry.multi_modal_data or {})
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise RequestError(
                "multi_modal_data", f"prompt[{i}].multi_modal_data has {unknown}: this server takes images only "
                "(multi_modal_data.image).",
            )  # fmt: skip
        raw = data.get("image")
        raw = [] if raw is None else raw if isinstance(raw, list) else [raw]
        decoded = []
        for j, item in enumerate(raw):
            try:
                decoded.append(decode_image(item))
            except ValueError as err:
                raise RequestError(
                    "multi_modal_data",
                    f"prompt[{i}].multi_modal_data.image[{j}] cannot be decoded: {err}. Send each image as a base64 "
                    "data URL (data:image/png;base64,...).",
                ) from None
        ids.append(list(entry.prompt_token_ids))
        images.append(decoded or None)
    return ids, images


def _token_prompts(engine: Any, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise RequestError("prompt", "prompt is empty: give token ids, a list of token-id lists, or text.")
    if all(isinstance(x, int) for x in prompt):
        prompt = [prompt]
    out = [engine.tokenize(p) if isinstance(p, str) else list(p) for p in prompt]
    for i, ids in enumerate(out):
        if not ids:
            raise RequestError("prompt", f"prompt[{i}] is empty; every prompt needs at least one token.")
    return out


def _top_logprobs(seq: Any) -> list[dict[str, float]]:
    """Per token, vLLM's ``top_logprobs`` entry: the sampled token first, then the top-N by decreasing log-prob
    (N or N + 1 entries: the sampled token appears once), keyed ``token_id:<id>`` like ``tokens``."""
    out = []
    for token, lp, top in zip(seq.token_ids, seq.logprobs, seq.top_logprobs or []):
        entry = {f"token_id:{token}": max(lp, LOGPROB_FLOOR)}
        for t, v in top:
            entry.setdefault(f"token_id:{t}", max(v, LOGPROB_FLOOR))
        out.append(entry)
    return out


def _temperature(value: float) -> float:
    """The temperature a request is served with: below ``TEMPERATURE_FLOOR`` it is greedy (0)."""
    return 0.0 if value < TEMPERATURE_FLOOR else value


def completion_request(engine: Any, body: CompletionBody) -> GenerationRequest:
    if body.stream:
        raise RequestError("stream", "stream=true is not supported; send stream=false (the default).")
    if body.echo:
        raise RequestError("echo", "echo=true is not supported; the prompt ids are returned in prompt_token_ids.")
    if body.logprobs is not None and body.logprobs > MAX_LOGPROBS:
        raise RequestError(
            "logprobs", f"logprobs={body.logprobs} is more than this server returns ({MAX_LOGPROBS}, vLLM's default "
            "--max-logprobs); ask for fewer top log-probs per token.",
        )  # fmt: skip
    if body.model is not None and body.model != engine.model_name:
        raise RequestError("model", f"The model {body.model!r} is not served here; this server serves {engine.model_name!r}.")
    regex = None
    if body.structured_outputs:
        unknown = set(body.structured_outputs) - {"regex"}
        if unknown:
            raise RequestError("structured_outputs", f"Only structured_outputs.regex is supported, got {sorted(unknown)}.")
        regex = body.structured_outputs.get("regex")
    multimodal = multimodal_prompts(body.prompt)
    prompts, images = multimodal if multimodal is not None else (_token_prompts(engine, body.prompt), None)
    return GenerationRequest(
        prompts=prompts,
        images=images if images and any(images) else None,
        n=body.n,
        max_tokens=body.max_tokens or 16,
        temperature=_temperature(body.temperature),
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        seed=body.seed,
        return_sampling_mask=body.return_sampling_mask,
        return_routing=body.return_routing,
        structured_outputs_regex=regex,
    )


def trl_request(engine: Any, body: TRLGenerateBody) -> GenerationRequest:
    if body.images and any(img is not None for img in body.images):
        raise RequestError(
            "images", "Images on /generate/ are not supported by this server: send them to /v1/completions as vLLM "
            "multimodal prompts ({\"prompt_token_ids\": [...], \"multi_modal_data\": {\"image\": [...]}}).",
        )  # fmt: skip
    if body.logprobs not in (None, 0):
        raise RequestError("logprobs", f"logprobs={body.logprobs} is not supported: use 0 (sampled token only).")
    if body.return_routing or body.generation_kwargs.get("return_routing"):
        # TRL's /generate/ response has no per-prompt part to carry the prompt's prefill routing
        raise RequestError(
            "return_routing", "return_routing=true (keep_routing) is answered on /v1/completions only (posttrain's "
            "protocol, whose response carries each prompt's and each completion's MoE routing); TRL's /generate/ "
            "does not return it. Point the trainer at this server with the posttrain protocol (posttrain's "
            "VLLMServerBackend detects it), or train with keep_routing=False.",
        )  # fmt: skip
    extra = dict(body.generation_kwargs)
    seed = extra.pop("seed", None)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise RequestError("seed", f"generation_kwargs.seed must be an integer in [0, 2**64 - 1], got {seed!r}.")
    return GenerationRequest(
        prompts=_token_prompts(engine, body.prompts),
        n=body.n,
        max_tokens=body.max_tokens,
        temperature=_temperature(body.temperature),
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        logprobs=body.logprobs is not None,
        seed=seed,
        return_sampling_mask=body.return_sampling_mask,
        structured_outputs_regex=body.structured_outputs_regex,
        extra=extra,
    )


def _add_routing(choice: dict[str, Any], routing: Any, prompt_len: int, shared: Any, prompt_routing: list) -> Any:
    """Put one sequence's MoE routing ``(P + C, L, k)`` into its ``choice`` (completion part: ``routing``) and its
    prompt part into ``prompt_routing`` (once per prompt: ``shared``, the first sequence's); a prompt part unlike the
    shared one travels in the choice itself. Returns the prompt's shared prompt routing."""
    import torch

    from posttrain.models.moe_routing import routing_to_wire

    head = routing[:prompt_len]
    choice["routing"] = routing_to_wire(routing[prompt_len:])
    if shared is None:
        prompt_routing.append(routing_to_wire(head))
        return head
    if not torch.equal(head, shared):
        choice["prompt_routing"] = routing_to_wire(head)
    return shared


# -- the app --------------------------------------------------------------------------------------------------------
def create_app(
    engine: Any, *, max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE, version: int = 0, graceful_timeout: float = 30.0,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:  # fmt: skip
    """The FastAPI application serving ``engine`` (see the module docstring); ``graceful_timeout`` bounds the wait
    for the engine's last job at shutdown; ``max_request_bytes`` bounds every request body but the weight pushes'
    (413 above it, ``None`` = no limit)."""
    if max_request_bytes is not None and max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1 (or None for no limit), got {max_request_bytes}.")
    state = ServerState(engine, max_queue_size, version)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # Graceful shutdown: uvicorn has let in-flight requests finish (or cancelled them: 503s); stop the worker
        # after its last job, without blocking the event loop, for at most graceful_timeout.
        await asyncio.to_thread(state.shutdown, graceful_timeout)
        with contextlib.suppress(Exception):
            engine.close()

    app = FastAPI(title="posttrain generation server", lifespan=lifespan, redirect_slashes=False)
    app.state.server = state
    app.add_middleware(_ShutdownAs503)
    if max_request_bytes is not None:
        app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        message, param = _validation_message(err)
        return error_response(400, message, param)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, err: RequestError):
        if isinstance(err, WeightUpdateConflict):
            return error_response(409, str(err), err.param, "ConflictError")
        return error_response(400, str(err), err.param)

    def busy() -> JSONResponse:
        resp = error_response(
            429, f"The server is busy ({state.max_queue_size} requests queued); retry shortly.", None, "TooManyRequests"
        )
        resp.headers["Retry-After"] = "1"
        return resp

    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "server": "posttrain",
            "backend": engine.name,
            "model": engine.model_name,
            "version": state.version,
            "pending": state.pending,
            "max_queue_size": state.max_queue_size,
            **{f"stats_{k}": v for k, v in state.stats.items()},
        }

    app.get("/health")(health)
    app.get("/health/")(health)

    def world_size() -> dict[str, int]:
        return {"world_size": int(engine.world_size)}

    app.get("/get_world_size")(world_size)
    app.get("/get_world_size/")(world_size)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        card = {"id": engine.model_name, "object": "model", "owned_by": "posttrain", "version": state.version}
        card["max_model_len"] = engine.max_model_len
        return {"object": "list", "data": [card], "version": state.version}

    def _generate(request: GenerationRequest) -> Callable[[], tuple[int, list]]:
        def fn() -> tuple[int, list]:
            return state.version, engine.generate(request)

        return fn

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        gen = completion_request(engine, body)
        engine.check(gen)
        if not state.admit():
            return busy()
        result = await state.run(request, _generate(gen), gen)
        if result is None:  # the client left before its turn
            return error_response(499, "Client disconnected.", None, "ClientDisconnected")
        version, groups = result
        state.count("completed")
        choices, completion_tokens = [], 0
        prompt_routing: list[Any] = []
        for p, group in enumerate(groups):
            shared = None  # this prompt's prefill routing (P, L, k), sent once in prompt_routing
            for j, seq in enumerate(group):
                completion_tokens += len(seq.token_ids)
                logprobs = None
                if seq.logprobs is not None:
                    logprobs = {
                        "token_logprobs": seq.logprobs,
                        "tokens": [f"token_id:{t}" for t in seq.token_ids],
                        "top_logprobs": _top_logprobs(seq) if gen.top_logprobs else None,
                        "text_offset": None,
                    }
                    if seq.log_kept_mass is not None:  # posttrain's extension: truncated sampling's kept mass
                        logprobs["log_kept_mass"] = seq.log_kept_mass
                    if seq.sampling_mask is not None:  # posttrain's extension: the kept support per token
                        logprobs["sampling_mask"] = seq.sampling_mask
                choice = {
                    "index": p * gen.n + j,
                    "text": engine.decode(seq.token_ids, body.skip_special_tokens),
                    "token_ids": seq.token_ids,
                    "prompt_token_ids": gen.prompts[p],
                    "logprobs": logprobs,
                    "finish_reason": seq.finish_reason,
                    "stop_reason": seq.stop_reason,
                }
                if seq.routing is not None:  # posttrain's extension (keep_routing): the MoE routing, compactly
                    shared = _add_routing(choice, seq.routing, len(gen.prompts[p]), shared, prompt_routing)
                choices.append(choice)
        prompt_tokens = sum(len(p) for p in gen.prompts)
        # A JSONResponse skips FastAPI's jsonable_encoder walk over every token and log-prob.
        return JSONResponse({
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": engine.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "version": version,
            **({"prompt_routing": prompt_routing} if prompt_routing else {}),
        })

    @app.post("/generate/")
    async def trl_generate(body: TRLGenerateBody, request: Request):
        gen = trl_request(engine, body)
        engine.check(gen)
        if not state.admit():
            return busy()
        result = await state.run(request, _generate(gen), gen)
        if result is None:
            return error_response(499, "Client disconnected.", None, "ClientDisconnected")
        version, groups = result
        state.count("completed")
        seqs = [seq for group in groups for seq in group]
        with_lp = all(s.logprobs is not None for s in seqs)
        body = {
            "prompt_ids": gen.prompts,
            "completion_ids": [s.token_ids for s in seqs],
            "logprobs": [[[lp] for lp in s.logprobs] for s in seqs] if with_lp else None,
            "logprob_token_ids": [[[t] for t in s.token_ids] for s in seqs],
            "version": version,
        }
        if seqs and all(s.log_kept_mass is not None for s in seqs):  # posttrain's extension (truncated sampling)
            body["log_kept_mass"] = [s.log_kept_mass for s in seqs]
        if seqs and all(s.sampling_mask is not None for s in seqs):  # posttrain's extension (keep_sampling_mask)
            body["sampling_mask"] = [s.sampling_mask for s in seqs]
        return JSONResponse(body)

    @app.post("/get_sequence_logprobs/")
    async def get_sequence_logprobs(body: SequenceLogprobsBody, request: Request):
        """Teacher log-probs of given sequences (server distillation): ``logprobs`` / ``logprob_token_ids`` per
        completion token (top ``top_logprobs``, sorted) and ``actual_logprobs`` of the sequence's own tokens."""
        score = getattr(engine, "score_sequences", None)
        if score is None:
            raise RequestError("sequences", f"The {engine.name} engine cannot score sequences; serve with the posttrain backend.")

        def fn() -> tuple[int, dict]:
            return state.version, score(body.sequences, body.prompt_lengths, body.top_logprobs, body.temperature)

        if not state.admit():
            return busy()
        result = await state.run(request, fn)
        if result is None:
            return error_response(499, "Client disconnected.", None, "ClientDisconnected")
        version, scored = result
        state.count("completed")
        return JSONResponse({**scored, "version": version})

    @app.post("/v1/load_weights")
    async def load_weights(
        request: Request, update_id: str | None = None, last: bool = True, version: int | None = None,
        chunk: int | None = None, chunk_digest: str | None = None, update_digest: str | None = None,
    ):  # fmt: skip
        """Stage one chunk of a weight update and, on ``last``, apply the whole update at once (see
        ``WeightStaging``): every chunk is checked (digest, names, shapes, dtypes, finite values) before it is
        staged, and any failure discards the update and keeps the current weights serving."""
        from posttrain.generation import weights as W

        if update_id is None and not last:
            raise RequestError("update_id", "A chunked weight update (last=false) needs an update_id.")
        uid = update_id or f"_single-{uuid.uuid4().hex}"
        body = await request.body()
        if not body:
            raise RequestError("body", "The request body is empty; send a safetensors payload of named tensors.")
        done = state.weights.finished(uid, last, update_digest)
        if done is not None:
            return done
        digest = await run_in_threadpool(W.chunk_digest, body)
        if chunk_digest is not None and chunk_digest.lower() != digest:
            state.weights.abort(uid, "a chunk's digest did not match its bytes")
            raise RequestError(
                "chunk_digest",
                f"Chunk {chunk if chunk is not None else 0} of weight update {uid!r} is corrupted: its bytes hash to "
                f"{digest} but the client sent chunk_digest={chunk_digest}. The update is discarded and the previous "
                "weights keep serving; push it again.",
            )

        def parse() -> tuple[dict[str, Any], dict[str, Any] | None]:
            tensors = W.deserialize(body)
            adapter = W.payload_adapter_config(body)
            if adapter is not None:
                if not hasattr(engine, "load_adapter"):
                    raise W.WeightUpdateError(
                        f"This server runs the {engine.name!r} engine, which does not apply adapter-only (LoRA) "
                        "pushes; push the merged weights (vllm_sync_adapter_only=False) or serve with --engine "
                        "posttrain."
                    )
                W.check_tensors(tensors)  # dtypes and finite values; names/shapes against the adapter on apply
                return tensors, adapter
            specs = engine.weight_specs() if hasattr(engine, "weight_specs") else None
            W.check_tensors(tensors, specs)
            return tensors, None

        try:
            tensors, adapter_config = await run_in_threadpool(parse)
        except ValueError as err:  # WeightUpdateError and malformed payloads
            state.weights.abort(uid, str(err))
            raise RequestError("body", f"{err} Weight update {uid!r} is discarded; the previous weights keep serving.") from err
        # No await from here to the hand-over below: staging decisions see one consistent state.
        applying = state.weights.applying.get(uid)
        if applying is not None and last and digest == state.weights.last_digest(uid):
            return await asyncio.shield(applying)  # a repeat of a last chunk being applied: the same answer
        done = state.weights.finished(uid, last, update_digest)
        if done is not None:
            return done
        staged = state.weights.stage(uid, chunk, digest, tensors, adapter_config)
        if not last:
            return {"version": state.version, "staged": len(staged.tensors), "applied": False, "update_id": uid,
                    "chunk": staged.chunks - 1, "chunk_digest": digest}  # fmt: skip
        whole = W.update_digest(staged.digests)
        if update_digest is not None and update_digest.lower() != whole:
            state.weights.abort(uid, "the update digest did not match its chunks")
            raise RequestError(
                "update_digest",
                f"Weight update {uid!r} does not match its digest: its {staged.chunks} chunk(s) hash to {whole} but "
                f"the client sent update_digest={update_digest}. Nothing was applied; push it again.",
            )
        if not state.admit():  # staging kept: the client's retry of this last chunk counts as a repeat
            return busy()
        state.weights.take(uid)
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        state.weights.applying[uid] = answer

        def apply() -> dict[str, Any]:
            if staged.adapter_config is not None:
                count = engine.load_adapter(staged.adapter_config, staged.tensors)
            else:
                count = engine.load_weights(staged.tensors)
            previous = state.version
            state.version = version if version is not None else previous + 1
            state.count("weight_updates")
            return {"version": state.version, "previous_version": previous, "loaded": count, "applied": True,
                    "update_id": uid, "chunks": staged.chunks, "digest": whole,
                    "adapter_only": staged.adapter_config is not None}  # fmt: skip

        try:
            result = await state.run(None, apply)
        except BaseException as err:
            state.weights.settled(uid)
            if isinstance(err, ValueError):
                state.weights.abort(uid, str(err))
                err = RequestError("body", f"{err} Nothing was applied; the previous weights keep serving.")
            if isinstance(err, asyncio.CancelledError):
                answer.cancel()
            else:
                answer.set_exception(err)
                answer.exception()  # retrieved: a repeat of this chunk may never come to await it
            raise err
        state.weights.applied(uid, result)
        answer.set_result(result)
        return result

    @app.post("/reset_prefix_cache/")
    async def reset_prefix_cache():
        if not state.admit():
            return busy()

        def fn() -> None:
            engine.reset_prefix_cache()
            # TRL's client resets the prefix cache after broadcasting every parameter: that completes a push.
            if state.nccl_params_since_version:
                state.version += 1
                state.nccl_params_since_version = False
                state.count("weight_updates")

        await state.run(None, fn)
        return {"message": "Request received, resetting prefix cache", "version": state.version}

    async def _communicator(name: str, request: Request):
        method = getattr(engine, name, None)
        if method is None:
            raise RequestError(
                name,
                f"{name} (TRL's NCCL weight broadcast) needs the vLLM engine (--backend vllm) and a GPU; this "
                f"server runs the {engine.name!r} engine: push weights with POST /v1/load_weights (safetensors).",
            )
        payload = await request.json() if name != "close_communicator" else {}
        if not isinstance(payload, dict):
            raise RequestError("body", f"{name} takes a JSON object.")
        if not state.admit():
            return busy()

        def fn() -> None:
            method(**payload)
            if name == "update_named_param":
                state.nccl_params_since_version = True

        # Not awaited: the engine's side of a collective blocks until the trainer joins it, which the trainer
        # does only after this answer. The worker runs jobs in order, so later requests still wait for it.
        state.submit(fn)
        return {"message": f"{name} scheduled", "version": state.version}

    def _route(name: str) -> Callable:
        async def endpoint(request: Request):
            return await _communicator(name, request)

        return endpoint

    for _name in ("init_communicator", "update_named_param", "close_communicator"):
        app.post(f"/{_name}/")(_route(_name))

    from posttrain.serving.chat import add_chat_routes

    add_chat_routes(app, state, engine, busy=busy, error_response=error_response, temperature_floor=TEMPERATURE_FLOOR,
                    logprob_floor=LOGPROB_FLOOR)  # fmt: skip
    return app


# -- running --------------------------------------------------------------------------------------------------------
def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info", graceful_timeout: float = 30.0):
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout, lifespan="on"
    )


def run_server(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "info",
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
    graceful_timeout: float = 30.0,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
) -> None:
    """Serve ``engine`` until SIGTERM/SIGINT (uvicorn's graceful shutdown)."""
    import uvicorn

    app = create_app(
        engine, max_queue_size=max_queue_size, graceful_timeout=graceful_timeout, max_request_bytes=max_request_bytes
    )
    uvicorn.Server(uvicorn_config(app, host, port, log_level, graceful_timeout)).run()


class ServerInThread:
    """A generation server in a background thread, as :func:`serve_in_thread` returns it.

    Entering it starts the server and gives its base URL; leaving it stops the server. ``stop()`` takes the server
    away earlier, inside the block (tests of a trainer whose server disappears mid-run), and returns once its thread
    has ended; it is idempotent. The thread installs no signal handlers.
    """

    def __init__(
        self, engine: Any, host: str = "127.0.0.1", port: int = 0, *, max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        startup_timeout: float = 30.0, log_level: str = "warning", graceful_timeout: float = 10.0,
        max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:  # fmt: skip
        self.engine, self.host, self.port = engine, host, port
        self.max_request_bytes = max_request_bytes
        self.max_queue_size, self.startup_timeout = max_queue_size, startup_timeout
        self.log_level, self.graceful_timeout = log_level, graceful_timeout
        self.url: str | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> str:
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("This server was started already; call serve_in_thread(...) again for another one.")
        app = create_app(
            self.engine, max_queue_size=self.max_queue_size, graceful_timeout=self.graceful_timeout,
            max_request_bytes=self.max_request_bytes,
        )  # fmt: skip
        config = uvicorn_config(app, self.host, self.port, self.log_level, graceful_timeout=self.graceful_timeout)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # older uvicorn; newer ones skip it off the main thread
        thread = threading.Thread(target=server.run, name="posttrain-serve", daemon=True)
        self._server, self._thread = server, thread
        thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                self.stop(timeout=10)
                raise RuntimeError(f"The generation server did not start on {self.host}:{self.port}.")
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{bound}"
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        """Shut the server down gracefully (in-flight requests finish, up to ``graceful_timeout``) and wait up to
        ``timeout`` seconds for its thread."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=timeout)

    @property
    def running(self) -> bool:
        """Whether the server's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve_in_thread(
    engine: Any, host: str = "127.0.0.1", port: int = 0, *, max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
    startup_timeout: float = 30.0, log_level: str = "warning", graceful_timeout: float = 10.0,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
) -> ServerInThread:  # fmt: skip
    """Run the server in a background thread (tests, notebooks): ``with serve_in_thread(engine) as url:`` gives its
    base URL and always stops it.

    ``port=0`` picks a free port. Leaving the block shuts the server down gracefully and joins the thread; keep the
    returned :class:`ServerInThread` to stop it earlier (``server = serve_in_thread(engine)``, ``with server as url:``,
    ``server.stop()``).
    """
    return ServerInThread(
        engine, host, port, max_queue_size=max_queue_size, startup_timeout=startup_timeout, log_level=log_level,
        graceful_timeout=graceful_timeout, max_request_bytes=max_request_bytes,
    )  # fmt: skip
