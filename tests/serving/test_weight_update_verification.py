"""Weight pushes to ``posttrain serve`` are verified and atomic (issue 36, item 2).

A corrupted body, interleaved chunks of two updates, NaN/Inf values and float64/int64 tensors are refused with a 4xx
naming the reason, and the previous weights keep serving (same seeded generation, same version); the client checks
that the server's answer echoes the digest and version it sent. Every server binds 127.0.0.1 in a thread and is
stopped when its ``with`` block ends.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from posttrain.generation.client import GenerationClient, ServerRequestError, WeightSyncError
from posttrain.generation.weights import chunk_digest, serialize_chunks, update_digest
from posttrain.serving.app import serve_in_thread

PROMPTS = [[5, 6, 7], [8, 9]]


@pytest.fixture()
def served(tiny_model_path):
    """A fresh engine (its weights change here) served on loopback; yields (url, engine)."""
    from posttrain.serving.engine import PosttrainEngine

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    with serve_in_thread(engine) as url:
        yield url, engine


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _shifted(engine, names, delta) -> dict[str, torch.Tensor]:
    params = dict(engine.model.named_parameters())
    return {n: params[n].detach() + delta for n in names}


def _generation(url):
    with GenerationClient(url, request_timeout=60) as c:
        result = c.completions(PROMPTS, n=2, max_tokens=5, seed=11)
    return [x.token_ids for g in result.choices for x in g], [x.logprobs for g in result.choices for x in g]


def _push(url, body, **params):
    params = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items()}
    return httpx.post(f"{url}/v1/load_weights", content=body, params=params, timeout=60)


def _unchanged(url, engine, before_params, before_generation, version=0):
    assert all(torch.equal(p, before_params[n]) for n, p in engine.model.named_parameters())
    assert _generation(url) == before_generation
    assert httpx.get(f"{url}/health").json()["version"] == version


def _flip_a_bit_in_data(body: bytes) -> bytes:
    """Flip one bit of a tensor value; the safetensors header (the framing) stays intact and parseable."""
    header_len = int.from_bytes(body[:8], "little")
    data = bytearray(body)
    data[8 + header_len + 5] ^= 0x10
    return bytes(data)


def test_corrupted_body_is_refused_and_old_weights_serve_on(served):
    url, engine = served
    before, gen = _snapshot(engine), _generation(url)
    body = next(serialize_chunks(_shifted(engine, ["model.norm.weight"], 0.5)))
    corrupted = _flip_a_bit_in_data(body)
    from safetensors.torch import load

    assert set(load(corrupted)) == {"model.norm.weight"}  # framing intact: without a digest it would be applied
    resp = _push(url, corrupted, update_id="u1", chunk=0, last=True, chunk_digest=chunk_digest(body))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "chunk_digest" and "corrupted" in err["message"] and "previous weights" in err["message"]
    _unchanged(url, engine, before, gen)
    # the same through the client, with a transport that flips a bit of every request body on the way
    with GenerationClient(url, request_timeout=60) as c:
        inner = httpx.HTTPTransport()

        def corrupt(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/load_weights":
                request = httpx.Request(request.method, request.url, headers=request.headers,
                                        content=_flip_a_bit_in_data(request.read()))  # fmt: skip
            return inner.handle_request(request)

        c._client = httpx.Client(base_url=url, transport=httpx.MockTransport(corrupt), timeout=60)
        with pytest.raises(ServerRequestError, match="corrupted"):
            c.load_weights(serialize_chunks(_shifted(engine, ["model.norm.weight"], 0.5)))
    _unchanged(url, engine, before, gen)


def test_interleaved_chunks_of_two_updates_never_mix(served):
    url, engine = served
    names = ["model.norm.weight", "model.embed_tokens.weight"]
    before, gen = _snapshot(engine), _generation(url)
    a = [next(serialize_chunks({n: t})) for n, t in _shifted(engine, names, 1.0).items()]
    b = [next(serialize_chunks({n: t})) for n, t in _shifted(engine, names, 2.0).items()]
    a_digests, b_digests = [chunk_digest(x) for x in a], [chunk_digest(x) for x in b]
    assert _push(url, a[0], update_id="A", chunk=0, last=False, chunk_digest=a_digests[0]).status_code == 200
    assert _push(url, b[0], update_id="B", chunk=0, last=False, chunk_digest=b_digests[0]).status_code == 200
    # A's last chunk arrives after B started: A was aborted, so this is a 409 and nothing of A is applied
    resp = _push(url, a[1], update_id="A", chunk=1, last=True, chunk_digest=a_digests[1],
                 update_digest=update_digest(a_digests))  # fmt: skip
    assert resp.status_code == 409 and resp.json()["error"]["param"] == "update_id", resp.text
    assert "aborted" in resp.json()["error"]["message"] and "'B'" in resp.json()["error"]["message"]
    _unchanged(url, engine, before, gen)
    resp = _push(url, b[1], update_id="B", chunk=1, last=True, chunk_digest=b_digests[1],
                 update_digest=update_digest(b_digests))  # fmt: skip
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["applied"] and answer["version"] == 1 and answer["digest"] == update_digest(b_digests)
    served_params = dict(engine.model.named_parameters())
    for n in names:  # all of B, none of A
        assert torch.equal(served_params[n], before[n] + 2.0)
    # chunks out of order, or of an unknown update, are refused and apply nothing
    resp = _push(url, a[1], update_id="C", chunk=1, last=True, chunk_digest=a_digests[1])
    assert resp.status_code == 409 and resp.json()["error"]["param"] == "chunk"
    assert _push(url, a[0], update_id="D", chunk=0, last=False).status_code == 200
    resp = _push(url, a[1], update_id="D", chunk=2, last=True)
    assert resp.status_code == 409 and "expected" in resp.json()["error"]["message"]
    assert httpx.get(f"{url}/health").json()["version"] == 1


def test_a_repeated_chunk_is_answered_as_the_first_time(served):
    """A client retry after a lost answer (same update, index and digest) neither fails nor applies twice."""
    url, engine = served
    chunks = [next(serialize_chunks({n: t})) for n, t in _shifted(engine, ["model.norm.weight"], 1.0).items()]
    chunks.append(next(serialize_chunks(_shifted(engine, ["model.embed_tokens.weight"], 1.0))))
    digests = [chunk_digest(x) for x in chunks]
    first = _push(url, chunks[0], update_id="R", chunk=0, last=False, chunk_digest=digests[0])
    again = _push(url, chunks[0], update_id="R", chunk=0, last=False, chunk_digest=digests[0])
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    last = dict(update_id="R", chunk=1, last=True, chunk_digest=digests[1], update_digest=update_digest(digests))
    applied = _push(url, chunks[1], **last)
    repeated = _push(url, chunks[1], **last)
    assert applied.status_code == repeated.status_code == 200 and applied.json() == repeated.json()
    assert httpx.get(f"{url}/health").json()["version"] == 1  # applied once


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(served, bad):
    url, engine = served
    before, gen = _snapshot(engine), _generation(url)
    tensor = _shifted(engine, ["model.norm.weight"], 0.1)["model.norm.weight"]
    tensor[3] = bad
    with GenerationClient(url, request_timeout=60) as c, pytest.raises(ServerRequestError, match="NaN/Inf") as err:
        c.load_weights(serialize_chunks({"model.norm.weight": tensor}))
    assert "model.norm.weight" in str(err.value) and err.value.status == 400
    _unchanged(url, engine, before, gen)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int32, torch.bool])
def test_float64_and_integer_tensors_are_refused_not_cast(served, dtype):
    url, engine = served
    before, gen = _snapshot(engine), _generation(url)
    tensor = torch.ones_like(before["model.norm.weight"], dtype=dtype)
    with GenerationClient(url, request_timeout=60) as c, pytest.raises(ServerRequestError, match="not cast") as err:
        c.load_weights(serialize_chunks({"model.norm.weight": tensor}))
    assert str(dtype).removeprefix("torch.") in str(err.value) and "model.norm.weight" in str(err.value)
    _unchanged(url, engine, before, gen)


def test_half_precision_pushes_are_cast_to_the_model_dtype(served):
    """float16/bfloat16/float32 may be pushed onto each other (a float32 trainer, a bfloat16 server)."""
    url, engine = served
    new = _shifted(engine, ["model.norm.weight"], 0.25)["model.norm.weight"]
    with GenerationClient(url, request_timeout=60) as c:
        assert c.load_weights(serialize_chunks({"model.norm.weight": new.to(torch.bfloat16)})) == 1
    served_weight = dict(engine.model.named_parameters())["model.norm.weight"]
    assert served_weight.dtype == torch.float32 and torch.equal(served_weight, new.to(torch.bfloat16).float())


def test_a_refused_chunk_discards_the_whole_update(served):
    """A bad tensor in a later chunk: the earlier, valid chunks of the same update are not applied either."""
    url, engine = served
    before, gen = _snapshot(engine), _generation(url)
    good = _shifted(engine, ["model.embed_tokens.weight"], 1.0)
    bad = {"model.norm.weight": torch.full_like(before["model.norm.weight"], float("nan"))}
    chunks = [next(serialize_chunks(good)), next(serialize_chunks(bad))]
    with GenerationClient(url, request_timeout=60) as c, pytest.raises(ServerRequestError, match="NaN"):
        c.load_weights(chunks)
    _unchanged(url, engine, before, gen)


def _fake_server(answer):
    """A client whose transport answers every weight push with ``answer(params)``."""

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer(dict(request.url.params)))

    c = GenerationClient("http://127.0.0.1:9")
    c._client = httpx.Client(base_url=c.base_url, transport=httpx.MockTransport(handle))
    return c


def _honest(params):
    last = params["last"] == "true"
    out = {"update_id": params["update_id"], "applied": last, "chunk": int(params["chunk"]),
           "chunk_digest": params["chunk_digest"], "version": 4 if last else 3}  # fmt: skip
    if last:
        out.update(previous_version=3, digest=params["update_digest"])
    return out


@pytest.mark.parametrize(
    ("tamper", "match"),
    [
        (lambda a: {**a, "digest": "0" * 64} if a["applied"] else a, "digest"),
        (lambda a: {**a, "chunk_digest": "0" * 64} if not a["applied"] else a, "digest"),
        (lambda a: {**a, "version": 3} if a["applied"] else a, "version 3, expected 4"),
        (lambda a: {**a, "applied": False}, "applied=False"),
        (lambda a: {**a, "update_id": "other"}, "other"),
        (lambda a: {"version": 4}, "answered for update None"),
    ],
)
def test_client_checks_the_echoed_digest_and_version(tamper, match):
    chunks = list(serialize_chunks({"a": torch.ones(4), "b": torch.zeros(4)}, chunk_bytes=16))
    assert len(chunks) == 2
    with _fake_server(_honest) as c:
        assert c.load_weights(chunks) == 4
    with _fake_server(lambda p: tamper(_honest(p))) as c, pytest.raises(WeightSyncError, match=match):
        c.load_weights(chunks)
    wrong_version = _fake_server(lambda p: {**_honest(p), "version": 6} if p["last"] == "true" else _honest(p))
    with wrong_version as c, pytest.raises(WeightSyncError, match="version 6, expected 5"):
        c.load_weights(chunks, version=5)


def test_async_client_checks_the_echo_too():
    import asyncio

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={**_honest(dict(request.url.params)), "digest": "f" * 64})

    async def push():
        c = GenerationClient("http://127.0.0.1:9")
        c._aclient = httpx.AsyncClient(base_url=c.base_url, transport=httpx.MockTransport(handle))
        try:
            await c.aload_weights(serialize_chunks({"a": torch.ones(2)}))
        finally:
            await c.aclose()

    with pytest.raises(WeightSyncError, match="digest"):
        asyncio.run(push())


# -- the post-sync probe ------------------------------------------------------------------------------------------
@pytest.fixture()
def trainer_model(tiny_model_path):
    """The trainer's policy after some training: the tiny model's weights moved by noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.train()


