"""Smoke tests of the fidelity harness (``python -m benchmarks fidelity``) without TRL: the posttrain half of two
scenarios (a preference trainer and GRPO/RLOO with fixed completions) and the step-by-step comparison on synthetic
logs."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if not getattr(sys.modules.get("benchmarks"), "__file__", None):  # see test_bench_smoke.py
    sys.modules.pop("benchmarks", None)
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import fidelity  # noqa: E402
from benchmarks.fidelity_runner import trainer_classes  # noqa: E402


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> dict[str, str]:
    from posttrain.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("fidelity-models")
    return {"causal-lm": save_tiny_model(str(root / "lm"))}


@pytest.mark.parametrize("name", ["kto/kto", "rloo/default"])
def test_posttrain_half_of_a_scenario_logs_every_step(name, model_paths, tmp_path):
    scenario = dataclasses.replace(fidelity.SCENARIOS[name], steps=2)
    logs = fidelity.run_scenario(scenario, model_paths, trainer_classes("posttrain"), str(tmp_path))
    assert [row["step"] for row in logs] == [1, 2]
    assert all("loss" in row and "grad_norm" in row for row in logs)
    again = fidelity.run_scenario(scenario, model_paths, trainer_classes("posttrain"), str(tmp_path))
    assert fidelity.compare(name, {"logs": logs}, {"logs": again}).status == "equal"  # deterministic


def test_fixed_completions_are_a_pure_function_of_the_prompt():
    a = fidelity.fixed_completion([1, 2, 3], 0, 12, 258)
    assert a == fidelity.fixed_completion([1, 2, 3], 0, 12, 258)
    assert a != fidelity.fixed_completion([1, 2, 3], 1, 12, 258)
    assert 2 <= len(a[0]) <= 12 and len(a[0]) == len(a[1])


def test_compare_reports_first_differing_step_and_one_sided_keys():
    ours = {"logs": [{"step": 1, "loss": 1.0, "kl": 0.0, "x": 3}, {"step": 2, "loss": 0.5, "kl": 0.1, "x": 3}]}
    same = {"logs": [{"step": 1, "loss": 1.00001, "kl": 0.0}, {"step": 2, "loss": 0.5, "kl": 0.1}]}
    result = fidelity.compare("s", ours, same)
    assert result.status == "equal" and result.only_posttrain == ["x"] and result.keys_compared == 2
    other = {"logs": [{"step": 1, "loss": 1.0, "kl": 0.0}, {"step": 2, "loss": 0.6, "kl": 0.1}]}
    result = fidelity.compare("s", ours, other)
    assert (result.status, result.first_diff_step, result.differing_keys) == ("differs", 2, ["loss"])
    assert fidelity.compare("s", ours, other, keys=("kl",)).status == "equal"
    assert fidelity.compare("s", {"error": "ValueError: a"}, {"error": "ValueError: b"}).status == "equal"
    assert fidelity.compare("s", {"error": "KeyError: a"}, other).status == "error"
    table = fidelity.markdown_table([result], {"s": "pending"})
    assert "| s | **differs** (known: pending) | 2 | loss |" in table


def test_scenario_grid_covers_every_trainer_and_loss_type():
    names = set(fidelity.SCENARIOS)
    stable = {"sft", "dpo", "kto", "reward", "grpo", "rloo"}
    trainers = {s.trainer for s in fidelity.SCENARIOS.values()}
    assert stable <= trainers and trainers - stable <= set(fidelity.EXPERIMENTAL)
    assert all(f"dpo/{loss}" in names for loss in fidelity.DPO_LOSSES)
    for loss in fidelity.GRPO_LOSSES:
        assert {f"grpo/{loss}_beta{b}_mu{m}" for b in (0.0, 0.04) for m in (1, 2)} <= names
    assert fidelity.select(["kto/"]) and all(s.trainer == "kto" for s in fidelity.select(["kto/"]))
