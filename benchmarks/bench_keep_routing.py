"""The cost of MoE routing replay (``keep_routing``) on a GRPO step: step time and peak memory, on vs off.

Each run is a fresh process training a Qwen3-MoE built here (random weights, nothing downloaded; default: hidden
256, 4 layers, 16 experts, top-4, expert width 256, the tiny byte-level tokenizer) with GRPO on posttrain's group
sampler for ``--steps`` steps, ``keep_routing`` on or off; the first ``--warmup`` steps are not timed. Runs alternate
in ABBA order per round, so drift of a shared machine cancels. A run prints one JSON line: the median step wall
time, the peak RSS of the process (``ru_maxrss``), and the bytes of the routing the batch carried. The summary line
gives the on/off ratio of the medians over rounds and the peak-RSS difference.

``--micro`` times the training forward + backward alone on one sampled batch, replay on and off alternating in one
process (the hooks' own cost without the generation's variance).

``--wire`` measures what the routing costs over ``posttrain serve`` (``return_routing``): the server runs in this
process on 127.0.0.1, the same seeded ``/v1/completions`` request is sent with and without ``return_routing``
alternating (``--reps`` pairs); it reports the response bytes, the routing's bytes per token (raw and base64) and the
median CPU time of a request (server and client: one process), and, computed, the bytes per token of a real
Qwen3-30B-A3B's shape (48 MoE layers × top-8).

Run: ``python benchmarks/bench_keep_routing.py [--rounds 3] [--steps 6] [--warmup 2] [--device cpu|cuda]``,
``python benchmarks/bench_keep_routing.py --micro [--reps 20]`` and ``python benchmarks/bench_keep_routing.py
--wire [--reps 20]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _build_model(args: argparse.Namespace):
    """The benchmark's tiny Qwen3-MoE (shape from the command line) and its byte-level tokenizer."""
    from posttrain.models.tiny import build_tiny_moe_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_moe_model(
        "qwen3_moe", num_experts=args.experts, num_experts_per_tok=args.top_k, hidden_size=args.hidden,
        num_layers=args.layers, num_heads=8, num_kv_heads=4, expert_intermediate_size=args.hidden, tokenizer=tokenizer,
    )  # fmt: skip
    return model, tokenizer


