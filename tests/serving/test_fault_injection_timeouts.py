"""Fault injection on the generation boundary: every wait on a stopped, killed, silent, busy or shutting-down server
ends in a named error or a retry within a bound the test asserts (issue 36, items 1 and 4).

Everything binds 127.0.0.1. The ``posttrain serve`` subprocess is SIGCONT'ed and killed in its fixture's ``finally``;
in-thread servers are stopped and their held engines released in ``finally``; spawned workers are checked gone.
Bounds carry generous margins for a loaded 2-core machine; the lower bounds show the error came from the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from posttrain.generation.base import SamplingConfig
from posttrain.generation.client import GenerationClient, ServerTimeoutError, ServerUnavailableError
from posttrain.generation.vllm_server import VLLMServerBackend
from posttrain.serving.app import serve_in_thread

EOS, PAD = 258, 259
PROMPTS = [list(b"hello there"), list(b"a")]
SAMPLING = SamplingConfig(4, temperature=0.9, top_k=50, eos_token_ids=[EOS], pad_token_id=PAD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(call):
    start = time.perf_counter()
    try:
        call()
    except Exception as err:  # the caller asserts on it
        return err, time.perf_counter() - start
    raise AssertionError("the call did not fail")


class _HeldEngine:
    """The real engine, except that ``generate`` waits (bounded) for ``release``: a server that is alive (answers
    ``/health``) but whose generations do not finish. ``close`` is a no-op: the real engine is shared."""

    def __init__(self, engine, release: threading.Event):
        self._engine, self._release = engine, release
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, request):
        self.entered.set()
        self._release.wait(120)
        return self._engine.generate(request)

    def close(self) -> None:
        pass


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# -- a real `posttrain serve`, stopped and killed -------------------------------------------------------------------
@pytest.fixture()
def serve_process(tiny_model_path, tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "posttrain.cli.main", "serve", "--model", tiny_model_path, "--host", "127.0.0.1",
           "--port", str(port), "--log_level", "warning"]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            GenerationClient(url).wait_until_ready(timeout=120, poll_interval=0.2)
        except ConnectionError:
            raise AssertionError((tmp_path / "serve.log").read_text()) from None
        yield url, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process must run to die cleanly
        proc.kill()
        proc.wait(30)
        log.close()


def test_stopped_then_killed_server_ends_grpo_generation_and_weight_push_with_named_errors(
    serve_process, tiny_model_path, tmp_path
):
    """SIGSTOP mid-run: GRPO server-mode generation and a weight push each fail after request_timeout (the config
    field) with an error naming the URL, the endpoint and the wait; the /health probe notices the stop within about
    two intervals even with a 600 s request_timeout; after SIGCONT it works again; after SIGKILL: 'not reachable'."""
    from transformers import AutoModelForCausalLM

    from posttrain.trainers.grpo import GRPOConfig

    url, proc = serve_process
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=url, request_timeout=2.0, vllm_server_health_check_interval=None,
                      per_device_train_batch_size=2, num_generations=2)  # fmt: skip
    backend = VLLMServerBackend(None, None, args)
    assert (backend.client.request_timeout, backend.client.health_check_interval) == (2.0, None)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert len(backend.generate(PROMPTS, SAMPLING, 2).completion_ids) == 4
    probed = GenerationClient(url, request_timeout=600, health_check_interval=0.5)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        for call, endpoint in [(lambda: backend.generate(PROMPTS, SAMPLING, 2), "POST /v1/completions"),
                               (lambda: backend.sync_weights(policy), "POST /v1/load_weights")]:  # fmt: skip
            err, elapsed = _timed(call)
            assert isinstance(err, ServerTimeoutError), repr(err)
            assert 1.9 <= elapsed < 15, elapsed
            message = str(err)
            assert url in message and endpoint in message and "request_timeout=2 s" in message, message
            assert re.search(r"waited \d+\.\d s", message) and "SIGSTOP" in message, message
        err, elapsed = _timed(lambda: probed.completions(PROMPTS, max_tokens=2))
        assert isinstance(err, ServerTimeoutError) and "stopped answering GET /health" in str(err), repr(err)
        assert 0.9 <= elapsed < 15, elapsed  # an interval before the first probe, then at most a probe's wait
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert len(backend.generate(PROMPTS, SAMPLING, 2).completion_ids) == 4  # resumed: it serves again
    backend.sync_weights(policy)
    proc.kill()
    proc.wait(30)
    err, elapsed = _timed(lambda: backend.generate(PROMPTS, SAMPLING, 2))
    assert isinstance(err, ServerUnavailableError) and "not reachable" in str(err) and url in str(err), repr(err)
    assert elapsed < 15, elapsed


def test_request_timeout_fields_reach_the_client_and_are_checked(server_url, tmp_path):
    from posttrain.trainers.grpo import GRPOConfig
    from posttrain.trainers.rloo import RLOOConfig

    common = dict(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_mode="server",
                  vllm_server_base_url=server_url, per_device_train_batch_size=2, num_generations=2)  # fmt: skip
    defaults = GRPOConfig(**common)
    assert (defaults.request_timeout, defaults.vllm_server_health_check_interval) == (600.0, 10.0)
    backend = VLLMServerBackend(None, None, RLOOConfig(**common, request_timeout=7, vllm_server_health_check_interval=3))
    assert (backend.client.request_timeout, backend.client.health_check_interval) == (7.0, 3.0)
    for name in ("request_timeout", "vllm_server_health_check_interval"):
        with pytest.raises(ValueError, match=name):
            GRPOConfig(**common, **{name: 0})


# -- busy, reset, silent and slow servers -------------------------------------------------------------------------
class _Scripted(BaseHTTPRequestHandler):
    """Answers each request with the next scripted action: an HTTP status (with Retry-After) or a dropped
    connection; 200 once the script is used up."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        script, seen = self.server.script, self.server.seen
        action = script.pop(0) if script else 200
        seen.append(action)
        if action == "reset":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        body = json.dumps({"status": "ok"} if action == 200 else {"error": {"message": "busy"}}).encode()
        self.send_response(action)
        if action != 200:
            self.send_header("Retry-After", self.server.retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def _scripted(script: list, retry_after: str = "0"):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.script, server.seen, server.retry_after = list(script), [], retry_after
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.parametrize("use_async", [False, True])
def test_busy_answers_and_reset_connections_are_retried_then_succeed(use_async):
    with _scripted([503, 429, "reset", 503]) as (url, server):
        client = GenerationClient(url, request_timeout=20, health_check_interval=None, retry_backoff=0.01)
        result = asyncio.run(client.ahealth()) if use_async else client.health()
        assert result == {"status": "ok"} and server.seen == [503, 429, "reset", 503, 200]


@pytest.mark.parametrize("use_async", [False, True])
def test_a_server_busy_past_the_deadline_is_a_timeout_naming_the_last_answer(use_async):
    with _scripted([503] * 1000, retry_after="0.2") as (url, server):
        client = GenerationClient(url, request_timeout=1.0, health_check_interval=None)
        call = (lambda: asyncio.run(client.ahealth())) if use_async else client.health
        err, elapsed = _timed(call)
        assert isinstance(err, ServerTimeoutError), repr(err)
        assert "GET /health" in str(err) and "last answered 503" in str(err) and url in str(err), str(err)
        assert 0.9 <= elapsed < 10 and len(server.seen) >= 3, (elapsed, server.seen)


@pytest.mark.parametrize("use_async", [False, True])
def test_a_silent_server_is_noticed_by_the_health_probe_long_before_request_timeout(use_async):
    """A server that accepts connections and never answers (what a SIGSTOPped process does): the /health probe
    ends the request within about two intervals although request_timeout is 600 s."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        client = GenerationClient(url, request_timeout=600, health_check_interval=0.3)
        call = (lambda: asyncio.run(client.acompletions(PROMPTS))) if use_async else lambda: client.completions(PROMPTS)
        err, elapsed = _timed(call)
        client.close()
    assert isinstance(err, ServerTimeoutError) and isinstance(err, TimeoutError), repr(err)
    message = str(err)
    assert "stopped answering GET /health" in message and "POST /v1/completions" in message and url in message
    assert 0.5 <= elapsed < 10, elapsed


def test_waiting_for_a_silent_server_at_start_up_is_bounded_by_vllm_server_timeout():
    """Each /health poll of wait_until_ready is bounded too: a server that accepts but never answers is reported
    after the start-up timeout, not after request_timeout (600 s) per poll."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        client = GenerationClient(f"http://127.0.0.1:{silent.getsockname()[1]}", health_check_interval=None)
        err, elapsed = _timed(lambda: client.wait_until_ready(timeout=1.0, poll_interval=0.1))
        client.close()
    assert isinstance(err, ServerUnavailableError) and "did not become ready within 1 s" in str(err), repr(err)
    assert 0.9 <= elapsed < 10, elapsed


def test_a_slow_but_alive_server_passes_the_probe_and_is_bounded_by_request_timeout(engine):
    """The engine holds the generation (the server still answers /health): the probe does not cut the request
    short, request_timeout does."""
    release = threading.Event()
    held = _HeldEngine(engine, release)
    try:
        with serve_in_thread(held, graceful_timeout=1) as url:
            client = GenerationClient(url, request_timeout=2.0, health_check_interval=0.2)
            err, elapsed = _timed(lambda: client.completions(PROMPTS, max_tokens=2))
            release.set()
            client.close()
    finally:
        release.set()
    assert isinstance(err, ServerTimeoutError) and "stopped answering" not in str(err), repr(err)
    assert "POST /v1/completions" in str(err) and "request_timeout=2 s" in str(err), str(err)
    assert 1.9 <= elapsed < 10, elapsed


# -- shutdown under load ------------------------------------------------------------------------------------------
def test_shutdown_under_load_answers_503_with_retry_after_and_the_client_retries_on_the_next_server(engine):
    """Past graceful_timeout, the running and the queued requests get 503 + Retry-After (not uvicorn's bare 500);
    a GenerationClient among them retries and is served by the server that took over the port."""
    release = threading.Event()
    held = _HeldEngine(engine, release)
    first = serve_in_thread(held, graceful_timeout=2.0)
    raw: list[httpx.Response] = []
    served: list = []
    threads: list[threading.Thread] = []
    try:
        with first as url:
            port = int(url.rsplit(":", 1)[1])

            def post() -> None:
                raw.append(httpx.post(f"{url}/v1/completions", json={"prompt": [[1, 2, 3]], "max_tokens": 2},
                                      timeout=60))  # fmt: skip

            def generate() -> None:
                client = GenerationClient(url, request_timeout=60, health_check_interval=None)
                served.append(client.completions([[1, 2, 3]], max_tokens=2, seed=1))
                client.close()

            threads = [threading.Thread(target=post) for _ in range(5)] + [threading.Thread(target=generate)]
            for thread in threads:
                thread.start()
            health = GenerationClient(url, health_check_interval=None)
            _wait_for(lambda: held.entered.is_set() and health.health()["pending"] == 6, 30, "6 admitted requests")
            health.close()
            first._server.should_exit = True  # SIGTERM's graceful shutdown: the listener closes first

            def refused() -> bool:
                with socket.socket() as s:
                    return s.connect_ex(("127.0.0.1", port)) != 0

            _wait_for(refused, 10, "the first server to close its listener")
            with serve_in_thread(engine, port=port, graceful_timeout=2.0):  # takes over the port
                for thread in threads:
                    thread.join(60)
            release.set()
    finally:
        release.set()
        for thread in threads:
            thread.join(10)
    assert len(raw) == 5 and len(served) == 1, (raw, served)
    for resp in raw:
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1", (resp.status_code, resp.text)
        assert "shutting down" in resp.json()["error"]["message"]
    assert len(served[0].choices[0][0].token_ids) >= 1


# -- AsyncGRPO with a stalled server ------------------------------------------------------------------------------
def test_async_grpo_heartbeat_is_on_by_default_and_checked(tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    common = dict(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2, num_generations=2)
    assert AsyncGRPOConfig(**common).heartbeat_stale_after_s == 300.0
    with pytest.raises(ValueError, match="heartbeat_stale_after_s"):
        AsyncGRPOConfig(**common, heartbeat_stale_after_s=0)


@pytest.mark.slow
def test_async_grpo_with_a_stalled_server_raises_within_the_heartbeat_bound(tiny_model_path, engine, tmp_path):
    """The server takes weight pushes and answers /health but its generations never finish: the rollout worker
    stops beating, and train() raises RolloutWorkerError naming heartbeat_stale_after_s within the bound (spawn and
    imports are allowed vllm_server_timeout more); the worker process is terminated."""
    from datasets import Dataset
    from reward_helpers import varied_reward

    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, RolloutWorkerError

    release = threading.Event()
    held = _HeldEngine(engine, release)
    try:
        with serve_in_thread(held, graceful_timeout=1) as url:
            args = AsyncGRPOConfig(
                output_dir=str(tmp_path), report_to="none", save_strategy="no", max_steps=2, disable_tqdm=True,
                per_device_train_batch_size=2, num_generations=2, max_completion_length=4, write_report=False,
                gradient_checkpointing=False, vllm_server_base_url=url, heartbeat_stale_after_s=3,
                vllm_server_timeout=60,
            )  # fmt: skip
            dataset = Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(4)])
            trainer = AsyncGRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=dataset)
            err, elapsed = _timed(trainer.train)
            release.set()
    finally:
        release.set()
    assert isinstance(err, RolloutWorkerError) and "heartbeat_stale_after_s=3" in str(err), repr(err)
    assert held.entered.is_set() and elapsed < 3 + 60 + 30, elapsed
    assert trainer.async_rollout.worker is None and not multiprocessing.active_children()
