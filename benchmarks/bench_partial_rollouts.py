"""AsyncGRPO partial rollouts vs whole rounds on a long-tail workload; bytes per weight push, full vs adapter-only.

Workload (``long_tail``): the tiny offline Qwen2 model (``posttrain.models.tiny``) behind a ``posttrain serve``
subprocess, 64 prompts, G = 4, 2 prompts per round (8 completions per optimizer step), ``max_completion_length``
256, and a stop set (``generation_kwargs={"eos_token_id": [...]}``: 6 of the byte vocabulary's ids end a completion,
~2 % per sampled token), so completion lengths are geometric: half stop within ~35 tokens, a tenth run past ~115,
some to the 256-token cap (10× and more between a round's short and long rows); a whole round waits for its
longest row. Reward: the fraction of
upper-case letters in the completion (independent of length, so both variants optimise the same thing).

Variants, each in a fresh process (server, rollout worker and trainer at one torch thread each):

- ``whole``: AsyncGRPO as shipped — each round is generated whole (waits for its longest completion);
- ``partial``: ``partial_rollout_max_tokens=32`` (passes of at most 16 new tokens; finished groups train at once,
  cut ones continue under the next weights);
- ``lora_full`` / ``lora_adapter`` (``--bytes``): a LoRA student (r=8, q/k/v/o) pushed merged vs adapter-only
  (``vllm_sync_adapter_only``); the record's ``weight_sync_bytes`` is the logged ``perf/weight_sync_bytes``.

Every record: ``median_step_s`` (wall time between optimizer steps after the warm-up), ``samples_per_s``
(completions per step / median step), ``completion_tokens_per_s`` (completion tokens trained per second over the
timed steps), ``num_tokens_per_s`` (the logged ``num_tokens``, prompt + completion tokens, per second),
``server_cpu_s_per_step`` / ``server_cpu_s_per_1k_tokens`` (the server's CPU time over the timed steps, from
``/proc``: generation work, which a loaded machine inflates far less than wall time), ``reward_curve`` (per step), ``reward_mean`` (over the timed steps), ``completion_len_p50/p90/max``, and for partial
runs the version-lag distribution (``lag_mean``, ``lag_max``, ``lag_frac``). Runs alternate between variants (ABAB
per round), so drift of a shared machine falls on both.

Usage::

    python benchmarks/bench_partial_rollouts.py [--variants whole,partial] [--rounds 2] [--steps 12] [--warmup 2]
        [--ahead 1] [--bytes] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.bench_async_grpo import cpu_seconds, posttrain_server  # noqa: E402

STOP_IDS = list(range(48, 54))  # the digits 0-5: ~2 % of the tiny model's samples stop
PROMPTS = 64
MAX_COMPLETION = 256
PARTIAL_TOKENS = 32


def upper_frac_reward(completions, **kwargs):
    """Fraction of upper-case letters in each completion (length-independent)."""
    return [sum(ch.isupper() for ch in c) / max(1, len(c)) for c in completions]


def _model_path() -> str:
    from posttrain.models.tiny import save_tiny_model

    path = Path(os.environ.get("POSTTRAIN_BENCH_CACHE", "/tmp/posttrain-benchmarks")) / "partial-rollouts-tiny"
    if not (path / "config.json").is_file():
        save_tiny_model(path, arch="qwen2")
    return str(path)


def run_one(variant: str, steps: int, warmup: int, ahead: int = 1) -> dict:
    """One timed run of ``variant`` (call in a fresh process); ``ahead``: rounds the worker may run ahead of the
    server's weights (``max_inflight_tasks = ahead × 8``; -1: TRL's auto, ``max_staleness`` rounds)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    common.env_setup(1)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    model_path = _model_path()
    stamps: list[float] = []
    server_cpu: list[float] = []  # the server's CPU seconds at each step end (generation work, load-independent)

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())
            server_cpu.append(cpu_seconds(server_pid))

    dataset = Dataset.from_list([{"prompt": f"Question {i}: say something"} for i in range(PROMPTS)])
    extra: dict = {}
    peft_config = None
    if variant.startswith("lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        extra["vllm_sync_adapter_only"] = variant == "lora_adapter"
    if variant in ("partial", "lora_full", "lora_adapter"):
        extra["partial_rollout_max_tokens"] = PARTIAL_TOKENS
    with contextlib.ExitStack() as stack:
        url, server_pid = stack.enter_context(posttrain_server(model_path))
        out = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-partial-"))
        args = AsyncGRPOConfig(
            output_dir=out, report_to="none", write_report=False, disable_tqdm=True, save_strategy="no",
            logging_steps=1, max_steps=steps + warmup, per_device_train_batch_size=8, num_generations=4,
            max_completion_length=MAX_COMPLETION, learning_rate=1e-2, temperature=1.0, seed=0,
            vllm_server_base_url=url, max_staleness=4, generation_kwargs={"eos_token_id": STOP_IDS},
            max_inflight_tasks=-1 if ahead < 0 else 8 * ahead,
            gradient_checkpointing=False, **extra,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(model_path, upper_frac_reward, args, train_dataset=dataset, peft_config=peft_config)
        trainer.add_callback(Stamp())
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    logs = trainer.state.log_history
    steps_logs = [e for e in logs if "reward" in e]
    timed = stamps[warmup:]
    gaps = [b - a for a, b in zip(timed, timed[1:])]
    median = statistics.median(gaps)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    tokens = [e["num_tokens"] for e in steps_logs]
    record = {
        "benchmark": "partial_rollouts", "variant": variant, "steps": steps, "warmup": warmup, "ahead": ahead,
        "median_step_s": round(median, 4), "samples_per_s": round(per_step / median, 3),
        "num_tokens_per_s": round((tokens[-1] - tokens[warmup]) / max(1e-9, timed[-1] - timed[0]), 1),
        "reward_curve": [round(e["reward"], 4) for e in steps_logs],
        "reward_mean": round(statistics.fmean(e["reward"] for e in steps_logs[warmup:]), 4),
        "completion_mean_len": round(statistics.fmean(e["completions/mean_length"] for e in steps_logs[warmup:]), 2),
        # completion tokens trained per second over the timed steps (steps warmup+1 .. end: the gaps measured)
        "completion_tokens_per_s": round(
            sum(e["completions/mean_length"] * per_step for e in steps_logs[warmup + 1 :])
            / max(1e-9, timed[-1] - timed[0]),
            1,
        ),
        "completion_max_len": max(e["completions/max_length"] for e in steps_logs),
        "completion_min_len": min(e["completions/min_length"] for e in steps_logs),
        "dropped_stale_total": steps_logs[-1].get("sample/dropped_stale_total", 0),
        "run_wall_s": round(wall, 2),
        # generation work: the server's CPU seconds per timed step and per 1000 completion tokens trained
        "server_cpu_s_per_step": round((server_cpu[-1] - server_cpu[warmup]) / max(1, len(timed) - 1), 4),
    }  # fmt: skip
    trained_tokens = sum(e["completions/mean_length"] * per_step for e in steps_logs[warmup + 1 :])
    record["server_cpu_s_per_1k_tokens"] = round(
        1000 * (server_cpu[-1] - server_cpu[warmup]) / max(1, trained_tokens), 4
    )
    syncs = [e["perf/weight_sync_bytes"] for e in logs if "perf/weight_sync_bytes" in e]
    if syncs:
        record["weight_sync_bytes"] = int(statistics.median(syncs))
    lags = [e for e in logs if "sample/version_lag_frac/0" in e][warmup:]
    if lags:
        record["lag_mean"] = round(statistics.fmean(e["sample/staleness_mean"] for e in lags), 3)
        record["lag_max"] = max(e["sample/staleness_max"] for e in lags)
        record["lag_frac"] = {
            k: round(statistics.fmean(e[f"sample/version_lag_frac/{k}"] for e in lags), 3)
            for k in range(args.max_staleness + 1)
        }
        record["continued_frac"] = round(statistics.fmean(e["rollout/partial_continued_frac"] for e in lags), 3)
        record["regenerated_groups_total"] = lags[-1]["rollout/partial_regenerated_groups_total"]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="whole,partial", help="Any of whole, partial, lora_full, lora_adapter.")
    parser.add_argument("--rounds", type=int, default=2, help="Interleaved rounds (each runs every variant once).")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ahead", type=int, default=1, help="Rounds the worker may run ahead (-1: TRL's auto).")
    parser.add_argument("--bytes", action="store_true", help="Also run lora_full and lora_adapter once (3 steps).")
    parser.add_argument("--out", type=Path, default=None, help="Append the records to this JSONL file.")
    parser.add_argument("--single", metavar="VARIANT", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.single:
        common.emit(run_one(opts.single, opts.steps, opts.warmup, opts.ahead))
        return
    plan = [(v, opts.steps, opts.warmup) for _ in range(opts.rounds) for v in opts.variants.split(",")]
    if opts.bytes:
        plan += [("lora_full", 3, 1), ("lora_adapter", 3, 1)]
    for variant, steps, warmup in plan:
        cmd = [sys.executable, __file__, "--single", variant, "--steps", str(steps), "--warmup", str(warmup),
               "--ahead", str(opts.ahead)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            record = {"variant": variant, "error": done.stderr.strip()[-2000:]}
        else:
            record = common.parse_record(done.stdout)
        line = json.dumps(record)
        print(line, flush=True)
        if opts.out is not None:
            with opts.out.open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
