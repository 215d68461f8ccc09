"""Wall and CPU time of one command under thread-setting variants, interleaved, optionally beside busy processes.

Item 4 of issue 41: on a 2-core machine shared with other work, ``posttrain demo`` used ~3x the CPU it uses on an
idle machine. Threads that spin while they wait (OpenMP's default wait policy) burn CPU that only shows when the
cores are shared. This runs a command (default ``posttrain demo --quick``) once per variant per round, variants
interleaved so machine load drifts evenly over them, and reports each run's wall seconds and CPU seconds (user + sys
of the child and everything it waited for, from ``os.wait4``), and the one-minute load average when it started.

    python benchmarks/bench_threads.py --runs 3 --variants default OMP_WAIT_POLICY=PASSIVE OMP_WAIT_POLICY=ACTIVE
    python benchmarks/bench_threads.py --runs 3 --load 2 --variants default OMP_WAIT_POLICY=PASSIVE   # 2 busy loops

A variant is ``default`` (the environment as is, minus the variables other variants set) or
``NAME=VALUE[,NAME=VALUE...]``. Output: one JSON line per run, then a markdown table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _variant_env(variant: str, names: set[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in names}
    if variant != "default":
        env.update(item.split("=", 1) for item in variant.split(","))
    return env


def run_once(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``command``; wall seconds, CPU seconds (user + sys of it and its children) and its exit code."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {proc.returncode}):\n{err[-2000:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "load_1m": round(load, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["default", "OMP_WAIT_POLICY=PASSIVE"])
    parser.add_argument("--runs", type=int, default=3, help="rounds; each runs every variant once")
    parser.add_argument("--load", type=int, default=0, help="busy-looping processes kept running during the runs")
    parser.add_argument("command", nargs="*", help="the command (default: posttrain demo --quick into a temp dir)")
    args = parser.parse_args(argv)
    names = {item.split("=", 1)[0] for v in args.variants if v != "default" for item in v.split(",")}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the busy loops (finally below)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    try:
        for round_ in range(args.runs):
            for variant in args.variants:
                with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
                    command = args.command or [
                        sys.executable,
                        *("-m", "posttrain.cli.main", "demo", "--quick", "--output_dir", tmp),
                    ]
                    record = {"variant": variant, "round": round_, "busy_loops": args.load}
                    record.update(run_once(command, _variant_env(variant, names)))
                print(json.dumps(record), flush=True)
                results[variant].append(record)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    print(f"\n| variant (busy loops: {args.load}) | wall s (median) | CPU s (median) | CPU / wall | runs |")
    print("|---|---|---|---|---|")
    for variant, rows in results.items():
        wall = statistics.median(r["wall_s"] for r in rows)
        cpu = statistics.median(r["cpu_s"] for r in rows)
        print(f"| {variant} | {wall:.1f} | {cpu:.1f} | {cpu / wall:.2f} | {len(rows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
