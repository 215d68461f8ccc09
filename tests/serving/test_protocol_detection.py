"""The server backend against stand-ins for a real ``vllm serve`` and for TRL's ``trl vllm-serve``: which protocol
it detects and the requests it sends (the NCCL weight transfer itself needs GPUs; see test_vllm_gpu.py)."""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response

from posttrain.generation.base import SamplingConfig
from posttrain.generation.vllm_server import VLLMServerBackend

EOS, PAD = 258, 259


def _serve(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def _fake_vllm(seen: list) -> FastAPI:
    """vLLM's OpenAI server: /health answers an empty 200, /v1/models lists the model, choices carry token_ids."""
    app = FastAPI()

    @app.get("/health")
    def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "Qwen/Qwen2.5-0.5B", "max_model_len": 4096}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        choices = []
        for p in range(len(body["prompt"])):
            for j in range(body["n"]):
                ids = [10 + j, EOS] if j == 0 else [11, 12, 13]
                choices.append({"index": p * body["n"] + j, "text": "x", "token_ids": ids,
                                "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": ["x"] * len(ids),
                                             "top_logprobs": None, "text_offset": [0] * len(ids)},
                                "finish_reason": "stop" if j == 0 else "length", "stop_reason": None})  # fmt: skip
        return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": choices}

    return app


def test_detects_real_vllm_and_sends_its_request_shape():
    seen: list = []
    server, thread, url = _serve(_fake_vllm(seen))
    try:
        backend = VLLMServerBackend(base_url=url, seed=1)
        assert backend.protocol == "vllm" and backend.model_name == "Qwen/Qwen2.5-0.5B"
        sampling = SamplingConfig(3, temperature=0.7, eos_token_ids=[EOS], pad_token_id=PAD)
        out = backend.generate([[1, 2], [3]], sampling, 2)
        assert out.completion_ids == [[10, EOS], [11, 12, 13]] * 2 and out.finished == [True, False] * 2
        assert out.logprobs == [[-0.5] * 2, [-0.5] * 3] * 2
        body = seen[0]
        assert body["model"] == "Qwen/Qwen2.5-0.5B" and body["prompt"] == [[1, 2], [3]] and body["n"] == 2
        assert body["top_k"] == -1 and body["logprobs"] == 0 and body["return_token_ids"] is True
        assert body["temperature"] == 0.7 and body["max_tokens"] == 3 and body["stop_token_ids"] == [EOS]
        assert isinstance(body["seed"], int)
        if importlib.util.find_spec("vllm") is None:
            with pytest.raises(ImportError):
                backend.sync_weights(__import__("torch").nn.Linear(2, 2))  # NCCL weight transfer needs vLLM
    finally:
        server.should_exit = True
        thread.join(20)


def test_detects_trl_vllm_serve():
    """trl vllm-serve: only /health/ (FastAPI redirects /health there), no /v1/models; generation via /generate/."""
    app = FastAPI()
    seen: list = []

    @app.get("/health/")
    def health():
        return {"status": "ok"}

    @app.post("/generate/")
    async def generate(request: Request):
        body = await request.json()
        seen.append(body)
        n = body["n"]
        rows = [[5, 6, EOS] for _ in range(len(body["prompts"]) * n)]
        return {"prompt_ids": body["prompts"], "completion_ids": rows,
                "logprobs": [[[-1.0]] * 3 for _ in rows], "logprob_token_ids": [[[t] for t in r] for r in rows]}  # fmt: skip

    server, thread, url = _serve(app)
    try:
        backend = VLLMServerBackend(base_url=url, seed=1)
        assert backend.protocol == "trl"
        out = backend.generate([[1, 2]], SamplingConfig(4, eos_token_ids=[EOS], pad_token_id=PAD), 2)
        assert out.completion_ids == [[5, 6, EOS]] * 2 and out.logprobs == [[-1.0] * 3] * 2 and all(out.finished)
        assert seen[0]["prompts"] == [[1, 2]] and seen[0]["logprobs"] == 0 and "seed" in seen[0]["generation_kwargs"]
    finally:
        server.should_exit = True
        thread.join(20)
