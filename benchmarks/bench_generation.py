"""Generation throughput: posttrain's GroupSampler vs model.generate (TransformersBackend).

GRPO-shaped workload: ``--num-prompts`` prompts (default 2) × ``--num-generations`` G (default 8) = 16 completions of
at most ``--max-new-tokens`` (default 64), every prompt starting with the same ~256-token system prompt, on the tiny
model and on the tiny model with Qwen's 151 936-row vocabulary. Prints one JSON line per timed run (wall and process
CPU seconds) and one summary line per model with the GroupSampler / generate tokens/s ratios of the medians, by wall
and by CPU time (compare ratios, not absolute times, on shared machines; CPU time is the steadier one there).

    .venv/bin/python benchmarks/bench_generation.py [--repeats 3] [--models tiny big_vocab] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from posttrain.generation import GroupSampler, SamplingConfig, TransformersBackend
from posttrain.models.tiny import BIG_VOCAB_SIZE, build_tiny_model, build_tiny_tokenizer

SYSTEM_PROMPT = (
    "You are a careful assistant that solves grade-school math problems. Think step by step inside <think> tags, "
    "check every intermediate result, and keep the reasoning short. After thinking, write the final answer as a "
    "single number inside \\boxed{}."
)
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many clips in total?",
    "Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes of babysitting. How much did she earn?",
    "Betty needs $100 for a wallet. She has half, her parents give $15 and her grandparents twice that. Left?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
]


def build_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    prompts = []
    for i in range(num_prompts):
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
        ]
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        prompts.append(list(encoded["input_ids"]))
    return prompts


def time_once(backend, prompts, sampling, g: int, seed: int, device: torch.device) -> dict:
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    out = backend.generate(prompts, sampling, num_generations=g)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    row = {
        "seconds": round(seconds, 4),
        "cpu_seconds": round(cpu_seconds, 4),
        "tokens": out.num_tokens,
        "tokens_per_s": round(out.num_tokens / seconds, 1),
        "tokens_per_cpu_s": round(out.num_tokens / max(cpu_seconds, 1e-9), 1),
    }
    if device.type == "cuda":
        row["peak_mem_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "big_vocab"], choices=["tiny", "big_vocab"])
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tokenizer = build_tiny_tokenizer()
    prompts = build_prompts(tokenizer, args.num_prompts)
    sampling = SamplingConfig(
        args.max_new_tokens, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    for model_name in args.models:
        vocab = BIG_VOCAB_SIZE if model_name == "big_vocab" else None
        model = build_tiny_model("qwen2", tokenizer=tokenizer, vocab_size=vocab).to(device).eval()
        backends = {"posttrain": GroupSampler(model, tokenizer), "transformers": TransformersBackend(model, tokenizer)}
        for backend in backends.values():  # warm-up (allocator, kernels)
            backend.generate(prompts, sampling, num_generations=args.num_generations)
        speeds: dict[str, list[float]] = {name: [] for name in backends}
        cpu_speeds: dict[str, list[float]] = {name: [] for name in backends}
        # Interleave the backends so load changes on a shared machine hit both alike.
        for r in range(args.repeats):
            for backend_name, backend in backends.items():
                run = time_once(backend, prompts, sampling, args.num_generations, r, device)
                record = {
                    "bench": "generation",
                    "model": model_name,
                    "backend": backend_name,
                    "device": device.type,
                    "num_generations": args.num_generations,
                    "completions": args.num_prompts * args.num_generations,
                    "max_new_tokens": args.max_new_tokens,
                    "prompt_tokens": [len(p) for p in prompts],
                    **run,
                }
                print(json.dumps(record), flush=True)
                speeds[backend_name].append(run["tokens_per_s"])
                cpu_speeds[backend_name].append(run["tokens_per_cpu_s"])
        median = {name: statistics.median(v) for name, v in speeds.items()}
        cpu_median = {name: statistics.median(v) for name, v in cpu_speeds.items()}
        summary = {
            "bench": "generation",
            "model": model_name,
            "summary": True,
            "tokens_per_s_ratio_posttrain_over_transformers": round(median["posttrain"] / median["transformers"], 3),
            "tokens_per_cpu_s_ratio_posttrain_over_transformers": round(
                cpu_median["posttrain"] / cpu_median["transformers"], 3
            ),
        }
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
