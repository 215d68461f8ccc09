"""Report writer: plots per trainer, HTML with summary/config/completions, tolerant of cut lines."""

import json

import pandas as pd

from posttrain.report import read_metrics, write_report
from posttrain.report.plots import guess_trainer


def _write_metrics(path, records, broken_tail=False):
    with open(path / "metrics.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
        if broken_tail:
            f.write('{"step": 9, "loss":')


def test_grpo_report_has_reward_plots_and_completions(tmp_path):
    records = [
        {
            "step": s,
            "loss": 0.1 * s,
            "reward": s / 10,
            "reward_std": 0.2,
            "frac_reward_zero_std": 0.1,
            "rewards/accuracy_reward/mean": s / 10,
            "kl": 0.01 * s,
            "entropy": 1.0,
            "completions/mean_length": 10 + s,
        }
        for s in range(1, 6)
    ]
    _write_metrics(tmp_path, records, broken_tail=True)
    (tmp_path / "completions").mkdir()
    pd.DataFrame({"step": [5], "prompt": ["1+1?"], "completion": ["<b>2</b>"], "advantage": [0.5]}).to_parquet(
        tmp_path / "completions" / "completions_00005.parquet"
    )
    assert len(read_metrics(str(tmp_path))) == 5
    index = write_report(str(tmp_path), title="demo")
    html = open(index).read()
    assert "trainer: <b>grpo</b>" in html
    assert html.count("data:image/png;base64,") >= 5
    assert "&lt;b&gt;2&lt;/b&gt;" in html  # completions are escaped
    pngs = list((tmp_path / "report").glob("*.png"))
    assert any("reward" in p.name for p in pngs)


def test_guess_trainer():
    assert guess_trainer(["loss", "mean_token_accuracy"]) == "sft"
    assert guess_trainer(["rewards/margins", "rewards/accuracies"]) == "dpo"
    assert guess_trainer(["accuracy", "margin"]) == "reward"
    assert guess_trainer(["loss"]) == "generic"


def test_empty_output_dir_still_writes_a_page(tmp_path):
    html = open(write_report(str(tmp_path))).read()
    assert "No metrics were logged yet" in html
