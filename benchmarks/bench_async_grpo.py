"""AsyncGRPO vs synchronous GRPO vs TRL's GRPO: time per optimizer step, samples/s, reward at equal steps.

For each workload (``grpo``: short prompts; ``grpo_realistic``: ~330-token shared system prompt, small model) it runs,
each in a fresh process, one after the other:

- ``sync``: posttrain's ``GRPOTrainer`` with its default in-process generation (the group sampler);
- ``sync_server`` (optional, ``--impls``): ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` on the same server;
- ``async``: ``AsyncGRPOTrainer`` (TRL's defaults: ``max_staleness=4``, ``weight_sync_steps=1``) against a
  ``posttrain serve`` subprocess: three processes (server generating, rollout worker, trainer training);
- ``trl``: TRL's ``GRPOTrainer`` on the same workload, when a TRL venv exists (``benchmarks/.venv-trl`` from
  ``setup_trl.sh``, or ``--trl-python``).

Every record has the harness's fields (``median_step_s``, ``median_step_cpu_s`` — the trainer process's CPU time —
``reward``, ...) plus ``samples_per_s`` (completions per optimizer step / median step), ``reward_curve`` (the
logged reward of every step, posttrain runs) and, for server runs, ``server_cpu_s_per_step`` and
``worker_cpu_s_per_step`` (CPU of the other processes over the timed steps, per step), so a loaded machine's share of the
time can be told apart from the work done. All processes use one torch thread.

Usage::

    .venv/bin/python benchmarks/bench_async_grpo.py [--configs grpo,grpo_realistic] [--steps 6] [--warmup 2]
        [--impls sync,async,trl] [--trl-python PATH] [--out results.jsonl]

Compare ratios between runs made at the same moment, not absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.__main__ import POSTTRAIN_PHASES, TRL_PYTHON, prepare_model  # noqa: E402
from benchmarks.workloads import get_workload  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (0.0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def posttrain_server(model_path: str):
    """``posttrain serve`` in a subprocess on a free loopback port; yields (url, pid); always terminated."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "posttrain.cli.main", "serve", "--model", model_path, "--port", str(port),
           "--device", "cpu", "--log_level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _recording(trainer_cls, sink: dict, warmup: int, server_pid: int | None):
    """``trainer_cls`` that keeps the per-step reward and the server's / rollout worker's CPU time over the timed
    steps (from the end of the warm-up to the end of the run) in ``sink``."""
    from transformers import TrainerCallback

    def pids(trainer) -> dict[str, int]:
        worker = getattr(trainer, "_worker", None)
        return {k: v for k, v in (("server", server_pid), ("worker", worker.pid if worker else None)) if v}

    class Snapshot(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                sink["cpu_start"] = {k: cpu_seconds(p) for k, p in pids(self.trainer).items()}
            if state.global_step == args.max_steps:
                sink["cpu_end"] = {k: cpu_seconds(p) for k, p in pids(self.trainer).items()}

    class Recording(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(Snapshot(self))

        def train(self, *args, **kwargs):
            try:
                return super().train(*args, **kwargs)
            finally:
                sink["reward_curve"] = [round(e["reward"], 4) for e in self.state.log_history if "reward" in e]
                staleness = [e["sample/staleness_max"] for e in self.state.log_history if "sample/staleness_max" in e]
                if staleness:
                    sink["staleness_curve"] = staleness
                    sink["dropped_stale_total"] = getattr(self, "dropped_stale_total", 0)

    return Recording


def run_one(config: str, impl: str, steps: int, warmup: int) -> dict:
    """One timed posttrain run (call in a fresh process)."""
    import posttrain
    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    workload = get_workload(config)
    model_path = prepare_model(workload, workload.model, None)
    common.env_setup(1)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    sink: dict = {}
    with contextlib.ExitStack() as stack:
        server_pid = None
        if impl in ("async", "sync_server"):
            url, server_pid = stack.enter_context(posttrain_server(model_path))
            workload = dataclasses.replace(
                workload, args={**workload.args, "use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": url}
            )
        classes = (AsyncGRPOConfig, AsyncGRPOTrainer) if impl == "async" else (posttrain.GRPOConfig,
                                                                                posttrain.GRPOTrainer)  # fmt: skip
        out = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-async-grpo-"))
        start = time.perf_counter()
        trainer_cls = _recording(classes[1], sink, warmup, server_pid)
        record = common.execute(
            "posttrain", workload, model_path, trainer_classes={"grpo": (classes[0], trainer_cls)},
            phase_targets=POSTTRAIN_PHASES, steps=steps, warmup=warmup, model_name=workload.model, output_dir=out,
            extra={"variant": impl},
        )  # fmt: skip
        begin, end = sink.pop("cpu_start", {}), sink.pop("cpu_end", {})
        for name in sorted(set(begin) & set(end)):
            record[f"{name}_cpu_s_per_step"] = round((end[name] - begin[name]) / steps, 4)
        record["run_wall_s"] = round(time.perf_counter() - start, 2)
    record.update(sink)
    return _with_throughput(record, workload)


def _with_throughput(record: dict, workload) -> dict:
    per_step = workload.args["per_device_train_batch_size"] * workload.args.get("gradient_accumulation_steps", 1)
    record["samples_per_step"] = per_step
    record["samples_per_s"] = round(per_step / record["median_step_s"], 3)
    record["samples_per_cpu_s"] = round(per_step / max(record["median_step_cpu_s"], 1e-9), 3)
    return record


def run_trl(config: str, steps: int, warmup: int, trl_python: Path) -> dict:
    workload = get_workload(config)
    model_path = prepare_model(workload, workload.model, None)
    cmd = [str(trl_python), "-m", "benchmarks.trl_runner", "--config", config, "--model-path", model_path,
           "--model-name", workload.model, "--steps", str(steps), "--warmup", str(warmup), "--threads", "1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"TRL run failed ({done.returncode}): {done.stderr[-2000:]}")
    record = common.parse_record(done.stdout)
    record["variant"] = "trl"
    return _with_throughput(record, workload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="grpo,grpo_realistic")
    parser.add_argument("--impls", default="sync,async,trl", help="Any of sync, sync_server, async, trl.")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trl-python", type=Path, default=Path(os.environ.get("TRL_PYTHON", TRL_PYTHON)))
    parser.add_argument("--out", type=Path, default=None, help="Append the records to this JSONL file.")
    parser.add_argument("--single", nargs=2, metavar=("CONFIG", "IMPL"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.single:
        common.emit(run_one(*opts.single, opts.steps, opts.warmup))
        return
    for config in opts.configs.split(","):
        for impl in opts.impls.split(","):
            try:
                if impl == "trl":
                    if not opts.trl_python.exists():
                        print(json.dumps({"config": config, "variant": "trl", "skipped": f"no {opts.trl_python}"}))
                        continue
                    record = run_trl(config, opts.steps, opts.warmup, opts.trl_python)
                else:
                    cmd = [sys.executable, __file__, "--single", config, impl, "--steps", str(opts.steps),
                           "--warmup", str(opts.warmup)]  # fmt: skip
                    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
                    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise RuntimeError(done.stderr.strip()[-2000:])
                    record = common.parse_record(done.stdout)
            except Exception as err:
                record = {"config": config, "variant": impl, "error": str(err)[-2000:]}
            line = json.dumps(record)
            print(line, flush=True)
            if opts.out is not None:
                with opts.out.open("a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
