"""``posttrain serve --data_parallel_size N``: N engine replicas on one machine, one process each.

Replica ``i`` is a plain ``posttrain serve`` (the same options) on port ``port + i`` with seed ``seed + i``, so a
trainer reaches the fleet with ``vllm_server_base_urls=[http://host:port, http://host:port+1, ...]``: the server
pool (``posttrain.generation.server_pool``) keeps each group's G completions on one replica, pushes every weight
update to all of them and verifies each, and drops a replica that dies. Replicas, not one front URL: the pool
already does the routing, the weight fan-out and the failure handling a front would have to repeat, and a
replica's failure stays visible to the trainer instead of hiding behind a proxy.

Placement: with CUDA and ``--device auto``, replica ``i`` sees GPUs ``[i*tp, (i+1)*tp)`` (``tp`` =
``--tensor_parallel_size``) through ``CUDA_VISIBLE_DEVICES`` when the machine has ``N*tp`` of them; on CPU the
replicas share the cores, each with ``cpu_count // N`` torch threads unless ``OMP_NUM_THREADS`` is set.

The launcher supervises: SIGTERM/SIGINT is forwarded to every replica (each shuts down gracefully), and a
replica that exits on its own takes the others down and makes the launcher exit non-zero, naming it. Every wait
is bounded by ``--graceful_timeout`` plus a margin, after which replicas are killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

_KILL_MARGIN_S = 10.0


@dataclass(frozen=True)
class ReplicaPlan:
    """Where replica ``index`` listens and what it sees."""

    index: int
    port: int
    seed: int
    env: dict[str, str]


def plan_replicas(args: Any, environ: dict[str, str] | None = None, cuda_devices: int | None = None) -> list[ReplicaPlan]:
    """The replicas ``args.data_parallel_size`` asks for: ports, seeds and environments (pure; tested directly).

    Args:
        args: The parsed serve arguments (``data_parallel_size``, ``port``, ``seed``, ``device``,
            ``tensor_parallel_size``).
        environ: The launcher's environment (default ``os.environ``).
        cuda_devices: Number of visible CUDA devices (default: torch's count).
    """
    n = int(args.data_parallel_size)
    if n < 1:
        raise ValueError(f"--data_parallel_size must be >= 1, got {n}.")
    if args.port == 0:
        raise ValueError(
            "--port 0 cannot be combined with --data_parallel_size > 1: replicas listen on consecutive ports "
            "port, port+1, ...; give a fixed --port."
        )
    if args.port + n - 1 > 65535:
        raise ValueError(f"--port {args.port} + --data_parallel_size {n} runs past port 65535; choose a lower --port.")
    environ = dict(os.environ if environ is None else environ)
    if cuda_devices is None:
        import torch

        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tp = max(1, int(getattr(args, "tensor_parallel_size", 1) or 1))
    device = getattr(args, "device", "auto")
    split_gpus = cuda_devices >= n * tp and device in ("auto", "cuda") and "CUDA_VISIBLE_DEVICES" not in environ
    threads = max(1, (os.cpu_count() or 1) // n)
    plans = []
    for i in range(n):
        env = dict(environ)
        if split_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(i * tp, (i + 1) * tp))
        if "OMP_NUM_THREADS" not in environ:
            env["OMP_NUM_THREADS"] = str(threads)
        plans.append(ReplicaPlan(index=i, port=args.port + i, seed=args.seed + i, env=env))
    return plans


def replica_command(verb: str, argv: list[str], plan: ReplicaPlan) -> list[str]:
    """The command line of one replica: the launcher's own options, then the replica's port, seed and size 1
    (argparse keeps the last occurrence, so they win over the user's and over a ``--config`` recipe)."""
    return [
        sys.executable, "-m", "posttrain.cli.main", verb, *argv,
        "--port", str(plan.port), "--seed", str(plan.seed), "--data_parallel_size", "1",
    ]  # fmt: skip


def run_replicas(verb: str, argv: list[str], args: Any) -> int:
    """Start the replicas, print their URLs, and supervise them until a signal or a replica's exit."""
    plans = plan_replicas(args)
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    previous = {}

    def on_signal(signum, frame):  # noqa: ARG001 — signal handler signature
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, on_signal)
    exit_code = 0
    try:
        for plan in plans:
            procs.append(subprocess.Popen(replica_command(verb, argv, plan), env=plan.env))
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        urls = [f"http://{host}:{plan.port}" for plan in plans]
        for plan, proc in zip(plans, procs):
            print(f"posttrain {verb}: replica {plan.index} (pid {proc.pid}) on {urls[plan.index]}", file=sys.stderr,
                  flush=True)  # fmt: skip
        print(f"posttrain {verb}: {len(plans)} replicas; train with vllm_server_base_urls={urls}", file=sys.stderr,
              flush=True)  # fmt: skip
        while not stop.wait(0.5):
            dead = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                i, code = dead[0]
                print(f"posttrain {verb}: replica {i} on {urls[i]} exited with code {code}; stopping the other "
                      "replicas.", file=sys.stderr, flush=True)  # fmt: skip
                exit_code = 1
                break
    finally:
        _stop_all(procs, float(getattr(args, "graceful_timeout", 30.0)) + _KILL_MARGIN_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code


def _stop_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every live replica, wait up to ``timeout`` seconds for all, then SIGKILL the rest."""
    import time

    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_KILL_MARGIN_S)
