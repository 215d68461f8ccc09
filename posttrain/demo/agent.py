"""``posttrain demo --task agent``: an agent learning to use a tool, end to end, offline, on a CPU.

1. Build the byte-level tokenizer and a tiny Qwen2-style model (random weights), as ``posttrain demo`` does, and
   generate the task (``posttrain.demo.agent_task``): three-digit multiplication with a calculator tool, SFT traces
   from a lazy teacher that calls the calculator only 30% of the time, and held-out factor pairs.
2. Stage 1 — SFT with ``recipes/agent_sft.yaml`` through the same code path as ``posttrain sft`` (rows carry the
   tool schema, the loss is on the assistant turns).
3. Stage 2 — GRPO with ``recipes/agent_grpo.yaml`` and ``environment_factory=CalculatorEnv``: one environment per
   rollout, its argument-free ``calculate`` method the tool, :func:`verified_answer_reward` checking the final answer against the
   rollout's environment. (The CLI's ``posttrain grpo`` takes reward functions by name only, so this stage builds
   ``GRPOTrainer`` in Python: the environment class and the reward function are objects.)
4. Evaluate after each stage on the held-out problems with the same tool loop (``agent_evaluate``): success and
   tool-use rate, greedy and sampled, with paired standard errors; print the before/after table, write
   ``summary.json`` and ``report.html`` (curves, the table, the same held-out prompts answered after SFT and after
   GRPO as transcripts).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from posttrain.demo.common import RECIPES, _print_table, _stage, _write_jsonl, demo_summary, finish_demo

# model size, stage lengths and evaluation size: (full demo, --quick)
MODEL_SIZE = {"full": {"hidden_size": 128, "num_layers": 4}, "quick": {"hidden_size": 64, "num_layers": 2}}
SFT_OVERRIDES = {
    "full": [],
    "quick": ["--max_steps", "6", "--logging_steps", "2", "--per_device_train_batch_size", "8"],
}
GRPO_OVERRIDES = {"full": {}, "quick": {"max_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 16}}
SFT_ROWS = {"full": 16000, "quick": 48}  # full: max_steps x batch size / 2 (two passes: half the tokenizing)
RL_ROWS = {"full": 2000, "quick": 16}
EVAL_SIZE = {"full": 200, "quick": 12}
EVAL_SAMPLES = {"full": 4, "quick": 2}
HEADLINE = "greedy: success (verified answer)"
# EvalResult field behind each metric that gets a paired change
GAIN_FIELDS = {
    "greedy: success (verified answer)": "greedy_success",
    "greedy: tool-use rate": "greedy_tool_use",
    "sampled (T=1): success": "sampled_success",
    "sampled (T=1): tool-use rate": "sampled_tool_use",
}


def _verdict(after_sft, after_grpo, gains: dict) -> tuple[str, str]:
    """(rich-markup verdict, plain-text verdict)."""
    from posttrain.demo.agent_task import TOOL_RATE

    m_sft, m_grpo = after_sft.metrics(), after_grpo.metrics()
    g, g_se = gains[HEADLINE]
    tool = (m_sft["sampled (T=1): tool-use rate"][0], m_grpo["sampled (T=1): tool-use rate"][0])
    if g > 2 * g_se and g > 0:
        head = (
            f"GRPO taught the agent to use its calculator: held-out success (greedy) {m_sft[HEADLINE][0]:.3f} → "
            f"{m_grpo[HEADLINE][0]:.3f} ({g:+.3f} ± {g_se:.3f})."
        )
        colour = "green"
    elif g > 0:
        head = f"GRPO changed held-out success by {g:+.3f}, within noise (s.e. {g_se:.3f}): no clear improvement."
        colour = "yellow"
    else:
        head = f"GRPO did not improve held-out success in this run ({g:+.3f} ± {g_se:.3f})."
        colour = "red"
    where = (
        f"Where it comes from: the sampled tool-use rate went {tool[0]:.2f} → {tool[1]:.2f} (the SFT teacher called "
        f"the tool {TOOL_RATE:.0%} of the time); sampled answers that used the tool were right "
        f"{m_grpo['sampled: success when the tool was used'][0]:.2f} of the time after GRPO, those without it "
        f"{m_grpo['sampled: success without the tool'][0]:.2f}."
    )
    return f"[bold {colour}]{head}[/]\n{where}", f"{head}\n{where}"


def run_agent_demo(
    output_dir: str = "demo_agent_output",
    quick: bool = False,
    seed: int = 0,
    eval_size: int | None = None,
    reuse_sft: bool = False,
) -> dict:
    """Run the agent demo and return the summary (also written to ``output_dir/summary.json``)."""
    import yaml
    from datasets import Dataset

    from posttrain.demo.agent_evaluate import copy_accuracy, evaluate_agent
    from posttrain.demo.agent_task import (
        CalculatorEnv,
        MulProblem,
        build_agent_tokenizer,
        make_agent_datasets,
        verified_answer_reward,
    )
    from posttrain.demo.evaluate import paired_gain
    from posttrain.demo.report import write_agent_report
    from posttrain.models.loading import create_model_from_path
    from posttrain.models.tiny import build_tiny_model
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    mode = "quick" if quick else "full"
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started, cpu_started = time.time(), time.process_time()
    timings: dict[str, float] = {}

    print(f"[demo agent] building the tokenizer, a tiny model and the task data in {out}", flush=True)
    tokenizer = build_agent_tokenizer()
    model = build_tiny_model("qwen2", tokenizer=tokenizer, seed=seed, **MODEL_SIZE[mode])
    model.save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")
    n_eval = eval_size or EVAL_SIZE[mode]
    sft_data, rl_data, eval_data = make_agent_datasets(
        seed=seed, n_sft=SFT_ROWS[mode], n_rl=RL_ROWS[mode], eval_size=n_eval
    )
    paths = {
        name: _write_jsonl(out / "data" / f"{name}.jsonl", data)
        for name, data in (("sft", sft_data), ("rl", rl_data), ("eval", eval_data))
    }
    n_samples = EVAL_SAMPLES[mode]

    def timed_eval(name: str, stage_model):
        t0 = time.time()
        result = evaluate_agent(stage_model, tokenizer, eval_data, num_samples=n_samples, seed=seed)
        timings[f"eval_{name}_wall_s"] = round(time.time() - t0, 1)
        return result

    if reuse_sft and (out / "sft" / "model.safetensors").exists():
        print(f"[demo agent] stage 1/2: reusing the SFT model in {out / 'sft'} (--reuse_sft)", flush=True)
        timings["sft_reused"] = True
    else:
        print("[demo agent] stage 1/2: supervised fine-tuning on the lazy teacher's traces", flush=True)
        t0, c0 = time.time(), time.process_time()
        _stage(
            "sft",
            [
                "--config",
                str(RECIPES / "agent_sft.yaml"),
                "--model_name_or_path",
                str(out / "base"),
                "--dataset_name",
                paths["sft"],
                "--output_dir",
                str(out / "sft"),
                "--seed",
                str(seed),
                *SFT_OVERRIDES[mode],
            ],
        )
        timings["sft_wall_s"] = round(time.time() - t0, 1)
        timings["sft_cpu_s"] = round(time.process_time() - c0, 1)
    sft_model = create_model_from_path(str(out / "sft"))
    after_sft = timed_eval("sft", sft_model)
    print(f"[demo agent] after SFT: {json.dumps({k: round(v, 3) for k, v in after_sft.row().items()})}", flush=True)
    copy_rate, _ = copy_accuracy(sft_model, tokenizer, [MulProblem(int(r["a"]), int(r["b"])) for r in eval_data])
    print(
        f"[demo agent] after SFT the model copies the calculator's answer into the box on {copy_rate:.0%} of the "
        "held-out problems"
        + ("" if copy_rate >= 0.5 else " — too rarely for GRPO to find rewarded rollouts (README, agent demo)"),
        flush=True,
    )

    print("[demo agent] stage 2/2: GRPO with a calculator environment per rollout", flush=True)
    t0, c0 = time.time(), time.process_time()
    with open(RECIPES / "agent_grpo.yaml") as f:
        fields = yaml.safe_load(f)
    fields.update(GRPO_OVERRIDES[mode], output_dir=str(out / "grpo"), seed=seed)
    trainer = GRPOTrainer(
        str(out / "sft"),
        verified_answer_reward,
        GRPOConfig(**fields),
        train_dataset=Dataset.from_json(paths["rl"]),
        environment_factory=CalculatorEnv,
    )
    trainer.train()
    trainer.save_model(str(out / "grpo"))
    timings["grpo_wall_s"] = round(time.time() - t0, 1)
    timings["grpo_cpu_s"] = round(time.process_time() - c0, 1)
    after_grpo = timed_eval("grpo", create_model_from_path(str(out / "grpo")))

    gains = {
        name: paired_gain(getattr(after_grpo, field), getattr(after_sft, field)) for name, field in GAIN_FIELDS.items()
    }
    rich_verdict, verdict = _verdict(after_sft, after_grpo, gains)
    metrics = {"after SFT": after_sft.metrics(), "after GRPO": after_grpo.metrics()}
    _print_table(
        metrics, gains, rich_verdict, f"posttrain demo --task agent: {len(eval_data)} held-out problems, ± s.e."
    )
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
            "task": "agent",
            "sft_copy_accuracy": copy_rate,
            "success_gain": gains[HEADLINE][0],
            "tool_use_gain": gains["sampled (T=1): tool-use rate"][0],
        },
    )
    summary["report"] = write_agent_report(str(out), summary, after_sft, after_grpo)
    finish_demo("demo agent", summary, out)
    return summary
