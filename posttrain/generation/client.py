"""``GenerationClient``: an httpx client for ``posttrain serve`` (and the OpenAI-style ``/v1/completions`` of vLLM).

It has a synchronous and an asynchronous method for each call (``completions`` / ``acompletions``, ``health`` /
``ahealth``, ...) so a trainer and an async rollout worker share one implementation of the wire format; every
result carries the weight ``version`` the server generated with. Failures are typed:

- ``ServerUnavailableError`` (a ``ConnectionError``): the server cannot be reached, or went away mid-request, after
  ``max_retries`` quick retries; the message names the URL and says how to start a server;
- ``ServerTimeoutError`` (a ``ServerUnavailableError`` and a ``TimeoutError``): no answer within ``request_timeout``,
  or the server stopped answering its ``/health`` probe while a request was in flight; the message names the URL,
  the request, how long it waited and what to check;
- ``ServerRequestError`` (a ``ValueError``): a 4xx; the message is the server's, naming the bad field;
- ``ServerError`` (a ``RuntimeError``): any other non-200 answer;
- ``WeightSyncError`` (a ``RuntimeError``): a weight push the server's answer does not confirm (digest, version).

Every wait is bounded. ``request_timeout`` (default 600 s) is the budget of one call, retries included: a busy server
(429/503, e.g. one shutting down) is retried after its ``Retry-After`` (at most 5 s apart, for up to ``busy_timeout``
seconds) and a reset or refused connection up to ``max_retries`` times with exponential backoff, all inside it. Once
a request has been in flight for ``health_check_interval`` seconds (default 10), the client probes ``GET /health``
on a separate connection every ``health_check_interval`` seconds, each probe waiting at most that long: a server
that is stopped (SIGSTOP), frozen or cut off is reported within about two intervals instead of at the end of
``request_timeout``, while a server that is alive but slow (a long generation) answers its probe and is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx


class ServerUnavailableError(ConnectionError):
    """The generation server cannot be reached (not started, stopped, or crashed)."""


class ServerTimeoutError(ServerUnavailableError, TimeoutError):
    """The server did not answer a request in time, or stopped answering ``/health`` while it was in flight."""


DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_HEALTH_CHECK_INTERVAL = 10.0
_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class ServerRequestError(ValueError):
    """The server rejected the request (4xx); ``param`` is the field it named."""

    def __init__(self, message: str, status: int, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


class ServerError(RuntimeError):
    """The server answered with an unexpected status."""


class WeightSyncError(RuntimeError):
    """The server's answer to a weight push does not confirm the update that was sent (digest, version or id
    differ), or the post-sync probe found the server's log-probs unlike the trainer's: its weights are not ours."""


@dataclass
class Choice:
    """One completion: ids (stop token kept), sampling log-probs (or None), ``"stop"`` / ``"length"``."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    # posttrain servers under top-k / top-p / min-p: log of the kept mass per token (``Completions.log_kept_mass``)
    log_kept_mass: list[float] | None = None
    # posttrain servers asked ``return_sampling_mask``: the kept support per token (``Completions.sampling_mask``)
    sampling_mask: list[Any] | None = None
    # posttrain servers asked ``return_routing`` (keep_routing): the MoE routing of the completion tokens and of the
    # prompt, in the wire form ``{"dtype", "shape", "data"}`` (``posttrain.models.moe_routing.routing_from_wire``)
    routing: dict[str, Any] | None = None
    prompt_routing: dict[str, Any] | None = None


