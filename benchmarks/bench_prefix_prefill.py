"""Generation A/B of the group sampler's shared-prefix prefill on ``grpo_long``'s prompts.

``grpo_long`` samples G = 8 completions of 32 tokens for each of 2 distinct prompts per step, both starting with the
same ≈ 437-token system prompt and chat-template opening. The group sampler prefills that prefix once and each
prompt's ≈ 20-token rest after it (``shared``), or, with the prefix threshold out of reach, both ≈ 458-token
prompts in full as before (``full``: the earlier code path, bit for bit). Each arm runs in a fresh process (one
torch thread), warms up, then times ``GroupSampler.generate`` on the first ``--num-prompts`` prompts of the
workload's dataset (its chat template, add_generation_prompt) by process CPU time and wall time; the driver
alternates the arms (ABBA...) so load changes hit both alike, and prints one JSON line per timed call and a summary
of the medians.

    python benchmarks/bench_prefix_prefill.py --model qwen05b --rounds 2 --repeats 1
    python benchmarks/bench_prefix_prefill.py --model small --rounds 4 --repeats 5
    python benchmarks/bench_prefix_prefill.py --model small --rounds 4 --repeats 5 --prefix-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _prompts(tokenizer, n: int, prefix_tokens: int | None = None) -> list[list[int]]:
    """The workload's first ``n`` prompts; with ``prefix_tokens``, each cut to the last ``prefix_tokens`` tokens of
    their common prefix followed by its own rest (a shorter shared prefix, the same rests)."""
    import posttrain.generation.group_sampler as gs
    from benchmarks.workloads import arithmetic_prompts

    rows = arithmetic_prompts(system=True)[:n]
    prompts = [
        list(tokenizer.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True, return_dict=True)
             ["input_ids"])
        for r in rows
    ]  # fmt: skip
    if prefix_tokens is None:
        return prompts
    threshold, gs.SHARED_PREFIX_MIN_TOKENS = gs.SHARED_PREFIX_MIN_TOKENS, 1
    common = gs._shared_prefix_length(prompts)
    gs.SHARED_PREFIX_MIN_TOKENS = threshold
    if not 1 <= prefix_tokens <= common:
        raise SystemExit(f"--prefix-tokens must be in [1, {common}] (the prompts' common prefix), got {prefix_tokens}.")
    return [p[common - prefix_tokens :] for p in prompts]


def run_arm(args: argparse.Namespace) -> None:
    """One process: load the model, warm up, time ``--repeats`` generate calls of ``args.arm``."""
    from benchmarks.common import emit, ensure_model, env_setup, load_average

    env_setup(args.threads)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import posttrain.generation.group_sampler as gs
    from posttrain.generation import GroupSampler, SamplingConfig

    if args.arm == "full":
        gs.SHARED_PREFIX_MIN_TOKENS = 10**9  # the prefix is never shared: every distinct prompt prefilled in full
    elif args.prefix_tokens is not None:
        gs.SHARED_PREFIX_MIN_TOKENS = 1  # shared whatever its length: where the threshold should sit
    path = ensure_model(args.model, "causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(tokenizer, args.num_prompts, args.prefix_tokens)
    sampling = SamplingConfig(
        args.max_new_tokens, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    sampler = GroupSampler(model, tokenizer, generator=torch.Generator().manual_seed(0))
    for _ in range(args.warmup):
        sampler.generate(prompts, sampling, num_generations=args.num_generations)
    for r in range(args.repeats):
        sampler.generator.manual_seed(r)
        start, cpu_start = time.perf_counter(), time.process_time()
        out = sampler.generate(prompts, sampling, num_generations=args.num_generations)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        emit({
            "bench": "prefix_prefill", "model": args.model, "arm": args.arm, "repeat": r,
            "cpu_seconds": round(cpu, 4), "seconds": round(wall, 4), "load_average": load_average(),
            "completion_tokens": out.num_tokens, "prompt_tokens": [len(p) for p in prompts],
            "shared_prefix_tokens": sampler.last_stats["shared_prefix_tokens"],
            "prefill_tokens": sampler.last_stats["prefill_tokens"], "threads": args.threads,
        })  # fmt: skip


def drive(args: argparse.Namespace) -> None:
    """Alternate the arms in fresh processes (ABBA...), then print the medians and the full / shared ratio."""
    order = []
    for r in range(args.rounds):
        order += ["full", "shared"] if r % 2 == 0 else ["shared", "full"]
    records: dict[str, list[dict]] = {"full": [], "shared": []}
    for arm in order:
        cmd = [sys.executable, __file__, "--arm", arm, "--model", args.model, "--repeats", str(args.repeats),
               "--warmup", str(args.warmup), "--num-prompts", str(args.num_prompts), "--threads", str(args.threads),
               "--num-generations", str(args.num_generations), "--max-new-tokens", str(args.max_new_tokens)]  # fmt: skip
        if args.prefix_tokens is not None:
            cmd += ["--prefix-tokens", str(args.prefix_tokens)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                print(line, flush=True)
                records[arm].append(json.loads(line))
    medians = {arm: statistics.median(r["cpu_seconds"] for r in rows) for arm, rows in records.items()}
    walls = {arm: statistics.median(r["seconds"] for r in rows) for arm, rows in records.items()}
    print(json.dumps({
        "bench": "prefix_prefill", "model": args.model, "summary": True, "runs_per_arm": len(records["full"]),
        "prefix_tokens": args.prefix_tokens, "cpu_seconds_median": medians, "seconds_median": walls,
        "cpu_ratio_shared_over_full": round(medians["shared"] / medians["full"], 3),
    }), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a benchmarks.common.MODEL_SPECS name")
    parser.add_argument("--arm", choices=["full", "shared"], default=None, help="run one arm (default: drive both)")
    parser.add_argument("--rounds", type=int, default=2, help="driver: full/shared process pairs, alternating order")
    parser.add_argument("--repeats", type=int, default=1, help="timed generate calls per process")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--prefix-tokens", type=int, default=None,
        help="keep only this many tokens of the shared prefix (and share it whatever its length): the threshold's A/B",
    )  # fmt: skip
    args = parser.parse_args()
    if args.arm is None:
        drive(args)
    else:
        run_arm(args)


if __name__ == "__main__":
    main()
