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

``--sampling-mask-ab`` instead measures the cost of ``keep_sampling_mask`` (issue 40): the same workload with
truncated sampling (``--truncation``, default ``top_p=0.8``) and the posttrain backend, mask off and on, in fresh
processes interleaved round by round (off, on, off, on, ...) so load changes on a shared machine hit both alike;
it prints each run and a summary with the on/off ratios of the median step time and of the peak RSS (the median
of the per-round ratios too)::

    .venv/bin/python benchmarks/bench_grpo.py --sampling-mask-ab --config grpo_beta --models tiny,bigvocab \
        --repeats 3 --steps 4 [--truncation '{"top_p": 0.8}']

``--sampling-mask-micro`` times the two places the mask costs, in one process, off and on alternated ``--repeats``
times (process CPU time, one thread: a loaded shared machine moves wall time far more than the mask does): the group
sampler's generation of G=8 × 2 prompts × 32 tokens, and the scoring forward + backward of that batch (the chunked
LM head; tiled on ``bigvocab``), on the tiny model (320-row vocabulary) and ``bigvocab`` (151 936 rows)::

    .venv/bin/python benchmarks/bench_grpo.py --sampling-mask-micro --models tiny,bigvocab --repeats 15
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
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


def run_one(
    config: str, model: str, backend: str, steps: int, warmup: int, threads: int, overrides: dict | None = None
) -> dict:
    """One timed run of ``config`` with ``generation_backend=backend`` and the config ``overrides`` (call in a fresh
    process)."""
    base = get_workload(config)
    workload = dataclasses.replace(base, args={**base.args, "generation_backend": backend, **(overrides or {})})
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
            extra={"generation_backend": backend, **(overrides or {})},
        )


def _subprocess(opts: argparse.Namespace, model: str, backend: str, overrides: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--single", model, backend, "--config", opts.config,
           "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--threads", str(opts.threads)]  # fmt: skip
    if overrides:
        cmd += ["--overrides", json.dumps(overrides)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        return {"config": opts.config, "model": model, "generation_backend": backend, "error": tail[0]}
    return common.parse_record(done.stdout)


def sampling_mask_ab(opts: argparse.Namespace) -> None:
    """keep_sampling_mask off vs on, interleaved fresh processes; one JSON line per run and a summary per model."""
    truncation = json.loads(opts.truncation)
    for model in opts.models.split(","):
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(opts.repeats):
            for keep in (False, True):
                record = _subprocess(opts, model, "posttrain", {**truncation, "keep_sampling_mask": keep})
                print(json.dumps({"round": r, **record}), flush=True)
                if "error" not in record:
                    runs[keep].append(record)
        if not (runs[False] and runs[True]):
            continue
        summary: dict = {"summary": True, "config": opts.config, "model": model, "truncation": truncation}
        for field in ("median_step_s", "median_step_cpu_s", "peak_rss_mib"):
            off = [x[field] for x in runs[False]]
            on = [x[field] for x in runs[True]]
            summary[f"{field}_off"] = statistics.median(off)
            summary[f"{field}_on"] = statistics.median(on)
            summary[f"{field}_ratio_on_over_off"] = round(statistics.median(on) / statistics.median(off), 4)
            summary[f"{field}_median_round_ratio"] = round(statistics.median(b / a for a, b in zip(off, on)), 4)
        print(json.dumps(summary), flush=True)


def sampling_mask_micro(opts: argparse.Namespace) -> None:
    """keep_sampling_mask off vs on inside one process: sampler and scoring CPU time, alternated; JSON lines."""
    import time

    import torch

    from posttrain.generation import GroupSampler, SamplingConfig
    from posttrain.models.completion_scoring import completion_token_stats
    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer
    from posttrain.rollout.pipeline import collate_completions

    torch.set_num_threads(opts.threads)
    truncation = json.loads(opts.truncation)
    tokenizer = build_tiny_tokenizer("left")
    prompts = [tokenizer(f"What is {i} + {3 * i}? Answer:")["input_ids"] for i in range(2)]
    for model_name in opts.models.split(","):
        if model_name not in common.MODEL_SPECS or "vlm" in common.MODEL_SPECS[model_name]:
            raise ValueError(f"--models: {model_name!r} is not a text model of benchmarks/common.py MODEL_SPECS.")
        model = build_tiny_model("qwen2", tokenizer=tokenizer, **common.MODEL_SPECS[model_name])
        times: dict[str, dict[bool, list[float]]] = {"generate": {False: [], True: []}, "score": {False: [], True: []}}
        batches = {}
        for r in range(opts.repeats + 1):  # round 0 warms up
            for keep in (False, True) if r % 2 else (True, False):
                sampling = SamplingConfig(32, eos_token_ids=[-1], pad_token_id=tokenizer.pad_token_id,
                                          return_sampling_mask=keep, **truncation)  # fmt: skip
                sampler = GroupSampler(model, generator=torch.Generator().manual_seed(r))
                model.eval()
                start = time.process_time()
                out = sampler.generate(prompts, sampling, 8)
                batch = collate_completions(out, pad_token_id=tokenizer.pad_token_id)
                generate_s = time.process_time() - start
                if keep:  # score the same tokens both ways (the off run without the mask), in alternating order
                    batches = {True: batch, False: {k: v for k, v in batch.items() if not k.startswith("sampling_mask")}}
                    model.train()
                    for variant in (False, True) if r % 2 else (True, False):  # alternate which goes first
                        model.zero_grad(set_to_none=True)
                        start = time.process_time()
                        stats = completion_token_stats(model, batches[variant], compute_entropy=True, share_prompts=True)
                        stats.logps.sum().backward()
                        if r:
                            times["score"][variant].append(time.process_time() - start)
                if r:
                    times["generate"][keep].append(generate_s)
        summary: dict = {"bench": "sampling_mask_micro", "model": model_name, "truncation": truncation,
                         "repeats": opts.repeats, "threads": opts.threads}  # fmt: skip
        for part, by_keep in times.items():
            off, on = statistics.median(by_keep[False]), statistics.median(by_keep[True])
            summary[f"{part}_cpu_s_off"], summary[f"{part}_cpu_s_on"] = round(off, 5), round(on, 5)
            summary[f"{part}_ratio_on_over_off"] = round(on / off, 4)
        print(json.dumps(summary), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="grpo", help="A GRPO/RLOO workload of benchmarks/workloads.py.")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="tiny,bigvocab")
    parser.add_argument("--backends", default="posttrain,transformers")
    parser.add_argument("--sampling-mask-ab", action="store_true", help="keep_sampling_mask off vs on (see above).")
    parser.add_argument("--sampling-mask-micro", action="store_true", help="keep_sampling_mask, in-process (above).")
    parser.add_argument("--truncation", default='{"top_p": 0.8}', help="JSON: the truncation knobs of the A/B.")
    parser.add_argument("--repeats", type=int, default=3, help="Rounds of the A/B (each: one off, one on run).")
    parser.add_argument("--single", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.single:
        overrides = json.loads(opts.overrides) if opts.overrides else None
        common.emit(run_one(opts.config, *opts.single, opts.steps, opts.warmup, opts.threads, overrides))
        return
    if opts.sampling_mask_ab:
        sampling_mask_ab(opts)
        return
    if opts.sampling_mask_micro:
        sampling_mask_micro(opts)
        return
    for model in opts.models.split(","):
        for backend in opts.backends.split(","):
            print(json.dumps(_subprocess(opts, model, backend)), flush=True)


if __name__ == "__main__":
    main()
