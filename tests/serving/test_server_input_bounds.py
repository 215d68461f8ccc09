"""Requests outside the server's bounds get a 4xx naming the field, never a 500 or a wrong answer (issue 36, item 3).

Seeds outside [0, 2**64), non-finite sampling parameters, temperatures below the greedy floor, sequences longer than
the model's context and oversized request bodies (``max_request_bytes``, enforced before the JSON is parsed). The
servers bind 127.0.0.1 in a thread and stop when their block ends.
"""

from __future__ import annotations

import httpx
import pytest

from posttrain.serving.app import DEFAULT_MAX_REQUEST_BYTES, MAX_SEED, TEMPERATURE_FLOOR, serve_in_thread


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


@pytest.mark.parametrize("seed", [2**64, 2**70, -1])
def test_seed_outside_uint64_is_a_400_naming_seed(server_url, seed):
    err = _error(httpx.post(f"{server_url}/v1/completions", json={"prompt": [1, 2], "seed": seed}))
    assert err["param"] == "seed" and "seed" in err["message"]
    body = {"prompts": [[1, 2]], "generation_kwargs": {"seed": seed}}
    err = _error(httpx.post(f"{server_url}/generate/", json=body))
    assert err["param"] == "seed" and "2**64" in err["message"]


def test_largest_seed_is_served(server_url):
    resp = httpx.post(f"{server_url}/v1/completions", json={"prompt": [1, 2], "seed": MAX_SEED, "max_tokens": 2})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_sampling_parameters_are_refused(server_url, field, value):
    headers = {"Content-Type": "application/json"}
    for path, prompt in (("/v1/completions", '"prompt": [1, 2]'), ("/generate/", '"prompts": [[1, 2]]')):
        content = "{" + prompt + f', "{field}": {value}' + "}"
        err = _error(httpx.post(f"{server_url}{path}", content=content, headers=headers))
        assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize("payload", [{"top_p": 1.5}, {"min_p": -0.1}, {"min_p": 2}, {"top_k": -2}])
def test_sampling_ranges(server_url, payload):
    (field,) = payload
    err = _error(httpx.post(f"{server_url}/v1/completions", json={"prompt": [1, 2], **payload}))
    assert err["param"] == field


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, TEMPERATURE_FLOOR / 2])
def test_temperature_below_the_floor_is_greedy(server_url, temperature):
    """A tiny temperature once overflowed the logits to NaN (500 with logprobs, wrong tokens without)."""
    body = {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 6, "logprobs": 0, "seed": 3}
    tiny = httpx.post(f"{server_url}/v1/completions", json={**body, "temperature": temperature})
    greedy = httpx.post(f"{server_url}/v1/completions", json={**body, "temperature": 0})
    assert tiny.status_code == greedy.status_code == 200, tiny.text
    strip = [{k: c[k] for k in ("token_ids", "logprobs")} for c in tiny.json()["choices"]]
    assert strip == [{k: c[k] for k in ("token_ids", "logprobs")} for c in greedy.json()["choices"]]
    body = {"prompts": [[5, 6, 7]], "max_tokens": 4, "temperature": temperature}
    tiny = httpx.post(f"{server_url}/generate/", json=body).json()
    assert tiny["completion_ids"] == httpx.post(f"{server_url}/generate/", json={**body, "temperature": 0}).json()["completion_ids"]