@dataclass
class CompletionResult:
    """``choices[p][j]`` is completion ``j`` of prompt ``p``; ``version`` is the server's weight version."""

    choices: list[list[Choice]]
    version: int | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def completion_payload(
    prompts: list[list[int]],
    *,
    n: int = 1,
    max_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    stop_token_ids: list[int] | None = None,
    logprobs: bool = True,
    seed: int | None = None,
    model: str | None = None,
    extra: dict[str, Any] | None = None,
    images: list[list[Any] | None] | None = None,
) -> dict[str, Any]:
    """The ``/v1/completions`` JSON body (vLLM field names; ``extra`` is merged last). ``images`` (per prompt, a
    list of images or None) turns the prompts into vLLM's multimodal token prompts, ``{"prompt_token_ids",
    "multi_modal_data": {"image": [data URL, ...]}}`` (``posttrain.generation.images``)."""
    if images is not None and any(images):
        from posttrain.generation.images import multimodal_prompt

        if len(images) != len(prompts):
            raise ValueError(f"images has {len(images)} entries for {len(prompts)} prompts; give one per prompt.")
        prompt: list[Any] = [multimodal_prompt(p, imgs) for p, imgs in zip(prompts, images)]
    else:
        prompt = [list(map(int, p)) for p in prompts]
    payload: dict[str, Any] = {
        "prompt": prompt,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "logprobs": 0 if logprobs else None,
        "return_token_ids": True,
    }
    if stop_token_ids:
        payload["stop_token_ids"] = list(stop_token_ids)
    if seed is not None:
        payload["seed"] = int(seed)
    if model is not None:
        payload["model"] = model
    payload.update(extra or {})
    return payload


