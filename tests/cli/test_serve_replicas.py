"""``posttrain serve --data_parallel_size N``: the replica plan (ports, seeds, GPUs, threads), the replica command
line (the launcher's options win over the user's), and end to end over loopback — GRPO trains over both replicas
through ``vllm_server_base_urls``; SIGTERM to the launcher stops every replica; a replica that dies takes the
launcher down non-zero, naming it. Every process started here is waited for."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from posttrain.cli.serve import ServeArguments
from posttrain.cli.serve_replicas import plan_replicas, replica_command

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def _args(**overrides):
    values = dict(data_parallel_size=2, port=8100, seed=3, device="auto", tensor_parallel_size=1)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_plan_gives_consecutive_ports_distinct_seeds_and_a_thread_share():
    plans = plan_replicas(_args(), environ={}, cuda_devices=0)
    assert [(p.index, p.port, p.seed) for p in plans] == [(0, 8100, 3), (1, 8101, 4)]
    expected = str(max(1, (os.cpu_count() or 1) // 2))
    assert all(p.env["OMP_NUM_THREADS"] == expected and "CUDA_VISIBLE_DEVICES" not in p.env for p in plans)
    kept = plan_replicas(_args(), environ={"OMP_NUM_THREADS": "7"}, cuda_devices=0)
    assert [p.env["OMP_NUM_THREADS"] for p in kept] == ["7", "7"]


def test_plan_splits_gpus_by_tensor_parallel_size_only_when_there_are_enough():
    plans = plan_replicas(_args(tensor_parallel_size=2), environ={}, cuda_devices=4)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,1", "2,3"]
    assert all("CUDA_VISIBLE_DEVICES" not in p.env for p in plan_replicas(_args(tensor_parallel_size=2),
                                                                         environ={}, cuda_devices=3))  # fmt: skip
    pinned = plan_replicas(_args(), environ={"CUDA_VISIBLE_DEVICES": "5"}, cuda_devices=4)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in pinned] == ["5", "5"]  # the user's choice is left alone
    assert all("CUDA_VISIBLE_DEVICES" not in p.env for p in plan_replicas(_args(device="cpu"), environ={},
                                                                         cuda_devices=4))  # fmt: skip


def test_plan_errors_name_the_option_and_the_fix():
    with pytest.raises(ValueError, match="--port 0 cannot be combined with --data_parallel_size"):
        plan_replicas(_args(port=0), environ={}, cuda_devices=0)
    with pytest.raises(ValueError, match="past port 65535"):
        plan_replicas(_args(port=65535), environ={}, cuda_devices=0)
    with pytest.raises(ValueError, match="--data_parallel_size must be >= 1"):
        ServeArguments(model="m", data_parallel_size=0)


def test_replica_command_overrides_port_seed_and_size_even_when_spelled_dashed():
    from posttrain.cli.parser import TrlParser

    user = ["--model", "m", "--data-parallel-size", "2", "--port", "9000", "--seed", "11"]
    plan = plan_replicas(_args(port=9000, seed=11), environ={}, cuda_devices=0)[1]
    cmd = replica_command("serve", user, plan)
    assert cmd[:4] == [sys.executable, "-m", "posttrain.cli.main", "serve"]
    (parsed,) = TrlParser(ServeArguments).parse_args_and_config(cmd[4:])
    assert (parsed.port, parsed.seed, parsed.data_parallel_size, parsed.model) == (9001, 12, 1, "m")


def _consecutive_free_ports(n: int) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n - 1 > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for k in range(1, n):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", base + k))
            except OSError:
                continue
        return base
    raise RuntimeError("no run of consecutive free ports on 127.0.0.1")


class _Launcher:
    """``posttrain serve --data_parallel_size 2`` as a subprocess; its stderr is read on a thread for the replica
    pids and the URL line (bounded waits)."""

    def __init__(self, model_path: str):
        self.port = _consecutive_free_ports(2)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "posttrain.cli.main", "serve", "--model", model_path, "--host", "127.0.0.1",
               "--port", str(self.port), "--data_parallel_size", "2", "--log_level", "warning",
               "--graceful_timeout", "5", "--device", "cpu"]  # fmt: skip
        self.process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.announced = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.urls = [f"http://127.0.0.1:{self.port + i}" for i in range(2)]

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)
            if "train with vllm_server_base_urls=" in line:
                self.announced.set()

    def pids(self) -> list[int]:
        return [int(m.group(1)) for line in self.lines if (m := re.search(r"replica \d \(pid (\d+)\)", line))]

    def wait_ready(self) -> None:
        from posttrain.generation.client import GenerationClient

        assert self.announced.wait(120), "".join(self.lines)
        for url in self.urls:
            GenerationClient(url).wait_until_ready(timeout=120, poll_interval=0.2)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone for our purposes: the launcher reaps its children, so this only holds briefly
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


@pytest.mark.slow
def test_grpo_trains_over_two_replicas_and_sigterm_stops_them_all(tiny_model_path, tmp_path):
    from datasets import Dataset
    from reward_helpers import varied_reward

    from posttrain.generation.client import GenerationClient
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    launcher = _Launcher(tiny_model_path)
    try:
        launcher.wait_ready()
        assert len(launcher.pids()) == 2
        args = GRPOConfig(
            output_dir=str(tmp_path), report_to="none", save_strategy="no", logging_steps=1,
            gradient_checkpointing=False, write_report=False, disable_tqdm=True, per_device_train_batch_size=4,
            num_generations=2, max_completion_length=4, max_steps=2, seed=7, use_vllm=True, vllm_mode="server",
            vllm_server_base_urls=launcher.urls, vllm_server_timeout=60.0, request_timeout=60.0,
        )  # fmt: skip
        dataset = Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])
        trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=dataset)
        trainer.train()
        logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
        assert logs["server/live"] == 2
        assert logs["server/0/requests"] >= 1 and logs["server/1/requests"] >= 1
        # each replica has its own seed and both received every weight push
        assert [GenerationClient(u).health()["version"] for u in launcher.urls] == [2, 2]
        pids = launcher.pids()
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.process.wait(timeout=60) == 0
        assert all(_pid_gone(pid) for pid in pids)
    finally:
        launcher.close()


@pytest.mark.slow
def test_a_replica_that_dies_takes_the_launcher_down_naming_it(tiny_model_path):
    launcher = _Launcher(tiny_model_path)
    try:
        launcher.wait_ready()
        first, second = launcher.pids()
        os.kill(second, signal.SIGKILL)
        assert launcher.process.wait(timeout=60) == 1
        assert _pid_gone(first)
        assert any(f"replica 1 on {launcher.urls[1]} exited" in line for line in launcher.lines), launcher.lines
    finally:
        launcher.close()
