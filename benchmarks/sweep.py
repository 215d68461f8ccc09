"""Model-size sweep tables: per-step cost of both libraries, memory against the fp32 Adam floor, distance to the limit.

Reads the JSON lines of ``python -m benchmarks compare`` (one record per run) and of ``benchmarks/machine_peak.py``
(the single-thread fp32 matmul peak and read bandwidth) and prints three markdown tables:

1. per (config, model, library): median step wall and CPU seconds, tokens/s, peak RSS above the interpreter, and
   posttrain's peak RSS over the fp32 Adam floor (params + grads + two moments, with the model itself);
2. per (config, model, library): achieved model FLOP/s as a fraction of the matmul peak for the training part, and
   for GRPO the generation tokens/s per row against its floor (prefill + decode);
3. per (config, model): posttrain / TRL of step CPU, step wall and peak RSS.

FLOP counts are the linear layers' and the LM head's matmuls only (attention scores and element-wise work are left
out: a few per cent at hidden 896 and 512-token sequences, much more on the tiny models, whose fractions are thus
underestimates): ``P`` = per-token matmul parameters, ``6·P`` FLOP per trained token (forward + backward), ``2·P``
per token of a no-grad forward (DPO's reference pass). They are "model FLOPs": the work the step needs at least,
counted the same for both libraries, so recompute (gradient checkpointing) and tokens a layout trains needlessly
lower the fraction. GRPO's trained tokens are every completion token plus each distinct prompt token once (a group's G
completions share one prompt, and the step's prompts share a common prefix — ``grpo_long``'s system prompt, 437 of
≈ 458 tokens, or the chat template's opening; the gradient flows through the prompt's keys and values, so its layers'
forward and backward are needed once per distinct token — not the LM head: a prompt position has no loss):
completions per step × mean length + the shared prefix ``S`` once + each group's rest, groups × (mean prompt − ``S``),
where the mean prompt is (tokens per step − completion tokens) / completions per step and tokens per step (TRL's
``num_tokens``) counts every row's prompt and completion. ``S`` is the common prefix of the workload's prompts under
the sweep models' byte-level tokenizer and chat template (:func:`shared_prompt_prefix`); posttrain's shared-prompt
layout runs exactly that (one pack per micro-batch: the common prefix, each group's rest, each completion).
Training time is the step's CPU time
(the runs use one torch thread, so CPU seconds are the seconds that thread ran, whatever else the machine did) minus,
for GRPO, the generation share.

Generation bound (GRPO): generation needs at least the prefill of the same distinct prompt tokens (``2·P`` FLOP per
token without the LM head, at the matmul peak: the shared prefix once, each group's rest) and, for each of the mean-length decode steps of the batch's rows (all completions of the step,
decoded together), the longer of reading every weight once (``4·P_all`` bytes at the read bandwidth) and the rows'
matmuls (``2·P`` FLOP per row at the matmul peak). The table gives each row's tokens/s (mean length / generation CPU
seconds) against that floor's (mean length / floor seconds), and the decode-only bound per row (1 / step floor) for
reference.

    python -m benchmarks compare --configs sft_packed@qwen05b grpo@qwen05b --steps 2 --warmup 1 --runs 1 --out s.jsonl
    python benchmarks/machine_peak.py --threads 1 > peak.jsonl
    python benchmarks/sweep.py s.jsonl --peak peak.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

TOKENIZER_VOCAB = 320  # the byte-level tokenizer's size rounded up to 64 (posttrain.models.tiny's default)


def model_shape(model: str) -> dict[str, int]:
    """The build_tiny_model shape of a benchmark model name (defaults filled in)."""
    from benchmarks.common import MODEL_SPECS

    spec = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, **MODEL_SPECS[model]}
    spec.setdefault("intermediate_size", 2 * spec["hidden_size"])
    spec.setdefault("vocab_size", TOKENIZER_VOCAB)
    return spec


def matmul_params(model: str) -> tuple[int, int]:
    """(matmul parameters one token passes through — layers + LM head, all parameters)."""
    s = model_shape(model)
    h, layers, inter, vocab = s["hidden_size"], s["num_layers"], s["intermediate_size"], s["vocab_size"]
    kv = s["num_kv_heads"] * h // s["num_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter
    per_token = layers * per_layer + vocab * h
    total = layers * (per_layer + h + 2 * kv + 2 * h) + vocab * h + h  # + q/k/v biases and norms; tied head
    return per_token, total


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def tables(
    records: list[dict[str, Any]], peak: dict[str, Any] | None, shared_prefix: dict[str, int] | None = None
) -> str:
    """The three markdown tables (module docstring). ``shared_prefix`` maps a GRPO config to its prompts' common
    prefix in tokens (:func:`shared_prompt_prefix`; a config not in it counts each group's prompt in full)."""
    runs = [r for r in records if not r.get("summary") and "impl" in r and "error" not in r]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["config"], r["model"], r["impl"]), []).append(r)
    lines = [
        "| config | model | library | step wall s | step CPU s | tokens/s | peak RSS above interpreter MiB "
        "| Adam floor MiB | peak / floor | runs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (config, model, impl), rows in sorted(groups.items()):
        wall, cpu = _median(rows, "median_step_s"), _median(rows, "median_step_cpu_s")
        tps, rss = _median(rows, "tokens_per_s"), _median(rows, "peak_rss_above_interpreter_mib")
        floor = _median(rows, "adam_floor_mib")
        ratio = f"{rss / floor:.2f}" if rss and floor else "–"
        lines.append(
            f"| {config} | {model} | {impl} | {_fmt(wall)} | {_fmt(cpu)} | {_fmt(tps, 0)} | {_fmt(rss, 0)} "
            f"| {_fmt(floor, 0)} | {ratio} | {len(rows)} |"
        )
    if peak is None:
        return "\n".join(lines)
    gflops, read_gbs = peak["matmul_gflops"], peak["read_gbs"]
    lines += [
        "",
        f"Peak (one thread): fp32 matmul {gflops:.0f} GFLOP/s, read bandwidth {read_gbs:.1f} GB/s.",
        "",
        "| config | model | library | training GFLOP/s | of matmul peak | generation tokens/s per row "
        "| bound per row (prefill + decode) | of bound | decode-only bound per row |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (config, model, impl), rows in sorted(groups.items()):
        per_token, total = matmul_params(model)
        cpu = _median(rows, "median_step_cpu_s")
        tokens = _median(rows, "tokens_per_step")
        if not cpu or not tokens:
            continue
        trainer = rows[0]["trainer"]
        share = _median(rows, "generation_share") or 0.0
        mean_len = _median(rows, "completions/mean_length")
        unique_prompt_tokens = 0.0
        if trainer == "grpo" and mean_len:
            completions, group = _completions_per_step(config), _num_generations(config)
            completion_tokens = completions * mean_len
            mean_prompt = max(tokens - completion_tokens, 0.0) / completions
            shared = min(float((shared_prefix or {}).get(config, 0)), mean_prompt)
            # the common prefix once, then each group's rest of its prompt
            unique_prompt_tokens = shared + completions / group * (mean_prompt - shared)
            tokens = completion_tokens + unique_prompt_tokens
        flop = 6 * per_token * tokens + (2 * per_token * tokens if trainer == "dpo" else 0)
        # a prompt position has no loss: it needs the layers, not the LM head
        flop -= 6 * _head_params(model) * unique_prompt_tokens
        train_s = cpu * (1 - share)
        achieved = flop / train_s / 1e9 if train_s > 0 else None
        gen, bound, of_bound, decode_bound = "–", "–", "–", "–"
        if trainer == "grpo" and share > 0 and mean_len:
            rows_together = _completions_per_step(config)
            per_row = mean_len / (cpu * share)  # each row's tokens/s while all rows generate together
            # a decode step reads all weights once (bandwidth) and does 2·P FLOP per row (matmul peak)
            step_floor = max(4 * total / (read_gbs * 1e9), 2 * per_token * rows_together / (gflops * 1e9))
            prefill_floor = 2 * (per_token - _head_params(model)) * unique_prompt_tokens / (gflops * 1e9)
            limit = mean_len / (prefill_floor + mean_len * step_floor)
            gen, bound, of_bound = f"{per_row:.1f}", f"{limit:.1f}", f"{per_row / limit:.0%}"
            decode_bound = f"{1 / step_floor:.1f}"
        lines.append(
            f"| {config} | {model} | {impl} | {_fmt(achieved, 2)} | "
            f"{(achieved / gflops if achieved else 0):.1%} | {gen} | {bound} | {of_bound} | {decode_bound} |"
        )
    lines += [
        "",
        "| config | model | posttrain / TRL step CPU | step wall | peak RSS above interpreter |",
        "|---|---|---|---|---|",
    ]
    for config, model in sorted({(c, m) for c, m, _ in groups}):
        a, b = groups.get((config, model, "posttrain")), groups.get((config, model, "trl"))
        if not a or not b:
            continue
        cells = []
        for key in ("median_step_cpu_s", "median_step_s", "peak_rss_above_interpreter_mib"):
            x, y = _median(a, key), _median(b, key)
            cells.append(f"{x / y:.2f}" if x and y else "–")
        lines.append(f"| {config} | {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _completions_per_step(config: str) -> int:
    from benchmarks.workloads import get_workload

    args = get_workload(config).args
    return int(args.get("per_device_train_batch_size", 8)) * int(args.get("gradient_accumulation_steps", 1))


def shared_prompt_prefix(config: str, limit: int = 64) -> int:
    """Tokens every prompt of ``config``'s dataset shares at its start (the first ``limit`` prompts), under the
    byte-level tokenizer and chat template all sweep models use (``posttrain.models.tiny``), as the trainers see them
    (``apply_chat_template(..., add_generation_prompt=True)``). Needs posttrain's venv."""
    from benchmarks.workloads import DATASETS, get_workload
    from posttrain.models.tiny import build_tiny_tokenizer

    workload = get_workload(config)
    tokenizer = build_tiny_tokenizer()
    rows = DATASETS[workload.dataset](**workload.dataset_kwargs)[:limit]
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for row in rows
    ]
    shared = min(len(p) for p in prompts)
    for i in range(shared):
        if any(p[i] != prompts[0][i] for p in prompts[1:]):
            return i
    return shared


def _head_params(model: str) -> int:
    """The LM head's matmul parameters (vocabulary × hidden)."""
    shape = model_shape(model)
    return shape["vocab_size"] * shape["hidden_size"]


def _num_generations(config: str) -> int:
    from benchmarks.workloads import get_workload

    return int(get_workload(config).args.get("num_generations", 8))


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", help="JSON lines from `python -m benchmarks compare --out`")
    parser.add_argument(
        "--peak",
        default=None,
        help="JSON lines from benchmarks/machine_peak.py (the threads-1 line with the highest matmul peak is used)",
    )
    args = parser.parse_args(argv)
    records = [json.loads(line) for path in args.records for line in Path(path).read_text().splitlines() if line]
    peak = None
    if args.peak:
        peaks = [json.loads(line) for line in Path(args.peak).read_text().splitlines() if line.strip()]
        one_thread = [p for p in peaks if p.get("threads") == 1]
        # several probes (reruns): the highest matmul peak, so the fractions are not flattered by a disturbed run
        peak = max(one_thread, key=lambda p: p["matmul_gflops"]) if one_thread else None
    grpo = {r["config"] for r in records if r.get("trainer") == "grpo" and "config" in r}
    print(tables(records, peak, {config: shared_prompt_prefix(config) for config in sorted(grpo)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