def _backend(url, **kwargs):
    from posttrain.generation.vllm_server import VLLMServerBackend

    return VLLMServerBackend(base_url=url, timeout=30, client_kwargs={"request_timeout": 60}, **kwargs)


def test_probe_passes_when_the_server_serves_the_pushed_weights(served, trainer_model):
    url, engine = served
    backend = _backend(url, weight_sync_probe=True, weight_sync_probe_atol=1e-3)
    try:
        backend.sync_weights(trainer_model)  # pushes, then probes
        report = backend.probe(trainer_model)
    finally:
        backend.close()
    assert backend.version == 1 and len(report["tokens"]) == 4 and report["max_abs_diff"] < 1e-3
    assert trainer_model.training  # the probe's eval-mode forward restores train mode


def test_probe_catches_a_server_that_ignored_the_push(tiny_model_path, trainer_model):
    """A fault-injected engine answers 200 (digest and version echoed) but keeps its old weights."""
    from posttrain.generation.vllm_server import VLLMServerBackend
    from posttrain.serving.engine import PosttrainEngine

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    engine.load_weights = lambda tensors: len(tensors)  # drops the update, reports success
    with serve_in_thread(engine) as url:
        silent = _backend(url)  # without the probe the push "succeeds"
        try:
            silent.sync_weights(trainer_model)
            assert silent.version == 1
        finally:
            silent.close()
        backend = VLLMServerBackend(
            args=type("Args", (), {"vllm_weight_sync_probe": True, "vllm_weight_sync_probe_atol": 0.02})(),
            base_url=url, timeout=30,
        )  # fmt: skip
        try:
            assert backend.weight_sync_probe and backend.weight_sync_probe_atol == 0.02  # from the config fields
            with pytest.raises(WeightSyncError, match="not generating with the pushed weights") as err:
                backend.sync_weights(trainer_model)
        finally:
            backend.close()
    message = str(err.value)
    assert url in message and "vllm_weight_sync_probe_atol=0.02" in message and "version 2" in message


