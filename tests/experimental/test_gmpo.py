"""GMPOTrainer end to end on the tiny offline model: TRL's config defaults, a training step that changes the
parameters and logs GRPO's metrics, the loss on a fixed rollout, and (slow) learning a cheap reward."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from experimental_helpers import merged_logs
from reward_helpers import varied_reward
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.core.policy_objectives import POLICY_OBJECTIVES
from posttrain.core.presets import GRPO_LOSS_PRESETS, GRPO_LOSS_TYPES, needs_grad_accum_division, resolve_grpo_loss
from posttrain.experimental.gmpo import GMPOConfig, GMPOTrainer
from posttrain.trainers.grpo import GRPOConfig

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path, **kw) -> GMPOConfig:
    values = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=1,
                  learning_rate=1e-2)  # fmt: skip
    return fast_config(GMPOConfig, tmp_path, **{**values, **kw})


def _dataset(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


def test_config_defaults(tmp_path):
    args = GMPOConfig(output_dir=str(tmp_path), report_to="none")
    assert args.epsilon == 0.4 and args.epsilon_high is None and args.loss_type == "gmpo"
    assert args.learning_rate == 1e-6 and args.beta == 0.0


def test_the_package_registers_its_preset_which_the_stable_config_does_not_offer():
    assert GRPO_LOSS_PRESETS["gmpo"] == ("gmpo", "seq_mean_token_mean")
    objective, _ = resolve_grpo_loss("gmpo")
    assert objective is POLICY_OBJECTIVES.get("gmpo") and needs_grad_accum_division("gmpo")
    loss_type = {f.name: f for f in dataclasses.fields(GRPOConfig)}["loss_type"].metadata
    assert "gmpo" not in GRPO_LOSS_TYPES and "gmpo" not in loss_type["choices"] and "gmpo" not in loss_type["help"]
    assert loss_type["choices"] == ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]  # TRL's


def _fresh_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1", "POSTTRAIN_NO_REPORT": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)  # fmt: skip


def test_stable_grpo_config_resolves_gmpo_only_once_the_package_is_imported(tmp_path):
    """A fresh process: ``GRPOConfig(loss_type="gmpo")`` fails naming the package that registers it, and works after
    ``import posttrain.experimental.gmpo``."""
    result = _fresh_python(
        f"""
        import posttrain
        from posttrain import GRPOConfig
        try:
            GRPOConfig(output_dir={str(tmp_path)!r}, loss_type="gmpo", report_to="none")
        except ValueError as err:
            print("rejected:", err)
        import posttrain.experimental.gmpo
        print("accepted:", GRPOConfig(output_dir={str(tmp_path)!r}, loss_type="gmpo", report_to="none").loss_type)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rejected, accepted = result.stdout.strip().splitlines()[-2:]
    assert rejected.startswith("rejected: Unknown loss_type 'gmpo'") and "posttrain.experimental.gmpo" in rejected
    assert accepted == "accepted: gmpo"


def test_experimental_run_cli_trains_gmpo(tmp_path, tiny_model_path):
    """``python -m posttrain.experimental.run gmpo`` in a fresh process: the recipe's loss type resolves and trains."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1", "POSTTRAIN_NO_REPORT": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "posttrain.experimental.run", "gmpo", "--config", "examples/gmpo.yaml",
         "--model_name_or_path", tiny_model_path, "--max_steps", "1", "--num_generations", "2",
         "--per_device_train_batch_size", "2", "--max_completion_length", "4", "--output_dir", str(out)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "run_config.json").read_text())["loss_type"] == "gmpo"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in records)


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_trains_and_logs_trl_metrics(tmp_path, tiny_model_path, beta):
    trainer = GMPOTrainer(tiny_model_path, varied_reward, _config(tmp_path, beta=beta), train_dataset=_dataset())
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logs = merged_logs(trainer)
    for key in ("loss", "reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/low_mean",
                "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
                "completions/mean_length"):  # fmt: skip
        assert key in logs, key
    assert ("kl" in logs) == (beta != 0.0)


def test_loss_on_a_fixed_rollout_equals_the_formula(tmp_path, tiny_model_path):
    """Off-policy micro-batch (old log-probs shifted): the trainer's loss is mean_i −exp(mean_t clip(ℓ)) · A_i / GA."""
    trainer = GMPOTrainer(
        tiny_model_path, varied_reward, _config(tmp_path, gradient_accumulation_steps=2), train_dataset=_dataset()
    )
    batch = {
        "prompt_ids": torch.tensor([[40, 41, 42], [0, 43, 44]]),
        "prompt_mask": torch.tensor([[1, 1, 1], [0, 1, 1]]),
        "completion_ids": torch.tensor([[50, 51, 52], [53, 54, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "completion_lengths": torch.tensor([3, 2]),
        "advantages": torch.tensor([1.5, -0.5]),
        "num_items_in_batch": torch.tensor(5),
    }
    trainer.model.train()
    logps = trainer._token_stats(trainer.model, batch).logps.detach()
    shift = torch.tensor([[0.6, -0.1, 0.0], [-0.7, 0.2, 0.0]])
    batch["old_per_token_logps"] = logps - shift  # ℓ = shift
    trainer.current_gradient_accumulation_steps = 2
    loss = trainer.compute_loss(trainer.model, batch)
    # row 0 (A > 0): 0.6 -> 0.4: mean (0.4 - 0.1 + 0) / 3.  row 1 (A < 0): -0.7 -> -0.4: mean (-0.4 + 0.2) / 2.
    expected = (-math.exp(0.3 / 3) * 1.5 + math.exp(-0.1) * 0.5) / 2 / 2
    assert math.isclose(float(loss), expected, rel_tol=1e-4)


@pytest.mark.slow
def test_learns_a_cheap_reward(tmp_path, tiny_model_path):
    """reward = fraction of completion tokens equal to the byte "a": it rises from ~0 within a few dozen steps."""

    def fraction_of_a(completion_ids, **kwargs):
        return [sum(t == 97 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = _config(tmp_path, per_device_train_batch_size=32, num_generations=16, max_completion_length=4,
                   max_steps=20, learning_rate=2e-2, seed=0)  # fmt: skip
    trainer = GMPOTrainer(tiny_model_path, fraction_of_a, args, train_dataset=Dataset.from_list([{"prompt": "a:"}] * 8))
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert rewards[0] < 0.05
    assert sum(rewards[-5:]) / 5 > 0.5
