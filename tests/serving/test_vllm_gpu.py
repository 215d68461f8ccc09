"""vLLM paths: the vLLM engine behind ``posttrain serve``, the colocate backend, a real ``vllm serve`` with NCCL
weight transfer, and TRL's NCCL communicator protocol. GPU only (marked ``gpu``, skipped without CUDA + vLLM);
these have not been run on hardware for this release (see the README)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None, reason="needs CUDA and vLLM"
    ),
]

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the server and the trainer need separate GPUs")

EOS, PAD = 258, 259
PROMPTS = [list(b"hello there"), list(b"a"), list(b"the quick brown fox")]


def _sampling(**kw):
    from posttrain.generation.base import SamplingConfig

    return SamplingConfig(8, eos_token_ids=[EOS], pad_token_id=PAD, **kw)


def _perturbed(path, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _greedy_reference(model, prompts, max_new_tokens=8):
    from posttrain.generation.group_sampler import GroupSampler

    return GroupSampler(model).generate(prompts, _sampling(do_sample=False), 1).completion_ids


def test_vllm_engine_behind_posttrain_serve(tiny_model_path):
    from posttrain.generation.vllm_server import VLLMServerBackend
    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_path, gpu_memory_utilization=0.2, dtype="float32", enforce_eager=True)
    with serve_in_thread(engine) as url:
        backend = VLLMServerBackend(base_url=url)
        out = backend.generate(PROMPTS, _sampling(temperature=0.8), 4)
        assert len(out) == 12 and out.logprobs is not None
        policy = _perturbed(tiny_model_path, "cuda")
        backend.sync_weights(policy)
        greedy = backend.generate(PROMPTS, _sampling(do_sample=False), 1)
        assert greedy.completion_ids == _greedy_reference(policy, PROMPTS)


def test_vllm_colocate_backend(tiny_model_path):
    from types import SimpleNamespace

    from posttrain.generation.vllm_colocate import VLLMColocateBackend

    policy = _perturbed(tiny_model_path, "cuda")
    args = SimpleNamespace(vllm_tensor_parallel_size=1, vllm_gpu_memory_utilization=0.2, vllm_max_model_length=256,
                           per_device_train_batch_size=8, steps_per_generation=1, vllm_enable_sleep_mode=False,
                           vllm_model_impl="vllm", vllm_structured_outputs_regex=None)  # fmt: skip
    backend = VLLMColocateBackend(policy, None, args)
    backend.sync_weights(policy)
    greedy = backend.generate(PROMPTS, _sampling(do_sample=False), 1)
    assert greedy.completion_ids == _greedy_reference(policy, PROMPTS)
    sampled = backend.generate(PROMPTS, _sampling(temperature=0.8), 3)
    assert len(sampled) == 9 and all(len(lp) == len(ids) for lp, ids in zip(sampled.logprobs, sampled.completion_ids))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cmd, env_extra):
    from posttrain.generation.client import GenerationClient

    port = _free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1", **env_extra}
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        GenerationClient(url).wait_until_ready(timeout=600, poll_interval=2)
    except Exception:
        proc.kill()
        proc.wait(30)
        raise
    return proc, url


def _stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


@two_gpus
def test_real_vllm_serve_with_nccl_weight_transfer(tiny_model_path):
    """The seeds' deployment: VLLM_SERVER_DEV_MODE=1 vllm serve --weight-transfer-config '{"backend":"nccl"}'."""
    from posttrain.generation.vllm_server import VLLMServerBackend

    proc, url = _launch(
        ["vllm", "serve", tiny_model_path, "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager",
         "--gpu-memory-utilization", "0.2", "--weight-transfer-config", '{"backend":"nccl"}',
         "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"],
        {"VLLM_SERVER_DEV_MODE": "1"},
    )  # fmt: skip
    try:
        torch.cuda.set_device(0)
        backend = VLLMServerBackend(base_url=url)
        assert backend.protocol == "vllm"
        policy = _perturbed(tiny_model_path, "cuda:0")
        backend.sync_weights(policy)
        time.sleep(0.5)
        greedy = backend.generate(PROMPTS, _sampling(do_sample=False), 1)
        assert greedy.completion_ids == _greedy_reference(policy, PROMPTS)
    finally:
        _stop(proc)


@two_gpus
def test_trl_protocol_nccl_against_posttrain_vllm_serve(tiny_model_path):
    from posttrain.generation.vllm_server import VLLMServerBackend

    proc, url = _launch(
        [sys.executable, "-m", "posttrain.cli.main", "vllm-serve", "--model", tiny_model_path, "--host", "127.0.0.1",
         "--backend", "vllm", "--dtype", "float32", "--enforce_eager", "--gpu_memory_utilization", "0.2"],
        {},
    )  # fmt: skip
    try:
        torch.cuda.set_device(0)
        backend = VLLMServerBackend(base_url=url, protocol="trl")
        policy = _perturbed(tiny_model_path, "cuda:0")
        backend.sync_weights(policy)
        greedy = backend.generate(PROMPTS, _sampling(do_sample=False), 1)
        assert greedy.completion_ids == _greedy_reference(policy, PROMPTS)
        backend.close()
    finally:
        _stop(proc)
