"""Smoke tests of the benchmark harness: `python -m benchmarks run` prints one valid JSON line (no timing asserts),
and the pure parts (phase timer nesting, step summary, posttrain/TRL ratio summary) compute what they say.

Needs no TRL venv: the comparison's summariser is tested on synthetic records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# pytest puts tests/ on sys.path (for conftest.py), where this folder would pass for a `benchmarks` namespace
# package; the suite lives at the repository root.
if not getattr(sys.modules.get("benchmarks"), "__file__", None):
    sys.modules.pop("benchmarks", None)
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.__main__ import build_parser, summarize  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    WORKLOADS,
    arithmetic_reward,
    build_dataset,
    colour_reward,
    get_workload,
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """Saved tiny models for the smoke runs (built here, so the run's own 'prepare' child is skipped)."""
    path = tmp_path_factory.mktemp("bench-cache")
    common.ensure_model("tiny", "causal-lm", cache_dir=path)
    return str(path)


def _run(cache_dir: str, capsys, monkeypatch, *flags: str) -> dict:
    """`python -m benchmarks run ... --steps 1 --warmup 0` in-process (the imports are shared with the suite)."""
    import datasets
    import torch
    import transformers

    from benchmarks.__main__ import main

    for key, value in common.ENV_DEFAULTS.items():
        monkeypatch.setenv(key, value)  # restored after the test
    # env_setup() makes the process single-threaded and quiet: undo that for the rest of the suite.
    threads = torch.get_num_threads()
    hf_verbosity, ds_verbosity = transformers.logging.get_verbosity(), datasets.logging.get_verbosity()
    ds_bars = datasets.is_progress_bar_enabled()
    capsys.readouterr()
    try:
        main(["run", *flags, "--steps", "1", "--warmup", "0", "--cache-dir", cache_dir])
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(hf_verbosity)
        datasets.logging.set_verbosity(ds_verbosity)
        if ds_bars:
            datasets.enable_progress_bars()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith('{"')]
    assert len(lines) == 1, lines
    return json.loads(lines[0])


@pytest.mark.parametrize("trainer", ["sft", "grpo"])
def test_run_prints_one_json_line(trainer, cache_dir, capsys, monkeypatch):
    record = _run(cache_dir, capsys, monkeypatch, "--trainer", trainer, "--model", "tiny")
    assert record["impl"] == "posttrain"
    assert record["trainer"] == trainer and record["model"] == "tiny"
    assert record["steps"] == 1 and len(record["step_s"]) == 1
    assert record["median_step_s"] > 0
    assert record["threads"] == 1
    assert record["tokens_per_s"] > 0
    assert record["final_loss"] is not None
    assert isinstance(record["peak_rss_mib"], float) and isinstance(record["baseline_rss_mib"], float)
    assert "trainer.compute_loss" in record["timed_methods"]
    # the user's view of memory: above the bare interpreter, above the loaded policy, against the fp32 Adam floor
    assert record["model_loaded_rss_mib"] >= record["baseline_rss_mib"] - 1
    assert 0 <= record["peak_rss_above_model_mib"] <= record["peak_rss_above_interpreter_mib"]
    assert record["peak_rss_above_interpreter_mib"] >= record["peak_rss_mib"]
    assert record["adam_floor_mib"] == pytest.approx(4 * record["model_param_mib"], abs=0.3)  # rounded to 0.1 MiB
    if trainer == "grpo":
        assert 0 < record["generation_share"] < 1
        assert {"generation", "rewards", "loss_forward"} <= set(record["phase_share"])
    else:
        assert record["generation_share"] is None


def test_phase_timer_charges_nested_calls_to_the_outer_phase():
    class Owner:
        def inner(self):
            return 1

        def outer(self):
            return self.inner() + 1

    owner = Owner()
    timer = common.PhaseTimer()
    assert timer.wrap(owner, "inner", "inner") and timer.wrap(owner, "outer", "outer")
    assert not timer.wrap(owner, "missing", "x")
    assert owner.outer() == 2
    assert set(timer.totals) == {"outer"}  # inner ran inside outer: not counted twice
    assert owner.inner() == 1
    assert set(timer.totals) == {"outer", "inner"}


def test_step_recorder_summary_drops_warmup_and_uses_cumulative_tokens():
    recorder = common.StepRecorder()
    recorder.step_seconds = [9.0, 1.0, 3.0, 2.0]
    recorder.step_cpu_seconds = [8.0, 1.0, 2.0, 1.0]
    recorder.step_phases = [{"generation": 5.0}, {"generation": 0.5}, {"generation": 1.0}, {}]
    recorder.step_phases_cpu = [{"generation": 5.0}, {"generation": 0.5}, {"generation": 0.5}, {}]
    recorder.num_tokens = {1: 100.0, 2: 200.0, 4: 500.0}  # step 3 logged none (e.g. num_iterations=2)
    recorder.losses = {1: 3.0, 4: 1.5}
    out = recorder.summary(warmup=1)
    assert out["median_step_s"] == 2.0 and out["median_step_cpu_s"] == 1.0
    assert out["step_s"] == [1.0, 3.0, 2.0]
    assert out["generation_share"] == pytest.approx(1.0 / 4.0, abs=1e-4)  # CPU seconds
    assert out["phase_share_wall"]["generation"] == pytest.approx(1.5 / 6.0, abs=1e-4)
    assert out["tokens_per_s"] == pytest.approx(400 / 6.0, abs=0.1)
    assert out["final_loss"] == 1.5
    with pytest.raises(RuntimeError, match="No timed steps"):
        recorder.summary(warmup=4)


