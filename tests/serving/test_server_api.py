"""``posttrain serve`` over loopback: valid and invalid requests, seeded sampling equal to in-process sampling,
bitwise weight pushes, backpressure, client disconnects, graceful SIGTERM shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.generation.base import SamplingConfig
from posttrain.generation.client import GenerationClient, ServerRequestError
from posttrain.generation.group_sampler import GroupSampler
from posttrain.generation.weights import serialize_chunks
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import GeneratedSequence

EOS, PAD = 258, 259
PROMPTS = [list(b"hello there"), list(b"a"), list(b"the quick brown fox")]


def _in_process(model, prompts, n, seed, max_tokens=6, **sampling):
    s = SamplingConfig(max_tokens, eos_token_ids=[EOS], pad_token_id=PAD, **sampling)
    return GroupSampler(model, generator=torch.Generator().manual_seed(seed)).generate(prompts, s, n)


def test_completions_shape_and_fields(client, server_url):
    result = client.completions(PROMPTS, n=3, max_tokens=5, seed=1)
    assert result.version == 0 and len(result.choices) == 3 and all(len(g) == 3 for g in result.choices)
    for group in result.choices:
        for c in group:
            assert 1 <= len(c.token_ids) <= 5 and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason in ("stop", "length") and all(lp <= 0 for lp in c.logprobs)
    raw = result.raw
    assert raw["object"] == "text_completion" and raw["model"] == "tiny"
    assert [c["index"] for c in raw["choices"]] == list(range(9))
    assert raw["choices"][4]["prompt_token_ids"] == PROMPTS[1]
    assert raw["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in raw["choices"])
    # text prompts are tokenized by the server; logprobs=null returns none; health/models/world size answer
    text = httpx.post(f"{server_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
    assert text["choices"][0]["prompt_token_ids"] == list(b"hi") and text["choices"][0]["logprobs"] is None
    health = httpx.get(f"{server_url}/health").json()
    assert health["status"] == "ok" and health["server"] == "posttrain" and health["version"] == 0
    assert httpx.get(f"{server_url}/health/").status_code == 200
    assert httpx.get(f"{server_url}/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{server_url}/get_world_size/").json() == {"world_size": 1}


def test_seeded_request_equals_in_process_group_sampler(client, engine):
    """Same seed and weights: the server's tokens and log-probs are exactly the in-process sampler's."""
    for sampling in ({}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.01, "repetition_penalty": 1.3}):
        local = _in_process(engine.model, PROMPTS, 4, seed=123, **sampling)
        remote = client.completions(PROMPTS, n=4, max_tokens=6, seed=123, stop_token_ids=[EOS], **sampling)
        flat = [c for g in remote.choices for c in g]
        assert [c.token_ids for c in flat] == local.completion_ids
        assert [c.logprobs for c in flat] == local.logprobs
        assert [c.finish_reason == "stop" for c in flat] == local.finished
    again = client.completions(PROMPTS, n=4, max_tokens=6, seed=123)
    other = client.completions(PROMPTS, n=4, max_tokens=6, seed=124)
    assert again.choices != other.choices
    greedy = client.completions(PROMPTS[:1], n=2, max_tokens=6, temperature=0)
    assert greedy.choices[0][0].token_ids == greedy.choices[0][1].token_ids


def test_stop_token_ids(client):
    first = client.completions(PROMPTS[:1], n=1, max_tokens=8, seed=3).choices[0][0].token_ids
    k = next(i for i in range(1, len(first)) if first[i] not in first[:i])
    stopped = client.completions(PROMPTS[:1], n=1, max_tokens=8, seed=3, stop_token_ids=[first[k]])
    choice = stopped.choices[0][0]
    assert choice.token_ids == first[: k + 1] and choice.finish_reason == "stop"
    assert stopped.raw["choices"][0]["stop_reason"] == first[k]


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"prompt": [1, 2], "temperature": -1}, "temperature"),
        ({"prompt": [1, 2], "top_p": 0}, "top_p"),
        ({"prompt": [1, 2], "n": 0}, "n"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "bogus_field": 1}, "bogus_field"),
        ({"prompt": [1, 2], "logprobs": 21}, "logprobs"),
        ({"prompt": [1, 2], "stream": True}, "stream"),
        ({"prompt": [1, 2], "model": "other"}, "model"),
        ({"prompt": [1, 2], "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [1, 10**6]}, "prompt"),
        ({"prompt": "x" * 10, "max_tokens": 10**6}, "max_tokens"),
        ({"n": 2}, "prompt"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server_url, payload, param):
    resp = httpx.post(f"{server_url}/v1/completions", json=payload)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_bad_bodies(server_url):
    assert httpx.post(f"{server_url}/v1/completions", content=b"{not json").status_code == 400
    resp = httpx.post(f"{server_url}/v1/load_weights", content=b"garbage")
    assert resp.status_code == 400 and "safetensors" in resp.json()["error"]["message"]
    resp = httpx.post(f"{server_url}/init_communicator/", json={})
    assert resp.status_code == 400 and "/v1/load_weights" in resp.json()["error"]["message"]
    with GenerationClient(server_url) as c, pytest.raises(ServerRequestError, match="temperature"):
        c.completions([[1, 2]], temperature=-1.0)


def test_trl_generate_endpoint(server_url, engine):
    body = {"prompts": PROMPTS, "n": 2, "max_tokens": 4, "generation_kwargs": {"seed": 5}}
    data = httpx.post(f"{server_url}/generate/", json=body).json()
    local = _in_process(engine.model, PROMPTS, 2, seed=5, max_tokens=4)
    assert data["prompt_ids"] == PROMPTS and data["completion_ids"] == local.completion_ids
    assert data["logprobs"] == [[[lp] for lp in row] for row in local.logprobs]
    assert data["logprob_token_ids"] == [[[t] for t in row] for row in local.completion_ids]
    bad = httpx.post(f"{server_url}/generate/", json={**body, "generation_kwargs": {"frequency_penalty": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "frequency_penalty"


def test_weight_push_is_bitwise_and_changes_generation(tiny_model_path):
    """A push (in several chunks) makes the server's parameters equal the trainer's bit for bit, applied at once."""
    from posttrain.serving.engine import PosttrainEngine

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    new = dict(trainer_model.named_parameters())
    with serve_in_thread(engine) as url, GenerationClient(url) as c:
        before = c.completions(PROMPTS, n=2, max_tokens=6, seed=9)
        chunks = list(serialize_chunks(((n, p.detach()) for n, p in new.items()), chunk_bytes=64 * 1024))
        assert len(chunks) > 2
        assert c.load_weights(chunks) == 1
        served = dict(engine.model.named_parameters())
        assert all(torch.equal(served[n], p) for n, p in new.items())
        after = c.completions(PROMPTS, n=2, max_tokens=6, seed=9)
        assert after.version == 1 and after.choices != before.choices
        local = _in_process(trainer_model, PROMPTS, 2, seed=9)
        assert [x.token_ids for g in after.choices for x in g] == local.completion_ids
        # explicit version; errors name the tensor and apply nothing
        assert c.load_weights(serialize_chunks({"model.norm.weight": new["model.norm.weight"]}), version=7) == 7
        bad_name = serialize_chunks({"model.nope.weight": torch.zeros(2)})
        with pytest.raises(ServerRequestError, match="model.nope.weight"):
            c.load_weights(bad_name)
        bad_shape = serialize_chunks({"model.norm.weight": torch.zeros(3)})
        with pytest.raises(ServerRequestError, match="shape"):
            c.load_weights(bad_shape)
        assert torch.equal(served["model.norm.weight"], new["model.norm.weight"])
        assert c.health()["version"] == 7


class _BlockingEngine:
    """A fake engine whose generate waits for ``release`` (to hold the worker busy)."""

    name, model_name, max_model_len, world_size = "fake", "fake", None, 1

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls = 0

    def tokenize(self, text):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return ""

    def check(self, request):
        pass

    def generate(self, request):
        self.calls += 1
        self.started.set()
        assert self.release.wait(timeout=20)
        return [[GeneratedSequence([1], [0.0], "length")] * request.n for _ in request.prompts]

    def load_weights(self, tensors):
        return len(tensors)

    def reset_prefix_cache(self):
        pass

    def close(self):
        print("engine closed", flush=True)


def _post_in_thread(url, results, timeout=30.0):
    def send():
        try:
            results.append(httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 1},
                                      timeout=timeout).status_code)  # fmt: skip
        except httpx.HTTPError as err:
            results.append(type(err).__name__)

    t = threading.Thread(target=send)
    t.start()
    return t


def test_backpressure_and_client_disconnect():
    engine = _BlockingEngine()
    with serve_in_thread(engine, max_queue_size=2) as url:
        results: list = []
        first = _post_in_thread(url, results)
        assert engine.started.wait(10)
        # The second request waits in the queue and its client gives up (disconnects) after 0.3 s.
        second = _post_in_thread(url, results, timeout=0.3)
        second.join(10)
        assert results == ["ReadTimeout"]
        # While two are admitted, a third is refused with 429 + Retry-After.
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert resp.status_code == 429 and resp.headers["Retry-After"] == "1"
        engine.release.set()
        first.join(10)
        assert results[-1] == 200
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").json()["pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(f"{url}/health").json()
        assert health["stats_dropped_disconnected"] == 1 and engine.calls == 1 and health["pending"] == 0
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_requests_then_exits(tmp_path):
    """The request is in the engine when SIGTERM arrives and is released only once the server has begun shutting
    down, so the 200 proves the drain; every step waits on an event, none on the clock."""
    port = _free_port()
    script = tmp_path / "slow_server.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_server_api import _BlockingEngine
        from posttrain.serving.app import run_server
        engine = _BlockingEngine()
        engine.generate_real = engine.generate
        def held(request):
            print("generating", flush=True)
            sys.stdin.readline()  # the test's go, sent after the server has started shutting down (EOF: go too)
            engine.release.set()
            return engine.generate_real(request)
        engine.generate = held
        run_server(engine, "127.0.0.1", {port}, log_level="info")  # info: uvicorn says "Shutting down"
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    seen = {"generating": threading.Event(), "Shutting down": threading.Event()}

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            for marker, event in seen.items():
                if marker in line:
                    event.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        GenerationClient(f"http://127.0.0.1:{port}").wait_until_ready(timeout=60, poll_interval=0.1)
        results: list = []
        inflight = _post_in_thread(f"http://127.0.0.1:{port}", results)
        assert seen["generating"].wait(60), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        assert seen["Shutting down"].wait(60), "".join(lines)
        assert results == []  # still in flight
        proc.stdin.write("go\n")
        proc.stdin.flush()
        inflight.join(60)
        assert results == [200]
        proc.wait(60)
        reader.join(10)
        out = "".join(lines)
        # uvicorn re-raises the SIGTERM after its graceful shutdown (exit status -15, as supervisors expect); the
        # lifespan shutdown (worker drained, engine closed) ran before that.
        assert proc.returncode in (0, -signal.SIGTERM) and "engine closed" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_disconnect_while_running_is_harmless():
    engine = _BlockingEngine()
    with serve_in_thread(engine) as url:
        results: list = []
        t = _post_in_thread(url, results, timeout=0.3)  # the client leaves while its generation runs
        assert engine.started.wait(10)
        t.join(10)
        assert results == ["ReadTimeout"]
        engine.release.set()
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").json()["pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 200
        assert engine.calls == 2 and httpx.get(f"{url}/health").json()["pending"] == 0


def test_async_client_matches_sync_client(server_url):
    import asyncio

    async def run():
        c = GenerationClient(server_url)
        try:
            results = await asyncio.gather(*[c.acompletions(PROMPTS, n=2, max_tokens=4, seed=s) for s in (1, 2)])
            health = await c.ahealth()
        finally:
            await c.aclose()
        return results, health

    (first, second), health = asyncio.run(run())
    import pickle

    with pickle.loads(pickle.dumps(GenerationClient(server_url))) as c:  # picklable for a spawned rollout worker
        assert first.choices == c.completions(PROMPTS, n=2, max_tokens=4, seed=1).choices
        assert second.choices == c.completions(PROMPTS, n=2, max_tokens=4, seed=2).choices
    assert first.version == health["version"]


def test_serve_in_thread_can_stop_the_server_inside_its_block():
    """The handle serve_in_thread returns stops the server mid-block (a trainer's server going away) and joins it."""
    served = serve_in_thread(_BlockingEngine())
    with served as url:
        assert served.running and served.url == url
        assert httpx.get(f"{url}/health").status_code == 200
        served.stop()
        assert not served.running
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=10)
        served.stop()  # idempotent, and leaving the block stops nothing twice
    assert not served.running
    with pytest.raises(RuntimeError, match="started already"):
        served.__enter__()


