"""The GPU verification script (`python -m benchmarks.gpu.run`, issue 42) in its CPU dry run, so it cannot rot
between lent GPU machines: every section runs on a tiny model, the report has the structure the README promises,
CUDA-only parts are skipped with reasons, a failing section is recorded and the run goes on, and without `datasets`
(as on the GPU machine unless wheels are carried) the trainer sections are skipped with the fix named."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["env", "gpu_tests", "numerics", "train_sft", "train_dpo", "train_grpo", "trl_sft", "trl_dpo", "trl_grpo"]


def _run(out: Path, *flags: str, timeout: float = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu.run", "--out", str(out), "--dry-run", *flags],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.md").read_text().startswith("# posttrain GPU verification report")
    return report


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("gpu-dry")
    return _run(base / "out", "--cache-dir", str(base / "cache"))


def test_dry_run_report_has_every_section_and_the_not_run_list(dry_report):
    assert dry_report["dry_run"] is True
    assert list(dry_report["sections"]) == SECTIONS
    assert dry_report["elapsed_s"] < dry_report["budget_s"]
    assert dry_report["sections"]["env"]["status"] == "ok"
    assert dry_report["sections"]["env"]["cuda_available"] is False  # the dry run hides CUDA even on a GPU machine
    not_run = " ".join(item["what"] for item in dry_report["not_run"])
    for topic in ("vLLM", "NCCL", "multi-GPU"):
        assert topic in not_run
    for name, section in dry_report["sections"].items():
        assert section["status"] in ("ok", "skipped"), (name, section)
        if section["status"] == "skipped":
            assert section["reason"], name


def test_dry_run_gpu_tests_section_runs_the_gpu_marked_files_without_vllm(dry_report):
    tests = dry_report["sections"]["gpu_tests"]
    assert "tests/core/test_logprobs.py" in tests["files"]
    assert all("vllm" not in f for f in tests["files"])
    assert any("vllm" in e["file"] for e in tests["excluded"])
    # on CPU the CUDA tests are collected and skipped with their reason, never silently dropped
    assert tests["tests"] and all(t["outcome"] == "skipped" and "CUDA" in t["message"] for t in tests["tests"])


def test_dry_run_numerics_cover_kernels_attention_and_loss_precision(dry_report):
    numerics = dry_report["sections"]["numerics"]
    names = {c["name"] for c in numerics["checks"]}
    for expected in (
        "logprobs/chunked/float32/logps",
        "logprobs/chunked/float32/grad_weight",
        "logprobs/vocab_tiled/float32/entropy",
        "logprobs/vocab_tiled/float32/grad_hidden",
        "block_attention/float32/out",
        "block_attention/float32/grad_k",
        "loss_bf16_vs_fp32/sft",
        "loss_bf16_vs_fp32/dpo",
        "loss_bf16_vs_fp32/grpo",
    ):
        assert expected in names
    for check in numerics["checks"]:
        assert check["passed"] and 0.0 <= check["measured"] <= check["tolerance"], check
    assert numerics["skipped"] and "CUDA" in numerics["skipped"][0]


def test_dry_run_trains_each_trainer_and_measures_it(dry_report):
    for kind in ("sft", "dpo", "grpo"):
        section = dry_report["sections"][f"train_{kind}"]
        assert section["status"] == "ok" and section["library"] == "posttrain"
        assert section["steps"] == section["config"]["max_steps"]
        assert section["median_step_s"] > 0 and section["tokens_per_s"] > 0
        assert math.isfinite(section["final_loss"])
        assert section["peak_cuda_mib"] is None and section["skipped"]
    assert dry_report["sections"]["train_sft"]["config"]["packing"] is True
    assert dry_report["sections"]["train_grpo"]["config"]["num_generations"] == 8
    for kind in ("sft", "dpo", "grpo"):  # TRL is not a dependency: its side is optional, detected at run time
        trl = dry_report["sections"][f"trl_{kind}"]
        if trl["status"] == "skipped":
            assert "not importable" in trl["reason"] and "fetch_wheels.sh" in trl["reason"]


def test_without_datasets_the_trainer_sections_are_skipped_with_the_fix(tmp_path):
    """What the GPU machine does when no wheels are carried: `datasets` (and `pytest`) absent → skipped, the reason
    names the carry."""
    report = _run(tmp_path / "out", "--sections", "gpu_tests,train_sft,trl_sft", "--hide", "datasets,trl,pytest")
    tests = report["sections"]["gpu_tests"]
    assert tests["status"] == "skipped" and "pytest not importable" in tests["reason"]
    assert "tests/core/test_logprobs.py" in tests["files"]
    sft = report["sections"]["train_sft"]
    assert sft["status"] == "skipped" and sft["missing"] == ["datasets"]
    assert "--wheels" in sft["reason"]
    assert report["sections"]["trl_sft"]["status"] == "skipped"
    assert "hidden by --hide" in report["sections"]["trl_sft"]["reason"]
    assert report["hidden_modules"] == ["datasets", "trl", "pytest"]


def test_a_failing_section_is_recorded_and_the_next_one_runs(tmp_path):
    """A broken model directory makes both trainer sections raise: each is recorded with its traceback tail."""
    cache = tmp_path / "cache"
    (cache / "model-tiny").mkdir(parents=True)
    (cache / "model-tiny" / "config.json").write_text("not json")
    report = _run(tmp_path / "out", "--sections", "train_sft,train_dpo", "--cache-dir", str(cache))
    for name in ("train_sft", "train_dpo"):
        section = report["sections"][name]
        assert section["status"] == "error"
        assert "Error" in section["error"] and "File " in section["error"]  # the traceback tail
    assert "### train_dpo: error" in (tmp_path / "out" / "report.md").read_text()


def test_sections_past_the_budget_are_skipped(tmp_path):
    report = _run(tmp_path / "out", "--sections", "env", "--budget-s", "5")
    assert report["sections"]["env"] == {"status": "skipped", "reason": "budget exhausted (5 s left)"}
