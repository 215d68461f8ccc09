"""`posttrain demo`: the task, the skill-vs-format evaluation, the quick smoke run and (slow) the full schedule."""

import json
import os
import re
import subprocess
import sys

import pytest

from posttrain.demo.evaluate import mean_and_stderr, paired_gain, stated_number
from posttrain.demo.tasks import Problem, make_datasets, split_problems


def _boxed(text):
    return int(re.search(r"\\boxed\{(\d+)\}", text).group(1))


def test_traces_compute_the_sum_unless_the_teacher_forgets_the_carry():
    assert Problem(47, 85).trace() == "<think>7+5=12 4+8+1=13</think> \\boxed{132}"
    assert Problem(47, 85).trace(forget_carry=True) == "<think>7+5=12 4+8=12</think> \\boxed{122}"
    assert Problem(23, 41).trace(forget_carry=True) == Problem(23, 41).trace()  # nothing to forget
    for a in range(10, 100, 7):
        for b in range(10, 100, 11):
            p = Problem(a, b)
            assert _boxed(p.trace()) == a + b
            assert (_boxed(p.trace(forget_carry=True)) == a + b) == (not p.carries)


def test_held_out_pairs_never_appear_in_training_in_either_order():
    train, held_out = split_problems(300, seed=0)
    assert len(held_out) == 300
    seen = {(p.a, p.b) for p in train}
    assert not any((p.a, p.b) in seen or (p.b, p.a) in seen for p in held_out)
    assert len(seen) + 2 * 300 >= 90 * 90  # everything else is training data
    assert split_problems(300, seed=0)[1] == held_out and split_problems(300, seed=1)[1] != held_out


def test_sft_data_is_all_boxed_and_forgets_the_carry_at_the_set_rate():
    sft, rl, ev = make_datasets(n_sft=4000, n_rl=2000, eval_size=40, forget_carry=0.7, seed=0)
    assert len(sft) == 4000 and len(rl) == 2000 and len(ev) == 40
    held = {row["prompt"][0]["content"] for row in ev}
    assert not held & {row["prompt"][0]["content"] for row in sft}
    right = wrong = 0
    for row in sft:
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        text = row["completion"][0]["content"]
        assert "\\boxed{" in text  # the format is always taught: GRPO's gain can't be formatting
        if Problem(a, b).carries:
            right += _boxed(text) == a + b
            wrong += _boxed(text) != a + b
        else:
            assert _boxed(text) == a + b
    assert 0.65 < wrong / (right + wrong) < 0.75
    rl_pairs = [tuple(map(int, re.findall(r"\d+", row["prompt"][0]["content"]))) for row in rl]
    assert 0.7 < sum(Problem(a, b).carries for a, b in rl_pairs) / len(rl_pairs) < 0.8  # GRPO's prompts: mostly carries
    assert not held & {row["prompt"][0]["content"] for row in rl}
    assert ev[0]["solution"].startswith("$") and isinstance(ev[0]["carries"], bool)


def test_any_format_answer_and_standard_errors():
    assert stated_number("<think>7+5=12 4+8+1=13</think> \\boxed{132}") == 132
    assert stated_number("<think>1+2=3</think> The answer is 41.") == 41
    assert stated_number("<think>1+2=3</think> no idea") is None
    mean, se = mean_and_stderr([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5 and se == pytest.approx((1 / 3 / 4) ** 0.5)  # sample variance 1/3, n = 4
    gain, gain_se = paired_gain([1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0])
    assert gain == 0.5 and gain_se == pytest.approx((1 / 3 / 4) ** 0.5)


def _run_demo(out, *args, timeout):
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "demo", "--output_dir", str(out), *args],
        # one torch thread, as the README's timings: pytest-xdist's other worker has the other core
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "summary.json").read_text())


def test_demo_quick_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc, summary = _run_demo(out, "--quick", timeout=900)
    assert "after SFT" in proc.stdout and "after GRPO" in proc.stdout and "change (paired)" in proc.stdout
    for stage in ("after_sft", "after_grpo"):
        row = summary[stage]
        assert {"greedy: right answer, any format", "sampled (T=1): verified correct", "pass@2 (verified)"} <= set(row)
        assert all(0.0 <= v <= 1.0 for k, v in row.items() if "tokens" not in k)
        assert set(summary["standard_errors"][stage]) == set(row)
    assert {"sft_cpu_s", "grpo_cpu_s", "total_wall_s"} <= set(summary["timings"])
    for stage, key in (("sft", "mean_token_accuracy"), ("grpo", "reward")):
        records = [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]
        assert any(key in r for r in records), f"{stage} metrics lack {key}"
        assert (out / stage / "config.json").exists() and (out / stage / "model.safetensors").exists()
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4  # two curves per stage, side by side
    assert "Stage 1 · SFT" in page and "Stage 2 · GRPO" in page
    assert "after SFT (greedy)" in page and "after GRPO (greedy)" in page
    assert page.count("<td class='comp'>") == 2 * 14  # the same prompts answered by both models


def test_demo_grpo_seed_reruns_only_the_grpo_stage(tmp_path):
    """--reuse_sft --grpo_seed N: the SFT model is kept, the GRPO stage runs with seed N (the README's path probe)."""
    out = tmp_path / "demo"
    _run_demo(out, "--quick", timeout=900)
    sft_weights = (out / "sft" / "model.safetensors").read_bytes()
    proc, summary = _run_demo(out, "--quick", "--reuse_sft", "--grpo_seed", "7", timeout=900)
    assert "reusing the SFT model" in proc.stdout and summary["timings"]["sft_reused"] is True
    assert (out / "sft" / "model.safetensors").read_bytes() == sft_weights
    assert json.loads((out / "grpo" / "run_config.json").read_text())["seed"] == 7
    assert summary["seed"] == 0 and summary["grpo_seed"] == 7


def test_demo_grpo_seed_is_refused_for_the_agent_task():
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "demo", "--task", "agent", "--grpo_seed", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--grpo_seed applies to the arithmetic demo only" in proc.stderr


@pytest.mark.slow
def test_full_demo_grpo_improves_the_skill(tmp_path):
    """README's demo command, seed 0, 400 held-out problems: GRPO gains clearly on the carry problems and keeps the
    problems without a carry (the KL penalty's job: without it this seed learned to add a carry everywhere)."""
    out = tmp_path / "demo"
    _, summary = _run_demo(out, "--seed", "0", timeout=1500)
    gain = summary["gains"]["greedy: right answer, any format"]
    assert gain["mean"] >= 0.10 and gain["mean"] > 2 * gain["standard_error"], summary["verdict"]
    after = summary["after_grpo"]
    assert after["greedy, problems with a carry"] >= summary["after_sft"]["greedy, problems with a carry"] + 0.2
    assert after["greedy, problems without a carry"] >= 0.95, summary["verdict"]
    assert summary["gains"]["sampled (T=1): verified correct"]["mean"] > 0, summary["verdict"]
    assert after["answers in \\boxed{} (sampled)"] > 0.95  # the gain is not formatting