def test_probe_checks_the_nccl_protocol_too(served, trainer_model, monkeypatch):
    """TRL's NCCL path cannot run on CPU, but its probe can: a broadcast that never reached the server is caught,
    and one that did (simulated by loading the tensors into the served engine) passes."""
    from posttrain.generation.vllm_server import VLLMServerBackend

    url, engine = served
    backend = _backend(url, protocol="trl", weight_sync_probe=True, weight_sync_probe_atol=1e-3)
    try:
        monkeypatch.setattr(VLLMServerBackend, "_push_trl", lambda self, tensors: None)  # lost broadcast
        with pytest.raises(WeightSyncError, match="trl protocol"):
            backend.sync_weights(trainer_model)
        monkeypatch.setattr(VLLMServerBackend, "_push_trl", lambda self, tensors: engine.load_weights(dict(tensors)))
        backend.sync_weights(trainer_model)
    finally:
        backend.close()


def test_probe_config_fields_exist_with_defaults():
    from posttrain import GRPOConfig, RLOOConfig

    for config in (GRPOConfig, RLOOConfig):
        args = config(output_dir="unused", report_to="none")
        assert args.vllm_weight_sync_probe is False and args.vllm_weight_sync_probe_atol == 0.02


def test_a_repeated_last_chunk_while_applying_gets_the_same_answer(monkeypatch):
    """A retry of the last chunk that arrives while the engine is still applying the update waits for that
    application's answer (no 409, no second application)."""
    import threading

    from posttrain.serving.app import WeightStaging

    repeat_seen = threading.Event()
    original = WeightStaging.last_digest

    def last_digest(self, update_id):
        repeat_seen.set()
        return original(self, update_id)

    monkeypatch.setattr(WeightStaging, "last_digest", last_digest)

    class SlowLoadEngine:
        name, model_name, max_model_len, world_size = "fake", "fake", None, 1
        loads = 0

        def load_weights(self, tensors):
            assert repeat_seen.wait(timeout=30)  # the repeat reached the server while this load runs
            SlowLoadEngine.loads += 1
            return len(tensors)

        def close(self):
            pass

    body = next(serialize_chunks({"w": torch.ones(3)}))
    params = dict(update_id="S", chunk=0, last=True, chunk_digest=chunk_digest(body), update_digest=update_digest([chunk_digest(body)]))
    with serve_in_thread(SlowLoadEngine()) as url:
        answers = []
        first = threading.Thread(target=lambda: answers.append(_push(url, body, **params)))
        first.start()
        second = _push(url, body, **params)
        first.join(timeout=60)
        assert not first.is_alive()
    assert second.status_code == answers[0].status_code == 200, second.text
    assert second.json() == answers[0].json() and second.json()["version"] == 1
    assert SlowLoadEngine.loads == 1


