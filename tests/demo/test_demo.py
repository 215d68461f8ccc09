"""`posttrain demo --quick` end to end: the stages run through the CLI path and leave well-formed outputs."""

import json
import subprocess
import sys

from posttrain.demo.tasks import make_datasets, split_problems


def test_task_splits_are_disjoint_and_answers_verifiable():
    train, held_out = split_problems(10, 0.2, seed=0)
    assert not {(p.a, p.b) for p in train} & {(p.a, p.b) for p in held_out}
    sft, rl, ev = make_datasets(n_sft=50, seed=0)
    assert len(sft) == 50 and len(ev) == 20 and len(rl) == 80
    boxed = sum("\\boxed{" in row["completion"][0]["content"] for row in sft)
    assert 0 < boxed < 50  # a mix of verifiable and unverifiable answer formats
    assert ev[0]["solution"].startswith("$") and ev[0]["prompt"][0]["role"] == "user"


def test_demo_quick_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "demo", "--quick", "--output_dir", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after SFT" in proc.stdout and "after GRPO" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    for stage in ("after_sft", "after_grpo"):
        row = summary[stage]
        assert set(row) >= {"accuracy (greedy)", "accuracy (sampled, T=1)", "mean reward", "mean completion length"}
        assert all(0.0 <= row[k] <= 1.0 for k in row if "accuracy" in k)
    for stage, key in (("sft", "mean_token_accuracy"), ("grpo", "reward")):
        records = [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]
        assert any(key in r for r in records), f"{stage} metrics lack {key}"
        html = (out / stage / "report" / "index.html").read_text()
        assert "data:image/png;base64," in html
        assert (out / stage / "config.json").exists() and (out / stage / "model.safetensors").exists()
    assert list((out / "grpo" / "completions").glob("*.parquet"))
