"""``posttrain demo``: posttrain's main job end to end, offline, on a CPU.

1. Build the byte-level tokenizer and a tiny Qwen2-style model (random weights) and generate the arithmetic task
   (``posttrain.demo.tasks``), with held-out operand pairs for evaluation.
2. Stage 1 — SFT with the ``recipes/sft.yaml`` recipe, through the same code path as ``posttrain sft``.
3. Stage 2 — GRPO with ``recipes/grpo.yaml`` (``accuracy_reward`` + ``think_format_reward``), as ``posttrain grpo``.
4. Evaluate after each stage on the held-out problems and print a before/after table; write ``summary.json`` and an
   HTML report per stage (``sft/report/index.html``, ``grpo/report/index.html``).

The demo says plainly whether GRPO improved on SFT. ``--quick`` shrinks every stage to a smoke run (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parent / "recipes"

# model size and stage lengths: (full demo, --quick)
MODEL_SIZE = {"full": {"hidden_size": 128, "num_layers": 4}, "quick": {"hidden_size": 64, "num_layers": 2}}
STAGE_OVERRIDES = {
    "full": {"sft": [], "grpo": []},
    "quick": {
        "sft": ["--max_steps", "40", "--logging_steps", "10"],
        "grpo": [
            "--max_steps",
            "4",
            "--logging_steps",
            "1",
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "8",
        ],
    },
}
EVAL_SAMPLES = {"full": 8, "quick": 2}


def _write_jsonl(path: Path, dataset) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for row in dataset:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return str(path)


def _stage(verb: str, argv: list[str]) -> None:
    from posttrain.cli.run import run_training_command

    code = run_training_command(verb, argv)
    if code != 0:
        raise SystemExit(f"posttrain demo: the {verb} stage failed (exit code {code}); see the message above.")


def _print_table(rows: dict[str, dict[str, float]], verdict: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="posttrain demo: held-out arithmetic problems (operands never seen in training)")
    table.add_column("metric")
    for stage in rows:
        table.add_column(stage, justify="right")
    metrics = list(next(iter(rows.values())))
    for metric in metrics:
        table.add_row(metric, *[f"{rows[stage][metric]:.3f}" for stage in rows])
    console = Console()
    console.print(table)
    console.print(verdict)


def run_demo(output_dir: str = "demo_output", quick: bool = False, seed: int = 0) -> dict:
    """Run the whole demo and return the summary (also written to ``output_dir/summary.json``)."""

    from posttrain.demo.evaluate import evaluate
    from posttrain.demo.tasks import make_datasets
    from posttrain.models.loading import create_model_from_path
    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

    mode = "quick" if quick else "full"
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.time()

    print(f"[demo] building the tokenizer, a tiny model and the task data in {out}", flush=True)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("qwen2", tokenizer=tokenizer, seed=seed, **MODEL_SIZE[mode])
    model.save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")
    sft_data, rl_data, eval_data = make_datasets(seed=seed, n_sft=4000 if not quick else 640)
    paths = {
        "sft": _write_jsonl(out / "data" / "sft.jsonl", sft_data),
        "rl": _write_jsonl(out / "data" / "rl.jsonl", rl_data),
        "eval": _write_jsonl(out / "data" / "eval.jsonl", eval_data),
    }
    common = ["--seed", str(seed)]

    print("[demo] stage 1/2: supervised fine-tuning", flush=True)
    _stage(
        "sft",
        [
            "--config",
            str(RECIPES / "sft.yaml"),
            "--model_name_or_path",
            str(out / "base"),
            "--dataset_name",
            paths["sft"],
            "--output_dir",
            str(out / "sft"),
            *common,
            *STAGE_OVERRIDES[mode]["sft"],
        ],
    )
    n_samples = EVAL_SAMPLES[mode]
    sft_model = create_model_from_path(str(out / "sft"))
    after_sft = evaluate(sft_model, tokenizer, eval_data, num_samples=n_samples, seed=seed)
    print(f"[demo] after SFT: {json.dumps({k: round(v, 3) for k, v in after_sft.row().items()})}", flush=True)

    print("[demo] stage 2/2: GRPO with verifiable rewards", flush=True)
    _stage(
        "grpo",
        [
            "--config",
            str(RECIPES / "grpo.yaml"),
            "--model_name_or_path",
            str(out / "sft"),
            "--dataset_name",
            paths["rl"],
            "--output_dir",
            str(out / "grpo"),
            *common,
            *STAGE_OVERRIDES[mode]["grpo"],
        ],
    )
    grpo_model = create_model_from_path(str(out / "grpo"))
    after_grpo = evaluate(grpo_model, tokenizer, eval_data, num_samples=n_samples, seed=seed)
    del sft_model, grpo_model

    gain = after_grpo.accuracy_sampled - after_sft.accuracy_sampled
    n_eval = len(eval_data) * n_samples
    # a binomial standard error on the difference of two accuracies measured on n_eval samples each
    p = (after_grpo.accuracy_sampled + after_sft.accuracy_sampled) / 2
    stderr = (2 * p * (1 - p) / max(n_eval, 1)) ** 0.5
    if gain > 2 * stderr and gain > 0:
        verdict = (
            f"[bold green]GRPO improved held-out accuracy by {gain:+.3f} "
            f"(≈{gain / max(stderr, 1e-9):.1f} standard errors over {n_eval} samples).[/]"
        )
    elif gain > 0:
        verdict = (
            f"[bold yellow]GRPO changed held-out accuracy by {gain:+.3f}, within noise "
            f"(standard error ≈ {stderr:.3f}); this run did not show a clear improvement.[/]"
        )
    else:
        verdict = f"[bold red]GRPO did not improve held-out accuracy in this run ({gain:+.3f}).[/]"
    # Say where the change comes from: the answer format a verifier can read, or the arithmetic itself.
    verdict += (
        f"\nWhere it comes from: verifiable (\\boxed) answers {after_sft.boxed_rate:.2f} → {after_grpo.boxed_rate:.2f}; "
        f"right number in any format {after_sft.correct_anywhere:.2f} → {after_grpo.correct_anywhere:.2f}."
    )
    rows = {"after SFT": after_sft.row(), "after GRPO": after_grpo.row()}
    _print_table(rows, verdict)
    summary = {
        "mode": mode,
        "seed": seed,
        "seconds": round(time.time() - started, 1),
        "after_sft": after_sft.row(),
        "after_grpo": after_grpo.row(),
        "accuracy_gain": gain,
        "standard_error": stderr,
        "samples_after_grpo": after_grpo.samples[:8],
        "reports": {stage: str(out / stage / "report" / "index.html") for stage in ("sft", "grpo")},
    }
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    print(
        f"[demo] finished in {summary['seconds']:.0f} s. Reports: {out / 'sft' / 'report' / 'index.html'} and "
        f"{out / 'grpo' / 'report' / 'index.html'}; summary: {out / 'summary.json'}",
        flush=True,
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="posttrain demo",
        description="Offline end-to-end demo: a tiny model learns arithmetic by SFT, then improves with GRPO.",
    )
    parser.add_argument("--quick", action="store_true", help="A ~1-minute smoke run (tiny stages).")
    parser.add_argument("--output_dir", default="demo_output", help="Where models, data and reports go.")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the model, the data and training.")
    args = parser.parse_args(sys.argv[2:] if argv is None else argv)
    run_demo(args.output_dir, quick=args.quick, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
