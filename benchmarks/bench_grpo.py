"""GRPO step time, generation time share and peak memory, for both generation backends, tiny and big vocabulary.

Runs the harness's ``grpo`` workload (G=8, 16 completions per step, 32 new tokens; see benchmarks/README.md) with
``generation_backend="posttrain"`` (posttrain's group sampler) and ``"transformers"`` (``model.generate``), on the
``tiny`` and the ``bigvocab`` (151 936-row vocabulary) models. Each run is a fresh process (its own peak RSS) and
prints the harness's JSON line plus ``generation_backend``; the fields that answer the question are
``median_step_s``, ``generation_share`` and ``peak_rss_mib``.

Usage::

    .venv/bin/python benchmarks/bench_grpo.py [--steps 5] [--warmup 1] [--models tiny,bigvocab]
                                              [--backends posttrain,transformers] [--config grpo]

Compare ratios between runs (same machine, same moment), not absolute times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.__main__ import POSTTRAIN_PHASES, posttrain_trainer_classes, prepare_model  # noqa: E402
from benchmarks.workloads import get_workload  # noqa: E402


def run_one(config: str, model: str, backend: str, steps: int, warmup: int, threads: int) -> dict:
    """One timed run of ``config`` with ``generation_backend=backend`` (call in a fresh process)."""
    base = get_workload(config)
    workload = dataclasses.replace(base, args={**base.args, "generation_backend": backend})
    model_path = prepare_model(workload, model, None)
    common.env_setup(threads)
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as out:
        return common.execute(
            "posttrain",
            workload,
            model_path,
            trainer_classes=posttrain_trainer_classes(),
            phase_targets=POSTTRAIN_PHASES,
            steps=steps,
            warmup=warmup,
            model_name=model,
            output_dir=out,
            extra={"generation_backend": backend},
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="grpo", help="A GRPO/RLOO workload of benchmarks/workloads.py.")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="tiny,bigvocab")
    parser.add_argument("--backends", default="posttrain,transformers")
    parser.add_argument("--single", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.single:
        common.emit(run_one(opts.config, *opts.single, opts.steps, opts.warmup, opts.threads))
        return
    for model in opts.models.split(","):
        for backend in opts.backends.split(","):
            cmd = [sys.executable, __file__, "--single", model, backend, "--config", opts.config,
                   "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--threads", str(opts.threads)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
            done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
                print(json.dumps({"config": opts.config, "model": model, "generation_backend": backend,
                                  "error": tail[0]}), flush=True)  # fmt: skip
                continue
            print(json.dumps(common.parse_record(done.stdout)), flush=True)


if __name__ == "__main__":
    main()