def test_async_weight_push_sets_version():
    import asyncio

    async def push(url):
        c = GenerationClient(url)
        try:
            return await c.aload_weights(serialize_chunks({"w": torch.ones(3)}), version=5)
        finally:
            await c.aclose()

    with serve_in_thread(_BlockingEngine()) as url:
        assert asyncio.run(push(url)) == 5
        assert httpx.get(f"{url}/health").json()["version"] == 5


def test_waiting_unseeded_requests_share_one_engine_call():
    engine = _BlockingEngine()
    seen: list[int] = []
    real = engine.generate

    def recording(request):
        seen.append(len(request.prompts))
        return real(request)

    engine.generate = recording
    with serve_in_thread(engine) as url:
        results: list = []
        first = _post_in_thread(url, results)
        assert engine.started.wait(10)
        waiting = [_post_in_thread(url, results) for _ in range(3)]
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").json()["pending"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        seeded = threading.Thread(target=lambda: results.append(httpx.post(
            f"{url}/v1/completions", json={"prompt": [[1], [2]], "max_tokens": 1, "seed": 1}, timeout=30).status_code))
        seeded.start()
        while httpx.get(f"{url}/health").json()["pending"] < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        engine.release.set()
        for t in [first, *waiting, seeded]:
            t.join(20)
        assert results == [200] * 5
        assert seen == [1, 3, 2]  # the first alone, the three waiting ones together, the seeded one alone
        assert httpx.get(f"{url}/health").json()["stats_engine_calls"] == 3