def child(args: argparse.Namespace) -> dict:
    import resource

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    model, tokenizer = _build_model(args)
    times: list[float] = []
    cpu_times: list[float] = []
    routing_bytes: list[int] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if args.device == "cuda":
                torch.cuda.synchronize()
            self.start = time.perf_counter()
            self.cpu_start = time.process_time()

        def on_step_end(self, *a, **k):
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)
            cpu_times.append(time.process_time() - self.cpu_start)

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
            per_device_train_batch_size=args.batch, num_generations=args.generations,
            max_completion_length=args.completion_length, max_steps=args.steps, learning_rate=1e-5,
            keep_routing=args.keep_routing == "on", use_cpu=args.device == "cpu", write_report=False,
            gradient_checkpointing=args.gradient_checkpointing,
        )  # fmt: skip
        dataset = Dataset.from_list([{"prompt": f"Question {i}: say something."} for i in range(64)])
        trainer = GRPOTrainer(model, lambda completions, **kw: [float(len(c)) for c in completions], config,
                              train_dataset=dataset, processing_class=tokenizer, callbacks=[Timer()])  # fmt: skip
        run = trainer.pipeline.run

        def counted(*a, **k):
            batch = run(*a, **k)
            routing_bytes.append(sum(batch[key].numel() * batch[key].element_size()
                                     for key in ("prompt_routing", "completion_routing") if key in batch))  # fmt: skip
            return batch

        trainer.pipeline.run = counted
        trainer.train()
    timed = times[args.warmup :]
    record = {
        "keep_routing": args.keep_routing,
        "device": args.device,
        "median_step_s": statistics.median(timed),
        "median_step_cpu_s": statistics.median(cpu_times[args.warmup :]),
        "steps_timed": len(timed),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "routing_bytes_per_batch": max(routing_bytes, default=0),
    }
    if args.device == "cuda":
        record["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return record


def micro(args: argparse.Namespace) -> dict:
    """The training forward + backward alone (``completion_token_stats`` on one sampled batch), with and without the
    routing replayed, alternating within one process (``--reps`` pairs): the replay hooks' own cost, free of the
    generation's variance."""
    import torch

    from posttrain.generation.base import SamplingConfig
    from posttrain.generation.group_sampler import GroupSampler
    from posttrain.models.completion_scoring import completion_token_stats
    from posttrain.rollout.pipeline import collate_completions

    torch.set_num_threads(args.threads)
    model, tokenizer = _build_model(args)
    model = model.to(args.device)
    prompts = [tokenizer(f"Question {i}: say something.").input_ids for i in range(args.batch // args.generations)]
    sampler = GroupSampler(model, record_routing=True, generator=torch.Generator(args.device).manual_seed(0))
    sampling = SamplingConfig(max_new_tokens=args.completion_length, eos_token_ids=[-1], pad_token_id=0)
    batch = collate_completions(sampler.generate(prompts, sampling, args.generations), pad_token_id=0)
    batch = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if args.gradient_checkpointing:
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain = {k: v for k, v in batch.items() if "routing" not in k}
    times: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(args.reps + 2):
        for mode, data in (("off", plain), ("on", batch)) if rep % 2 == 0 else (("on", batch), ("off", plain)):
            model.zero_grad(set_to_none=True)
            start = time.process_time()
            stats = completion_token_stats(model, data, share_prompts=True)
            (stats.logps * data["completion_mask"]).sum().backward()
            if rep >= 2:  # two warm-up pairs
                times[mode].append(time.process_time() - start)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"micro": True, "fwd_bwd_cpu_s_off": off, "fwd_bwd_cpu_s_on": on, "ratio": on / off, "pairs": args.reps}


def wire(args: argparse.Namespace) -> dict:
    """``return_routing`` over ``posttrain serve``: response bytes and request CPU time with and without it."""
    import base64

    import httpx
    import torch

    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.engine import PosttrainEngine

    torch.set_num_threads(args.threads)
    model, tokenizer = _build_model(args)
    prompts = [tokenizer(f"Question {i}: say something.").input_ids for i in range(args.batch // args.generations)]
    body = {"prompt": prompts, "n": args.generations, "max_tokens": args.completion_length, "temperature": 1.0,
            "seed": 0, "logprobs": 0, "ignore_eos": True}  # fmt: skip
    sizes: dict[str, int] = {}
    times: dict[str, list[float]] = {"on": [], "off": []}
    routing_raw = routing_b64 = tokens = 0
    with serve_in_thread(PosttrainEngine(model, tokenizer, "moe")) as url, httpx.Client(timeout=600) as client:
        for rep in range(args.reps + 2):
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                start = time.process_time()
                resp = client.post(f"{url}/v1/completions", json={**body, "return_routing": mode == "on"})
                resp.raise_for_status()
                data = resp.json()
                if rep >= 2:  # two warm-up pairs
                    times[mode].append(time.process_time() - start)
                sizes[mode] = len(resp.content)
                if mode == "on":
                    wires = data["prompt_routing"] + [c["routing"] for c in data["choices"]]
                    routing_b64 = sum(len(w["data"]) for w in wires)
                    routing_raw = sum(len(base64.b64decode(w["data"])) for w in wires)
                    tokens = sum(len(c["token_ids"]) + len(c["prompt_token_ids"]) for c in data["choices"])
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {
        "wire": True, "layers": args.layers, "top_k": args.top_k, "experts": args.experts,
        "bytes_per_token_raw": args.layers * args.top_k, "response_bytes_off": sizes["off"],
        "response_bytes_on": sizes["on"], "routing_bytes_raw": routing_raw, "routing_bytes_base64": routing_b64,
        "prompt_plus_completion_tokens": tokens, "request_cpu_s_off": off, "request_cpu_s_on": on,
        "request_cpu_ratio": on / off, "pairs": args.reps,
        "qwen3_30b_a3b_bytes_per_token_raw": 48 * 8, "qwen3_30b_a3b_bytes_per_token_base64": 48 * 8 * 4 // 3,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--micro", action="store_true", help="time the training forward + backward alone")
    parser.add_argument("--wire", action="store_true", help="the routing's cost over posttrain serve")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--child", dest="keep_routing", choices=["on", "off"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.micro:
        print(json.dumps(micro(args)), flush=True)
        return
    if args.wire:
        print(json.dumps(wire(args)), flush=True)
        return
    if args.keep_routing is not None:
        print(json.dumps(child(args)), flush=True)
        return
    forwarded = []
    for name, value in vars(args).items():
        if name in ("rounds", "keep_routing", "micro", "reps") or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        forwarded.extend([flag] if value is True else [flag, str(value)])
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for round_index in range(args.rounds):
        order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
        for mode in order:
            out = subprocess.run(
                [sys.executable, __file__, *forwarded, "--child", mode],
                check=True, capture_output=True, text=True, env=dict(os.environ),
            )  # fmt: skip
            record = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode].append(record)
            print(json.dumps(record), flush=True)
    on = statistics.median(r["median_step_s"] for r in results["on"])
    off = statistics.median(r["median_step_s"] for r in results["off"])
    cpu_on = statistics.median(r["median_step_cpu_s"] for r in results["on"])
    cpu_off = statistics.median(r["median_step_cpu_s"] for r in results["off"])
    rss_on = statistics.median(r["peak_rss_mib"] for r in results["on"])
    rss_off = statistics.median(r["peak_rss_mib"] for r in results["off"])
    summary = {
        "summary": True,
        "step_s_off": off,
        "step_s_on": on,
        "step_time_ratio": on / off,
        "step_cpu_s_off": cpu_off,
        "step_cpu_s_on": cpu_on,
        "step_cpu_ratio": cpu_on / cpu_off,
        "peak_rss_mib_off": rss_off,
        "peak_rss_mib_on": rss_on,
        "peak_rss_ratio": rss_on / rss_off,
        "routing_bytes_per_batch": results["on"][0]["routing_bytes_per_batch"],
    }
    if args.device == "cuda":
        cuda_on = statistics.median(r["peak_cuda_mib"] for r in results["on"])
        cuda_off = statistics.median(r["peak_cuda_mib"] for r in results["off"])
        summary.update(peak_cuda_mib_off=cuda_off, peak_cuda_mib_on=cuda_on, peak_cuda_ratio=cuda_on / cuda_off)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
