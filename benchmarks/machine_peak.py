"""This machine's limits for the fraction-of-peak tables: fp32 matmul GFLOP/s and memory bandwidth, per thread count.

- ``matmul_gflops``: ``torch.mm`` of square fp32 matrices (MKL's sgemm here), 2·n³ FLOP per call, best of
  ``--repeats`` timed calls after a warm-up — the training peak a transformer's linear layers can reach.
- ``read_gbs``: ``torch.sum`` over a 512 MiB fp32 tensor (read only) — the bound for decoding, which reads every
  weight once per generated token (per batch of rows decoded together).
- ``copy_gbs``: ``dst.copy_(src)`` of 512 MiB, counted as bytes read + written.

Best-of-repeats because the machine may be shared: the best call is the one least disturbed by other work; with one
thread the clock is the thread's CPU time (time spent descheduled does not count). Other processes still share the
caches and the memory bus, so on a busy machine even the best can be low; compare with an idle machine (same command).

    python benchmarks/machine_peak.py --threads 1 2 > /tmp/peak.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _best_seconds(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()  # warm-up: page faults, MKL's first-call setup
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def measure(
    threads: int, repeats: int = 5, matmul_n: tuple[int, ...] = (512, 1024, 2048), stream_mib: int = 512
) -> dict[str, Any]:
    """Peak fp32 matmul GFLOP/s (best size) and read/copy bandwidth in GB/s with ``threads`` torch threads."""
    import torch

    torch.set_num_threads(threads)
    # one thread: this thread's CPU time, which a descheduling by other processes does not inflate
    clock = time.thread_time if threads == 1 else time.perf_counter
    out: dict[str, Any] = {"threads": threads, "clock": clock.__name__, "matmul_gflops_by_n": {}}
    for n in matmul_n:
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        seconds = _best_seconds(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), repeats, clock)
        out["matmul_gflops_by_n"][n] = round(2 * n**3 / seconds / 1e9, 1)
    out["matmul_gflops"] = max(out["matmul_gflops_by_n"].values())
    numel = stream_mib * 2**20 // 4  # far above the last-level cache
    src, dst = torch.ones(numel), torch.empty(numel)
    out["read_gbs"] = round(numel * 4 / _best_seconds(lambda: src.sum(), repeats, clock) / 1e9, 2)
    out["copy_gbs"] = round(2 * numel * 4 / _best_seconds(lambda: dst.copy_(src), repeats, clock) / 1e9, 2)
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for threads in args.threads:
        print(json.dumps(measure(threads, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