def parse_completions(data: dict[str, Any], num_prompts: int, n: int) -> CompletionResult:
    """Group the response's choices by prompt (``index = prompt * n + j``); a choice's ``prompt_routing`` is its own
    or else its prompt's entry of the response's ``prompt_routing`` (keep_routing)."""
    shared_routing = data.get("prompt_routing") or []
    groups: list[list[Choice | None]] = [[None] * n for _ in range(num_prompts)]
    for c in data.get("choices", []):
        idx = int(c["index"])
        lp = c.get("logprobs")
        token_lps = None if not lp else lp.get("token_logprobs")
        ids = c.get("token_ids")
        if ids is None:
            raise ServerError(
                "The server's completion has no token_ids; a vLLM server must get return_token_ids=true "
                "(vLLM >= 0.10.2)."
            )
        kept = None if not lp else lp.get("log_kept_mass")
        support = None if not lp else lp.get("sampling_mask")
        groups[idx // n][idx % n] = Choice(
            list(ids),
            None if token_lps is None else list(token_lps),
            c["finish_reason"],
            None if kept is None else list(kept),
            None if support is None else list(support),
            c.get("routing"),
            c.get("prompt_routing") or (shared_routing[idx // n] if idx // n < len(shared_routing) else None),
        )
    missing = [(p, j) for p, g in enumerate(groups) for j, c in enumerate(g) if c is None]
    if missing:
        raise ServerError(f"The server returned no completion for (prompt, sample) {missing[:5]}.")
    return CompletionResult(groups, data.get("version"), data)  # type: ignore[arg-type]


def _error_from(resp: httpx.Response) -> Exception:
    try:
        body = resp.json()
        err = body.get("error", body) if isinstance(body, dict) else {}
        message = err.get("message") or err.get("detail") or resp.text
        param = err.get("param")
    except ValueError:
        message, param = resp.text, None
    if 400 <= resp.status_code < 500:
        return ServerRequestError(f"The generation server rejected the request ({resp.status_code}): {message}",
                                  resp.status_code, param)  # fmt: skip
    return ServerError(f"The generation server answered {resp.status_code}: {message}")


class GenerationClient:
    """Client for a generation server at ``base_url`` (see the module docstring).

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        request_timeout: Seconds one call (a generation, one weight-push request) may take, retries included; on
            expiry ``ServerTimeoutError``. ``None`` = no limit (then only the health probe ends a hung request).
        connect_timeout: Seconds to establish a connection.
        max_retries: Quick retries (with ``retry_backoff`` × 2^k sleeps) when the connection fails mid-run.
        retry_backoff: First retry delay, in seconds.
        busy_timeout: How long to keep retrying 429/503 answers (inside ``request_timeout``).
        health_check_interval: Once a request has been in flight this many seconds, probe ``/health`` every this
            many seconds (each probe waits at most this long); a probe without answer ends the request with
            ``ServerTimeoutError``. ``None`` = no probe.
        timeout_hint: The setting that timeout errors tell the user to raise (e.g. a trainer config's field).
    """

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        connect_timeout: float = 5.0,
        max_retries: int = 3,
        retry_backoff: float = 0.25,
        busy_timeout: float = 600.0,
        health_check_interval: float | None = DEFAULT_HEALTH_CHECK_INTERVAL,
        timeout_hint: str = "request_timeout",
    ):
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds (or None), got {request_timeout}.")
        if health_check_interval is not None and not health_check_interval > 0:
            raise ValueError(f"health_check_interval must be > 0 seconds (or None), got {health_check_interval}.")
        self.base_url = base_url.rstrip("/")
        self.request_timeout = None if request_timeout is None else float(request_timeout)
        self.connect_timeout = float(connect_timeout)
        self.timeout = httpx.Timeout(request_timeout, connect=connect_timeout)
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.busy_timeout = busy_timeout
        self.health_check_interval = None if health_check_interval is None else float(health_check_interval)
        self.timeout_hint = timeout_hint
        self._client: httpx.Client | None = None
        self._aclient: httpx.AsyncClient | None = None
        self._probe_client: httpx.Client | None = None
        self._aprobe_client: httpx.AsyncClient | None = None

    # -- plumbing -----------------------------------------------------------------------------------------------
    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.base_url, timeout=self.timeout, follow_redirects=True)
        return self._client

    @property
    def aclient(self) -> httpx.AsyncClient:
        if self._aclient is None:
            self._aclient = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, follow_redirects=True)
        return self._aclient

    def _unavailable(self, path: str, err: Exception) -> ServerUnavailableError:
        return ServerUnavailableError(
            f"The generation server at {self.base_url} is not reachable ({path}: {type(err).__name__}: {err}). "
            "It may not have started yet or may have stopped; start one with `posttrain serve --model MODEL "
            "--port PORT` (or `vllm serve`) and check vllm_server_base_url / vllm_server_host / vllm_server_port."
        )

    def _timed_out(self, method: str, path: str, start: float, why: str) -> ServerTimeoutError:
        limit = "none" if self.request_timeout is None else f"{self.request_timeout:g} s"
        return ServerTimeoutError(
            f"The generation server at {self.base_url} did not answer {method} {path} in time: {why} (waited "
            f"{time.monotonic() - start:.1f} s; {self.timeout_hint}={limit}). Check that the server process is "
            "running and not stopped (SIGSTOP: `kill -CONT <pid>`), stuck or overloaded (its log, GET "
            f"{self.base_url}/health) and that the network path to it is up; raise {self.timeout_hint} if a "
            "generation or weight push legitimately takes longer."
        )

    def _delay(self, attempt: int, resp: httpx.Response | None = None) -> float:
        if resp is not None and resp.headers.get("Retry-After", "").replace(".", "", 1).isdigit():
            return float(resp.headers["Retry-After"])
        return self.retry_backoff * (2**attempt)

    def _start(self) -> tuple[float, float | None]:
        """``(start, deadline)`` of a call (monotonic seconds; no deadline without ``request_timeout``)."""
        start = time.monotonic()
        return start, None if self.request_timeout is None else start + self.request_timeout

    def _left(self, method: str, path: str, start: float, deadline: float | None, last: str) -> float | None:
        """Seconds left before ``deadline`` (None: no limit); raise ``ServerTimeoutError`` when none are."""
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._timed_out(method, path, start, f"no answer within {self.timeout_hint}{last}")
        return left

    def _attempt_timeout(self, left: float | None) -> httpx.Timeout:
        return httpx.Timeout(left, connect=self.connect_timeout if left is None else min(self.connect_timeout, left))

    def _probe_wait(self, deadline: float | None) -> float:
        """How long to wait for the request before (the next) health probe."""
        interval = float(self.health_check_interval or 0.0)
        return interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic()))

    def _stopped(self, method: str, path: str, start: float, err: Exception) -> ServerTimeoutError:
        return self._timed_out(
            method, path, start,
            f"the server stopped answering GET /health while the request was in flight (probe every "
            f"{self.health_check_interval:g} s: {type(err).__name__}: {err})",
        )  # fmt: skip

    def _send(self, method: str, path: str, start: float, deadline: float | None, last: str, kwargs: dict) -> Any:
        """One attempt, bounded by the deadline and, with ``health_check_interval``, watched by the health probe
        (the attempt runs on a daemon thread that ends by its own timeout when abandoned)."""
        timeout = self._attempt_timeout(self._left(method, path, start, deadline, last))
        if self.health_check_interval is None:
            return self.client.request(method, path, timeout=timeout, **kwargs)
        outcome: list[tuple[bool, Any]] = []
        done = threading.Event()

        def attempt() -> None:
            try:
                outcome.append((True, self.client.request(method, path, timeout=timeout, **kwargs)))
            except BaseException as err:  # re-raised in the caller's thread
                outcome.append((False, err))
            finally:
                done.set()

        threading.Thread(target=attempt, name="posttrain-http-request", daemon=True).start()
        while not done.wait(self._probe_wait(deadline)):
            self._left(method, path, start, deadline, last)
            if self._probe_client is None:
                self._probe_client = httpx.Client(base_url=self.base_url)
            try:
                self._probe_client.get("/health", timeout=self.health_check_interval)
            except httpx.HTTPError as err:
                if not done.is_set():
                    raise self._stopped(method, path, start, err) from err
        ok, value = outcome[0]
        if ok:
            return value
        raise value

    async def _asend(
        self, method: str, path: str, start: float, deadline: float | None, last: str, kwargs: dict
    ) -> Any:
        timeout = self._attempt_timeout(self._left(method, path, start, deadline, last))
        if self.health_check_interval is None:
            return await self.aclient.request(method, path, timeout=timeout, **kwargs)
        task = asyncio.ensure_future(self.aclient.request(method, path, timeout=timeout, **kwargs))
        try:
            while True:
                finished, _ = await asyncio.wait({task}, timeout=self._probe_wait(deadline))
                if finished:
                    return task.result()
                self._left(method, path, start, deadline, last)
                if self._aprobe_client is None:
                    self._aprobe_client = httpx.AsyncClient(base_url=self.base_url)
                try:
                    await self._aprobe_client.get("/health", timeout=self.health_check_interval)
                except httpx.HTTPError as err:
                    if not task.done():
                        raise self._stopped(method, path, start, err) from err
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send with bounded retries inside ``request_timeout``; returns a 200 response or raises a typed error."""
        start, deadline = self._start()
        attempt, busy_until, last = 0, start + self.busy_timeout, ""
        while True:
            try:
                resp = self._send(method, path, start, deadline, last, kwargs)
            except _RETRYABLE as err:
                if attempt >= self.max_retries:
                    raise self._unavailable(path, err) from err
                last = f"; last error: {type(err).__name__}: {err}"
                left = self._left(method, path, start, deadline, last)
                time.sleep(self._delay(attempt) if left is None else min(self._delay(attempt), left))
                attempt += 1
                continue
            except httpx.TimeoutException as err:
                raise self._timed_out(method, path, start, f"{type(err).__name__}: {err}{last}") from err
            if resp.status_code in (429, 503) and time.monotonic() < busy_until:
                last = f"; the server last answered {resp.status_code} (busy or shutting down)"
                left = self._left(method, path, start, deadline, last)
                pause = min(self._delay(0, resp), 5.0)
                time.sleep(pause if left is None else min(pause, left))
                continue
            if resp.status_code != 200:
                raise _error_from(resp)
            return resp

    async def arequest(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """``request`` for asyncio code (same deadline, probe, retries and errors)."""
        start, deadline = self._start()
        attempt, busy_until, last = 0, start + self.busy_timeout, ""
        while True:
            try:
                resp = await self._asend(method, path, start, deadline, last, kwargs)
            except _RETRYABLE as err:
                if attempt >= self.max_retries:
                    raise self._unavailable(path, err) from err
                last = f"; last error: {type(err).__name__}: {err}"
                left = self._left(method, path, start, deadline, last)
                await asyncio.sleep(self._delay(attempt) if left is None else min(self._delay(attempt), left))
                attempt += 1
                continue
            except httpx.TimeoutException as err:
                raise self._timed_out(method, path, start, f"{type(err).__name__}: {err}{last}") from err
            if resp.status_code in (429, 503) and time.monotonic() < busy_until:
                last = f"; the server last answered {resp.status_code} (busy or shutting down)"
                left = self._left(method, path, start, deadline, last)
                pause = min(self._delay(0, resp), 5.0)
                await asyncio.sleep(pause if left is None else min(pause, left))
                continue
            if resp.status_code != 200:
                raise _error_from(resp)
            return resp

    # -- API ----------------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        resp = self.request("GET", "/health")
        return resp.json() if resp.content else {}

    async def ahealth(self) -> dict[str, Any]:
        resp = await self.arequest("GET", "/health")
        return resp.json() if resp.content else {}

    def wait_until_ready(self, timeout: float = 240.0, poll_interval: float = 0.5) -> dict[str, Any]:
        """Poll ``/health`` until it answers 200 (or raise ``ServerUnavailableError`` after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while True:
            try:  # each poll is bounded too: a stopped server accepts connections but never answers
                poll = httpx.Timeout(max(0.1, min(10.0, deadline - time.monotonic())))
                resp = self.client.get("/health", timeout=poll)
                if resp.status_code == 200:
                    return resp.json() if resp.content else {}
                last = ServerError(f"/health answered {resp.status_code}")
            except httpx.HTTPError as err:
                last = err
            if time.monotonic() >= deadline:
                raise ServerUnavailableError(
                    f"The generation server at {self.base_url} did not become ready within {timeout:g} s "
                    f"(last error: {last}). Start it with `posttrain serve --model MODEL --port PORT`, or raise "
                    "vllm_server_timeout if the model takes longer to load."
                )
            time.sleep(poll_interval)

    def completions(self, prompts: list[list[int]], **sampling: Any) -> CompletionResult:
        """``POST /v1/completions``; ``sampling`` are ``completion_payload``'s keyword arguments."""
        payload = completion_payload(prompts, **sampling)
        resp = self.request("POST", "/v1/completions", json=payload)
        return parse_completions(resp.json(), len(prompts), payload["n"])

    async def acompletions(self, prompts: list[list[int]], **sampling: Any) -> CompletionResult:
        payload = completion_payload(prompts, **sampling)
        resp = await self.arequest("POST", "/v1/completions", json=payload)
        return parse_completions(resp.json(), len(prompts), payload["n"])

    def get_sequence_logprobs(
        self, sequences: list[list[int]], prompt_lengths: list[int], top_logprobs: int = 1, temperature: float = 1.0
    ) -> dict[str, Any]:
        """``POST /get_sequence_logprobs/`` (TRL's teacher-server call): per completion token of each sequence, the
        top-``top_logprobs`` ``logprobs`` / ``logprob_token_ids`` and the ``actual_logprobs`` of its own token,
        plus the server's weight ``version``."""
        payload = {
            "sequences": [list(map(int, s)) for s in sequences],
            "prompt_lengths": [int(p) for p in prompt_lengths],
            "top_logprobs": int(top_logprobs),
            "temperature": float(temperature),
        }
        return self.request("POST", "/get_sequence_logprobs/", json=payload).json()

    async def aget_sequence_logprobs(
        self, sequences: list[list[int]], prompt_lengths: list[int], top_logprobs: int = 1, temperature: float = 1.0
    ) -> dict[str, Any]:
        payload = {
            "sequences": [list(map(int, s)) for s in sequences],
            "prompt_lengths": [int(p) for p in prompt_lengths],
            "top_logprobs": int(top_logprobs),
            "temperature": float(temperature),
        }
        resp = await self.arequest("POST", "/get_sequence_logprobs/", json=payload)
        return resp.json()

    @staticmethod
    def _with_last(chunks: Iterable[bytes]) -> Iterable[tuple[bytes, bool]]:
        """``(chunk, is_last)`` with one chunk of look-ahead, so chunks stream without being held all at once."""
        it = iter(chunks)
        try:
            current = next(it)
        except StopIteration:
            raise ValueError("load_weights needs at least one safetensors chunk.") from None
        for nxt in it:
            yield current, False
            current = nxt
        yield current, True

    @staticmethod
    def _weight_params(
        update_id: str, last: bool, version: int | None, chunk: int, digest: str, whole: str | None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"update_id": update_id, "last": str(last).lower(), "chunk": chunk,
                                  "chunk_digest": digest}  # fmt: skip
        if whole is not None:
            params["update_digest"] = whole
        if version is not None:
            params["version"] = int(version)
        return params

    def _check_weight_answer(
        self, answer: dict[str, Any], update_id: str, chunk: int, digest: str, whole: str | None, version: int | None
    ) -> None:
        """Raise ``WeightSyncError`` unless the server's answer confirms this chunk (and, on the last, the update)."""

        def wrong(what: str) -> WeightSyncError:
            return WeightSyncError(
                f"The generation server at {self.base_url} did not confirm weight update {update_id!r} "
                f"(chunk {chunk}): {what}. Its weights may not be the trainer's; check that it is a posttrain "
                f"server of this version and that nothing between trainer and server alters the request."
            )

        if answer.get("update_id") != update_id:
            raise wrong(f"it answered for update {answer.get('update_id')!r}")
        if whole is None:
            if answer.get("chunk_digest") != digest or answer.get("chunk") != chunk or answer.get("applied"):
                raise wrong(f"it echoed chunk {answer.get('chunk')} with digest {answer.get('chunk_digest')}, "
                            f"sent {digest}")  # fmt: skip
            return
        if answer.get("applied") is not True or answer.get("digest") != whole:
            raise wrong(f"it reports applied={answer.get('applied')} with digest {answer.get('digest')}, sent {whole}")
        new, previous = answer.get("version"), answer.get("previous_version")
        expected = int(version) if version is not None else (None if previous is None else int(previous) + 1)
        if not isinstance(new, int) or new != expected:
            raise wrong(f"it reports weight version {new!r}, expected {expected!r}")

    def _weight_requests(self, chunks: Iterable[bytes], version: int | None) -> Iterable[tuple[bytes, dict, tuple]]:
        """``(body, query params, check arguments)`` per chunk of one update (digests computed as chunks stream)."""
        from posttrain.generation.weights import chunk_digest, update_digest

        update_id, digests = uuid.uuid4().hex, []
        for index, (chunk, last) in enumerate(self._with_last(chunks)):
            digests.append(chunk_digest(chunk))
            whole = update_digest(digests) if last else None
            params = self._weight_params(update_id, last, version, index, digests[-1], whole)
            yield chunk, params, (update_id, index, digests[-1], whole, version)

    def load_weights(self, chunks: Iterable[bytes], version: int | None = None) -> int:
        """Push safetensors payloads (``weights.serialize_chunks``) as one update; returns the new version.

        Each chunk carries the update's id, its index and its SHA-256; the last also the digest of the whole update.
        The server checks them (and names, shapes, dtypes, finite values) and applies the update at once when the
        last chunk arrives, or refuses it (``ServerRequestError``) and keeps its weights. Its answers must echo the
        digests and the new version (``version``, default: its previous version + 1), else ``WeightSyncError``.
        """
        result: dict[str, Any] = {}
        for body, params, check in self._weight_requests(chunks, version):
            resp = self.request(
                "POST", "/v1/load_weights", content=body, params=params,
                headers={"Content-Type": "application/octet-stream"},
            )  # fmt: skip
            result = resp.json()
            self._check_weight_answer(result, *check)
        return int(result["version"])

    async def aload_weights(self, chunks: Iterable[bytes], version: int | None = None) -> int:
        """``load_weights`` for asyncio code (same checks and errors)."""
        result: dict[str, Any] = {}
        for body, params, check in self._weight_requests(chunks, version):
            resp = await self.arequest(
                "POST", "/v1/load_weights", content=body, params=params,
                headers={"Content-Type": "application/octet-stream"},
            )  # fmt: skip
            result = resp.json()
            self._check_weight_answer(result, *check)
        return int(result["version"])

    def close(self) -> None:
        for name in ("_client", "_probe_client"):
            client = getattr(self, name)
            if client is not None:
                client.close()
                setattr(self, name, None)

    async def aclose(self) -> None:
        for name in ("_aclient", "_aprobe_client"):
            client = getattr(self, name)
            if client is not None:
                await client.aclose()
                setattr(self, name, None)

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:  # picklable for a spawned rollout worker: no live connections
        return {**self.__dict__, "_client": None, "_aclient": None, "_probe_client": None, "_aprobe_client": None}
