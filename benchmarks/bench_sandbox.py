"""Sandboxed code execution: per-call overhead and throughput of ``run_python`` / ``code_reward``.

Measures, on this machine:
    - ``per_call_ms``: median wall time of one ``run_python("pass")`` call (serial), i.e. the sandbox's fixed cost;
    - ``bare_interpreter_ms``: median time of a bare ``python -I -S -c pass`` subprocess, for reference;
    - ``overhead_ms``: the difference (what the isolation itself costs per call);
    - ``calls_per_second``: ``code_reward`` judging ``--executions`` small assert-style completions (a GRPO batch)
      with ``--max-workers`` concurrent sandboxes.
Prints one JSON line. Compare numbers from the same machine only (shared machines are noisy).

    .venv/bin/python benchmarks/bench_sandbox.py [--executions 32] [--max-workers 4] [--calls 15] [--isolation auto]
        [--interpreter /usr/bin/python3.11]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from posttrain.rewards import get_code_reward, run_python, sandbox_capabilities

SOLUTION = (
    "```python\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n```"
)
TESTS = ["assert fib(0) == 0", "assert fib(10) == 55", "assert fib(30) == 832040"]


def _median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=32)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=15, help="serial calls for the per-call medians")
    parser.add_argument("--isolation", default="auto")
    parser.add_argument(
        "--interpreter", default=None, help="run this Python in the sandbox (e.g. /usr/bin/python3.11, the CI layout)"
    )
    args = parser.parse_args()
    if args.interpreter:
        from posttrain.rewards import sandbox

        sandbox._python = lambda: args.interpreter
        if hasattr(sandbox, "_python_dirs"):  # its installation is under /usr, already in the sandbox
            sandbox._python_dirs = lambda: []

    first = run_python("pass", isolation=args.isolation)  # warm up: capability probe, seccomp program
    if not first.ok:
        raise SystemExit(f"sandbox run failed: {first.status}: {first.stderr[-500:]}")

    def sandboxed() -> None:
        result = run_python("pass", isolation=args.isolation)
        if not result.ok:
            raise SystemExit(f"sandbox run failed: {result.status}: {result.stderr[-500:]}")

    def bare() -> None:
        subprocess.run([args.interpreter or sys.executable, "-I", "-S", "-c", "pass"], check=True)

    per_call = _median_ms(sandboxed, args.calls)
    bare_ms = _median_ms(bare, args.calls)

    reward = get_code_reward(timeout=10.0, max_workers=args.max_workers, isolation=args.isolation)
    reward([SOLUTION], tests=[TESTS])
    start = time.perf_counter()
    scores = reward([SOLUTION] * args.executions, tests=[TESTS] * args.executions)
    elapsed = time.perf_counter() - start
    if scores != [1.0] * args.executions:
        raise SystemExit(f"unexpected scores: {scores}")

    caps = sandbox_capabilities()
    print(
        json.dumps(
            {
                "benchmark": "sandbox",
                "isolation": caps.get("isolation") if args.isolation == "auto" else args.isolation,
                "cgroup": caps.get("cgroup"),
                "per_call_ms": per_call,
                "bare_interpreter_ms": bare_ms,
                "overhead_ms": round(per_call - bare_ms, 1),
                "executions": args.executions,
                "max_workers": reward.max_workers,
                "calls_per_second": round(args.executions / elapsed, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