def test_summarize_gives_ratios_of_medians_and_paired_ratios():
    records = []
    for pt, trl in [(1.0, 2.0), (2.0, 2.0), (1.5, 3.0)]:
        records.append({"impl": "posttrain", "median_step_cpu_s": pt, "median_step_s": 9.0, "peak_rss_mib": 100.0})
        records.append({"impl": "trl", "median_step_cpu_s": trl, "median_step_s": 3.0, "peak_rss_mib": 400.0})
    out = summarize("grpo", "tiny", records)
    assert out["runs"] == 3
    assert out["time_ratio"] == pytest.approx(1.5 / 2.0)
    assert out["time_ratio_paired_median"] == pytest.approx(0.5)
    assert out["wall_time_ratio"] == pytest.approx(3.0)
    assert out["peak_rss_ratio"] == pytest.approx(0.25)
    assert out["step_statistic"] == "median"
    # num_iterations=2 alternates generating and reusing steps: the ratio uses the mean step time.
    for r in records:
        r["mean_step_cpu_s"] = 1.0 if r["impl"] == "posttrain" else 4.0
    out = summarize("grpo_iter2", "tiny", records)
    assert out["step_statistic"] == "mean" and out["time_ratio"] == pytest.approx(0.25)


def test_workloads_are_consistent():
    for workload in WORKLOADS.values():
        assert workload.trainer in ("grpo", "rloo", "sft", "dpo", "kto", "reward")
        assert workload.model in common.MODEL_SPECS
        assert bool(workload.reward_funcs) == (workload.trainer in ("grpo", "rloo"))
    assert len(build_dataset("arithmetic_prompts_system", n=4)[0]["prompt"][0]["content"]) >= 256
    with pytest.raises(ValueError, match="Valid: grpo"):
        get_workload("grpo2")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--model", "huge"])


def test_arithmetic_reward():
    completions = [[{"role": "assistant", "content": "2 + 2 = 4. The answer is 4."}], "no digits", "answer 5"]
    rewards = arithmetic_reward(completions, answer=[4, 4, 4])
    assert rewards[0] == 1.0 and rewards[1] == 0.0
    assert rewards[2] == pytest.approx(0.5 / 8)


def test_vlm_grpo_workload_runs_one_step(tmp_path, capsys, monkeypatch):
    """``grpo_vlm``: the tiny LLaVA (``tiny-vlm``, saved by ``ensure_model``) trains on TRL's image format."""
    path = common.ensure_model("tiny-vlm", get_workload("grpo_vlm").task, cache_dir=tmp_path)
    assert Path(path, "processor_config.json").is_file()
    record = _run(str(tmp_path), capsys, monkeypatch, "--config", "grpo_vlm")
    assert record["config"] == "grpo_vlm" and record["model"] == "tiny-vlm"
    assert record["tokens_per_step"] > 16 * 64  # 16 prompts of 64 image tokens each, at least
    row = build_dataset("image_prompts", n=2)[0]
    assert row["image"].size == (64, 64) and row["prompt"][0]["content"][0]["type"] == "image"


def test_colour_reward():
    completions = [[{"role": "assistant", "content": "It is Red."}], "blue", "xx"]
    rewards = colour_reward(completions, answer=["red", "green", "red"])
    assert rewards[0] == 1.0 and rewards[1] == 0.5 and rewards[2] == 0.5
    assert colour_reward(["1 2"], answer=["red"]) == [0.0]


def test_both_overrides_reach_both_sides_and_get_their_own_table_rows(tmp_path, capsys):
    """`--both key=value` is parsed as JSON, passed to posttrain's run as --both and to TRL's runner as --set, and
    `table` keeps runs with overrides apart from runs without."""
    from benchmarks.__main__ import _posttrain_cmd, cmd_table

    assert common.parse_overrides(["gradient_checkpointing=false", "loss_type=sigmoid"]) == {
        "gradient_checkpointing": False,
        "loss_type": "sigmoid",
    }
    with pytest.raises(ValueError, match="key=value"):
        common.parse_overrides(["gradient_checkpointing"])
    cmd = _posttrain_cmd("sft_unpacked", "small", 2, 1, 1, None, ["gradient_checkpointing=false"])
    assert cmd[-2:] == ["--both", "gradient_checkpointing=false"]
    args = build_parser().parse_args(["run", "--config", "dpo", "--both", "gradient_checkpointing=false"])
    assert args.both == ["gradient_checkpointing=false"]
    base = {"config": "dpo", "model": "tiny", "median_step_cpu_s": 1.0, "median_step_s": 1.0}
    lines = [
        {**base, "impl": "posttrain"},
        {**base, "impl": "trl", "median_step_cpu_s": 2.0},
        {**base, "impl": "posttrain", "overrides": {"gradient_checkpointing": False}},
        {**base, "impl": "trl", "overrides": {"gradient_checkpointing": False}, "median_step_cpu_s": 4.0},
    ]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cmd_table(build_parser().parse_args(["table", str(path)]))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| dpo")]
    assert [row.split("|")[1].strip() for row in rows] == ["dpo", "dpo gradient_checkpointing=false"]
    assert "**0.50**" not in rows[0] and "| 0.50 |" in rows[0] and "| 0.25 |" in rows[1]  # CPU ratios 1/2, 1/4