def test_at_the_floor_sampling_stays_finite(server_url):
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 0, "temperature": TEMPERATURE_FLOOR, "seed": 1}
    resp = httpx.post(f"{server_url}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert all(lp <= 0 for lp in resp.json()["choices"][0]["logprobs"]["token_logprobs"])


def test_scoring_refuses_a_temperature_below_the_floor(server_url):
    body = {"sequences": [[1, 2, 3]], "prompt_lengths": [1], "temperature": 1e-40}
    err = _error(httpx.post(f"{server_url}/get_sequence_logprobs/", json=body))
    assert err["param"] == "temperature"


def test_context_length_is_checked_on_every_endpoint(server_url, engine):
    limit = engine.max_model_len
    assert limit is not None
    err = _error(httpx.post(f"{server_url}/get_sequence_logprobs/",
                            json={"sequences": [[1] * (limit + 1)], "prompt_lengths": [1]}))  # fmt: skip
    assert err["param"] == "sequences" and str(limit) in err["message"]
    ok = httpx.post(f"{server_url}/get_sequence_logprobs/", json={"sequences": [[1, 2]], "prompt_lengths": [1]})
    assert ok.status_code == 200
    err = _error(httpx.post(f"{server_url}/v1/completions", json={"prompt": [1] * limit, "max_tokens": 1}))
    assert err["param"] == "max_tokens" and str(limit) in err["message"]
    err = _error(httpx.post(f"{server_url}/generate/", json={"prompts": [[1] * (limit - 1)], "max_tokens": 2}))
    assert err["param"] == "max_tokens"


def test_request_body_limit_is_enforced_before_parsing(engine):
    import torch

    from posttrain.generation.client import GenerationClient, ServerRequestError
    from posttrain.generation.weights import serialize_chunks

    limit = 2000
    with serve_in_thread(engine, max_request_bytes=limit) as url:
        # A Content-Length above the limit: refused from the header, the body never read.
        big = {"prompt": list(range(1000)), "max_tokens": 1}
        err = _error(httpx.post(f"{url}/v1/completions", json=big), 413)
        assert err["param"] == "body" and "--max_request_bytes" in err["message"] and str(limit) in err["message"]
        # No Content-Length (chunked): counted while it streams.
        payload = httpx.Request("POST", "/", json=big).read()

        def chunked():
            for i in range(0, len(payload), 256):
                yield payload[i : i + 256]

        err = _error(httpx.post(f"{url}/v1/completions", content=chunked(),
                                headers={"Content-Type": "application/json"}), 413)  # fmt: skip
        assert "more than 2000 bytes" in err["message"]
        err = _error(httpx.post(f"{url}/get_sequence_logprobs/",
                                json={"sequences": [list(range(800))], "prompt_lengths": [1]}), 413)  # fmt: skip
        # small requests (streamed or not) pass through unchanged
        small = {"prompt": [1, 2, 3], "max_tokens": 2, "seed": 1}
        assert httpx.post(f"{url}/v1/completions", json=small).status_code == 200
        small_payload = httpx.Request("POST", "/", json=small).read()
        streamed = httpx.post(f"{url}/v1/completions", content=iter([small_payload[:5], small_payload[5:]]),
                              headers={"Content-Type": "application/json"})  # fmt: skip
        assert streamed.status_code == 200, streamed.text
        # the client reports it as a request error naming the flag
        with GenerationClient(url) as c, pytest.raises(ServerRequestError, match="max_request_bytes") as info:
            c.completions([list(range(1000))], max_tokens=1)
        assert info.value.status == 413
        # weight pushes are exempt (bounded by the client's chunk_bytes instead)
        weight = dict(engine.model.named_parameters())["model.embed_tokens.weight"].detach().clone()
        assert weight.numel() * 4 > limit
        with GenerationClient(url) as c:
            assert c.load_weights(serialize_chunks({"model.embed_tokens.weight": weight})) == 1
        assert torch.equal(dict(engine.model.named_parameters())["model.embed_tokens.weight"], weight)
    assert DEFAULT_MAX_REQUEST_BYTES == 16 * 1024 * 1024
    with pytest.raises(ValueError, match="max_request_bytes"), serve_in_thread(engine, max_request_bytes=0):
        pass


@pytest.mark.slow
def test_serve_cli_takes_max_request_bytes(tiny_model_path):
    """``posttrain serve --max_request_bytes N`` reaches the server (a subprocess, terminated and waited for)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from posttrain.generation.client import GenerationClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "posttrain.cli.main", "serve", "--model", tiny_model_path, "--port", str(port),
           "--log_level", "warning", "--max_request_bytes", "3000"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        GenerationClient(url).wait_until_ready(timeout=90, poll_interval=0.2)
        err = _error(httpx.post(f"{url}/v1/completions", json={"prompt": list(range(1000)), "max_tokens": 1}), 413)
        assert "3000 bytes" in err["message"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