@pytest.mark.slow
@pytest.mark.parametrize("drops_pushes", [False, True])
def test_grpo_server_mode_with_the_probe(tiny_model_path, tmp_path, drops_pushes):
    """GRPO with vllm_weight_sync_probe=True trains against an honest server and stops with WeightSyncError at the
    first push a fault-injected server drops (it still answers 200 with the right digest and version)."""
    from datasets import Dataset
    from reward_helpers import varied_reward

    from posttrain.serving.engine import PosttrainEngine
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    if drops_pushes:
        engine.load_weights = lambda tensors: len(tensors)
    with serve_in_thread(engine) as url:
        args = GRPOConfig(
            output_dir=str(tmp_path), report_to="none", save_strategy="no", write_report=False, disable_tqdm=True,
            gradient_checkpointing=False, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
            max_steps=3, learning_rate=5e-2, seed=7, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
            vllm_weight_sync_probe=True,
        )  # fmt: skip
        dataset = Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])
        trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=dataset)
        if drops_pushes:
            with pytest.raises(WeightSyncError, match="not generating with the pushed weights"):
                trainer.train()
            assert trainer.state.global_step == 1  # the first push after the first optimizer step is caught
        else:
            trainer.train()
            assert trainer.state.global_step == 3
            # pushed (and probed) before the generations of steps 1 and 2
            assert httpx.get(f"{url}/health").json()["version"] >= 2
