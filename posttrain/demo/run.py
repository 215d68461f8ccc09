"""``posttrain demo``: posttrain's main job end to end, offline, on a CPU.

1. Build the byte-level tokenizer and a tiny Qwen2-style model (random weights) and generate the task
   (``posttrain.demo.tasks``): two-digit addition with a worked trace, SFT traces from a teacher that forgets the
   carry 70% of the time, and held-out operand pairs for evaluation.
2. Stage 1 — SFT with the ``recipes/sft.yaml`` recipe, through the same code path as ``posttrain sft``.
3. Stage 2 — GRPO with ``recipes/grpo.yaml`` (``accuracy_reward``, a math verifier), as ``posttrain grpo``.
4. Evaluate after each stage on the held-out problems — greedy and sampled, verified and "right answer in any
   format", pass@k, with standard errors — print a before/after table, and write ``summary.json`` and one report
   page for the whole demo (``report.html``: both stages' curves, the table, the same held-out prompts answered
   after SFT and after GRPO).

The demo says plainly whether GRPO improved on SFT and whether the gain is skill or format. ``--quick`` shrinks
every stage to a smoke run (well under a minute of training).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from posttrain.demo.common import RECIPES, _print_table, _stage, _write_jsonl, demo_summary, finish_demo

# model size, stage lengths and evaluation size: (full demo, --quick)
MODEL_SIZE = {"full": {"hidden_size": 128, "num_layers": 4}, "quick": {"hidden_size": 64, "num_layers": 2}}
STAGE_OVERRIDES = {
    "full": {"sft": [], "grpo": []},
    "quick": {
        "sft": ["--max_steps", "40", "--logging_steps", "10", "--per_device_train_batch_size", "16"],
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
SFT_ROWS = {"full": 16000, "quick": 640}  # ≥ max_steps × batch size: one pass, no repeated batches
EVAL_SIZE = {"full": 400, "quick": 24}
EVAL_SAMPLES = {"full": 8, "quick": 2}
# the headline rows of the printed table (EvalResult.metrics() names)
HEADLINE = "greedy: right answer, any format"


def _verdict(after_sft, after_grpo, gains: dict) -> tuple[str, str]:
    """(rich-markup verdict, plain-text verdict)."""
    from posttrain.demo.tasks import FORGET_CARRY

    g, g_se = gains[HEADLINE]
    s, s_se = gains["sampled (T=1): verified correct"]
    m_sft, m_grpo = after_sft.metrics(), after_grpo.metrics()
    carry = (m_sft["greedy, problems with a carry"][0], m_grpo["greedy, problems with a carry"][0])
    boxed = (m_sft["answers in \\boxed{} (sampled)"][0], m_grpo["answers in \\boxed{} (sampled)"][0])
    if g > 2 * g_se and g > 0:
        head = (
            f"GRPO made the model better at the arithmetic itself: greedy right answers (any format) "
            f"{m_sft[HEADLINE][0]:.3f} → {m_grpo[HEADLINE][0]:.3f} ({g:+.3f} ± {g_se:.3f}); "
            f"sampled verified accuracy {s:+.3f} ± {s_se:.3f}."
        )
        colour = "green"
    elif g > 0:
        head = f"GRPO changed greedy right answers by {g:+.3f}, within noise (s.e. {g_se:.3f}): no clear improvement."
        colour = "yellow"
    else:
        head = f"GRPO did not improve greedy right answers in this run ({g:+.3f} ± {g_se:.3f})."
        colour = "red"
    where = (
        f"Where it comes from: greedy right answers on problems that need a carry (the SFT teacher forgot the carry "
        f"{FORGET_CARRY:.0%} of the time) {carry[0]:.2f} → {carry[1]:.2f}; answers written in \\boxed{{}} {boxed[0]:.2f} → "
        f"{boxed[1]:.2f}."
    )
    return f"[bold {colour}]{head}[/]\n{where}", f"{head}\n{where}"


def run_demo(
    output_dir: str = "demo_output",
    quick: bool = False,
    seed: int = 0,
    eval_size: int | None = None,
    reuse_sft: bool = False,
    grpo_seed: int | None = None,
) -> dict:
    """Run the whole demo and return the summary (also written to ``output_dir/summary.json``).

    ``grpo_seed``: the GRPO stage's seed (default ``seed``); with ``reuse_sft``, a cheap probe of how much the GRPO
    result depends on its path from the same SFT model."""

    from posttrain.demo.evaluate import evaluate as evaluate_model
    from posttrain.demo.evaluate import paired_gain
    from posttrain.demo.report import write_demo_report
    from posttrain.demo.tasks import make_datasets
    from posttrain.models.loading import create_model_from_path
    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

    mode = "quick" if quick else "full"
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started, cpu_started = time.time(), time.process_time()
    timings: dict[str, float] = {}

    print(f"[demo] building the tokenizer, a tiny model and the task data in {out}", flush=True)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("qwen2", tokenizer=tokenizer, seed=seed, **MODEL_SIZE[mode])
    model.save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")
    n_eval = eval_size or EVAL_SIZE[mode]
    sft_data, rl_data, eval_data = make_datasets(seed=seed, n_sft=SFT_ROWS[mode], eval_size=n_eval)
    paths = {
        "sft": _write_jsonl(out / "data" / "sft.jsonl", sft_data),
        "rl": _write_jsonl(out / "data" / "rl.jsonl", rl_data),
        "eval": _write_jsonl(out / "data" / "eval.jsonl", eval_data),
    }
    common = ["--seed", str(seed)]
    n_samples = EVAL_SAMPLES[mode]

    def timed_stage(name: str, verb: str, argv: list[str]) -> None:
        t0, c0 = time.time(), time.process_time()
        _stage(verb, argv)
        timings[f"{name}_wall_s"] = round(time.time() - t0, 1)
        timings[f"{name}_cpu_s"] = round(time.process_time() - c0, 1)

    def timed_eval(name: str, path: Path):
        t0 = time.time()
        stage_model = create_model_from_path(str(path))
        result = evaluate_model(stage_model, tokenizer, eval_data, num_samples=n_samples, seed=seed)
        timings[f"eval_{name}_wall_s"] = round(time.time() - t0, 1)
        return result

    if reuse_sft and (out / "sft" / "model.safetensors").exists():
        print(f"[demo] stage 1/2: reusing the SFT model in {out / 'sft'} (--reuse_sft)", flush=True)
        timings["sft_reused"] = True
    else:
        print("[demo] stage 1/2: supervised fine-tuning on the sloppy teacher's traces", flush=True)
        timed_stage(
            "sft",
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
    after_sft = timed_eval("sft", out / "sft")
    print(f"[demo] after SFT: {json.dumps({k: round(v, 3) for k, v in after_sft.row().items()})}", flush=True)

    print("[demo] stage 2/2: GRPO with a verifiable reward", flush=True)
    timed_stage(
        "grpo",
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
            "--seed",
            str(seed if grpo_seed is None else grpo_seed),
            *STAGE_OVERRIDES[mode]["grpo"],
        ],
    )
    after_grpo = timed_eval("grpo", out / "grpo")

    fields = {
        "greedy: verified correct": "greedy_verified",
        HEADLINE: "greedy_any_format",
        "sampled (T=1): verified correct": "sampled_verified",
        "sampled (T=1): right answer, any format": "sampled_any_format",
        f"pass@{n_samples} (verified)": "pass_at_k",
        "answers in \\boxed{} (sampled)": "boxed",
    }
    gains = {name: paired_gain(getattr(after_grpo, f), getattr(after_sft, f)) for name, f in fields.items()}
    rich_verdict, verdict = _verdict(after_sft, after_grpo, gains)
    metrics = {"after SFT": after_sft.metrics(), "after GRPO": after_grpo.metrics()}
    _print_table(metrics, gains, rich_verdict, len(eval_data))
    timings["total_wall_s"] = round(time.time() - started, 1)
    timings["total_cpu_s"] = round(time.process_time() - cpu_started, 1)
    summary = demo_summary(
        mode=mode,
        seed=seed,
        timings=timings,
        n_eval=len(eval_data),
        n_samples=n_samples,
        after_sft=after_sft,
        after_grpo=after_grpo,
        metrics=metrics,
        gains=gains,
        verdict=verdict,
        out=out,
        extra={
            "greedy_gain": gains[HEADLINE][0],
            "sampled_gain": gains["sampled (T=1): verified correct"][0],
            "grpo_seed": seed if grpo_seed is None else grpo_seed,
        },
    )
    summary["report"] = write_demo_report(str(out), summary, after_sft, after_grpo)
    finish_demo("demo", summary, out)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="posttrain demo",
        description="Offline end-to-end demo. --task arithmetic (default): a tiny model learns two-digit addition "
        "from a sloppy teacher by SFT, then GRPO with a verifier teaches it to remember the carry. --task agent: a "
        "tiny model learns from a lazy teacher to call a calculator tool sometimes, then GRPO with a calculator "
        "environment per rollout (environment_factory) makes it use the tool and get three-digit products right.",
    )
    parser.add_argument(
        "--task",
        choices=("arithmetic", "agent"),
        default="arithmetic",
        help="Which demo: 'arithmetic' (SFT then GRPO on two-digit addition) or 'agent' (tool use with an "
        "environment).",
    )
    parser.add_argument("--quick", action="store_true", help="A smoke run (tiny stages, well under a minute).")
    parser.add_argument(
        "--output_dir",
        default=None,
        help="Where models, data and the report go (default demo_output, or demo_agent_output for --task agent).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed for the model, the data and training.")
    parser.add_argument(
        "--eval_size",
        type=int,
        default=None,
        help=f"Held-out problems to evaluate on (default {EVAL_SIZE['full']}; {EVAL_SIZE['quick']} with --quick; "
        "the agent task: 200, 12 with --quick).",
    )
    parser.add_argument(
        "--reuse_sft",
        action="store_true",
        help="Reuse output_dir/sft from an earlier run with the same seed and mode (re-run only GRPO and the "
        "evaluations, e.g. after editing the GRPO recipe).",
    )
    parser.add_argument(
        "--grpo_seed",
        type=int,
        default=None,
        help="Seed of the GRPO stage only (default: --seed). With --reuse_sft it re-runs GRPO from the same SFT model "
        "on another path (another draw of prompts and samples). Arithmetic task only.",
    )
    args = parser.parse_args(sys.argv[2:] if argv is None else argv)
    if args.task == "agent" and args.grpo_seed is not None:
        parser.error("--grpo_seed applies to the arithmetic demo only (--task arithmetic).")
    if args.task == "agent":
        from posttrain.demo.agent import run_agent_demo

        run_agent_demo(
            args.output_dir or "demo_agent_output",
            quick=args.quick,
            seed=args.seed,
            eval_size=args.eval_size,
            reuse_sft=args.reuse_sft,
        )
        return 0
    run_demo(
        args.output_dir or "demo_output",
        quick=args.quick,
        seed=args.seed,
        eval_size=args.eval_size,
        reuse_sft=args.reuse_sft,
        grpo_seed=args.grpo_seed,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
