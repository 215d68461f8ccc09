"""Sandboxed code execution throughput: how many short programs per second ``code_reward`` can judge.

Runs ``--executions`` small assert-style programs (a GRPO batch of code completions) through ``CodeReward`` with
``--max-workers`` concurrent sandboxes, and the same number of bare ``python -I -S -c pass`` subprocesses for
reference. Prints one JSON line: executions/second, the isolation level, and the sandbox/bare-interpreter time ratio
(compare ratios, not absolute numbers, on shared machines).

    .venv/bin/python benchmarks/bench_sandbox.py [--executions 32] [--max-workers 4] [--isolation auto]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from posttrain.rewards import get_code_reward, sandbox_capabilities

SOLUTION = (
    "```python\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n```"
)
TESTS = ["assert fib(0) == 0", "assert fib(10) == 55", "assert fib(30) == 832040"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=32)
    parser.add_argument("--max-workers", type=int, default=None)
    parser.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "basic"])
    args = parser.parse_args()

    reward = get_code_reward(timeout=10.0, max_workers=args.max_workers, isolation=args.isolation)
    reward([SOLUTION], tests=[TESTS])  # warm up: capability probe, thread pool

    start = time.perf_counter()
    scores = reward([SOLUTION] * args.executions, tests=[TESTS] * args.executions)
    sandbox_s = time.perf_counter() - start
    if scores != [1.0] * args.executions:
        raise SystemExit(f"unexpected scores: {scores}")

    def bare(_: int) -> None:
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)

    start = time.perf_counter()
    with ThreadPoolExecutor(reward.max_workers) as pool:
        list(pool.map(bare, range(args.executions)))
    bare_s = time.perf_counter() - start

    print(
        json.dumps(
            {
                "benchmark": "sandbox",
                "isolation": sandbox_capabilities()["isolation"] if args.isolation == "auto" else args.isolation,
                "executions": args.executions,
                "max_workers": reward.max_workers,
                "executions_per_second": round(args.executions / sandbox_s, 2),
                "bare_interpreter_per_second": round(args.executions / bare_s, 2),
                "sandbox_over_bare_time_ratio": round(sandbox_s / bare_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
