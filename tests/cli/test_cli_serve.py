"""``posttrain serve`` / ``posttrain vllm-serve`` as subprocesses on loopback, and ``posttrain grpo --use_vllm
--vllm_mode server`` against them end to end. Every server started here is terminated and waited for."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from posttrain.generation.client import GenerationClient  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(verb: str, *args: str):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "posttrain.cli.main", verb, "--port", str(port), "--log_level", "warning", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            GenerationClient(url).wait_until_ready(timeout=90, poll_interval=0.2)
        except ConnectionError:
            proc.kill()
            raise AssertionError(proc.communicate(timeout=10)[0]) from None
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.mark.slow
def test_serve_then_grpo_use_vllm_server_end_to_end(tiny_model_path, tmp_path, run_cli, prompts_jsonl, read_metrics):
    with _server("serve", "--model", tiny_model_path, "--host", "127.0.0.1") as (url, proc):
        health = GenerationClient(url).health()
        assert health["backend"] == "posttrain" and health["model"] == tiny_model_path
        out = tmp_path / "out"
        code, _, stderr = run_cli(
            "grpo", "--model_name_or_path", tiny_model_path, "--dataset_name", prompts_jsonl,
            "--reward_funcs", "think_format_reward", "--num_generations", "2", "--per_device_train_batch_size", "2",
            "--max_completion_length", "4", "--max_steps", "2", "--logging_steps", "1", "--output_dir", out,
            "--report_to", "none", "--save_strategy", "no", "--gradient_checkpointing", "false",
            "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", url,
        )  # fmt: skip
        assert code == 0, stderr
        assert GenerationClient(url).health()["version"] == 2  # one push before each generation
        keys = {k for record in read_metrics(out) for k in record}
        assert "sampling/importance_sampling_ratio/mean" in keys
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode in (0, -signal.SIGTERM), output
        assert "serving" in output


@pytest.mark.slow
def test_vllm_serve_takes_trls_flags_and_falls_back_without_vllm(tiny_model_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM installed: the auto backend would start vLLM")
    with _server("vllm-serve", "--model", tiny_model_path, "--host", "127.0.0.1", "--tensor-parallel-size", "1",
                 "--gpu_memory_utilization", "0.5", "--enforce_eager") as (url, _):  # fmt: skip
        import httpx

        assert httpx.get(f"{url}/health/").json()["backend"] == "posttrain"
        data = httpx.post(f"{url}/generate/", json={"prompts": [[1, 2, 3]], "n": 2, "max_tokens": 3}).json()
        assert len(data["completion_ids"]) == 2 and all(len(c) <= 3 for c in data["completion_ids"])


def test_serve_option_errors(run_cli):
    code, _, stderr = run_cli("serve")
    assert code == 2 and "--model is required" in stderr
    code, _, stderr = run_cli("serve", "--model", "x", "--backend", "tgi")
    assert code == 2 and "--backend" in stderr
    code, _, stderr = run_cli("vllm-serve", "--model", "x", "--data_parallel_size", "0")
    assert code == 2 and "--data_parallel_size must be >= 1" in stderr
    code, _, stderr = run_cli("serve", "--model", "x", "--data_parallel_size", "2", "--port", "0")
    assert code == 2 and "--port 0 cannot be combined" in stderr
    code, stdout, _ = run_cli("--help")
    assert "serve" in stdout and "vllm-serve" in stdout
