"""On-policy GRPO with truncated sampling (top-p / top-k / min-p) on posttrain's group sampler: the rollout
importance ratio is 1 on every token with TRL 1.17's kept-mass correction, and measurably not without it (the
``sampling/uncorrected_importance_sampling_ratio/*`` metrics log the ratio as TRL 1.16 computes it)."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


def _logs(trainer) -> dict:
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    return merged


@pytest.mark.parametrize(
    "knobs",
    [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.1, temperature=0.3)],
    ids=["top_p", "top_k", "min_p"],
)
def test_on_policy_ratio_is_one_with_the_kept_mass_correction(tiny_model_path, tmp_path, knobs):
    args = fast_config(
        GRPOConfig,
        tmp_path,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-2,
        num_iterations=1,
        rollout_importance_sampling=True,  # the correction on posttrain's own sampler (not only vLLM)
        vllm_importance_sampling_mode="token_truncate",
        **knobs,
    )
    dataset = Dataset.from_list([{"prompt": f"Question {i}:", "solution": str(i)} for i in range(8)])
    trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=dataset)
    trainer.train()
    logs = _logs(trainer)
    # corrected: every token's ratio (before and after the clip) is 1 to float tolerance
    for key in ("importance_sampling_ratio/min", "importance_sampling_ratio/max",
                "raw_importance_sampling_ratio/min", "raw_importance_sampling_ratio/max"):  # fmt: skip
        assert logs[f"sampling/{key}"] == pytest.approx(1.0, abs=1e-4), key
    assert logs["sampling/raw_importance_sampling_ratio/frac_outside"] == 0.0
    assert logs["sampling/sampling_logp_difference/max"] < 1e-4
    # uncorrected (processed log-probs against the full softmax): the bias is the kept mass, < 1 on every token
    assert logs["sampling/log_kept_mass/mean"] < -0.01
    assert logs["sampling/uncorrected_importance_sampling_ratio/mean"] < 0.99
    assert logs["sampling/uncorrected_importance_sampling_ratio/max"] <= 1.0 + 1e-4
    assert logs["sampling/uncorrected_importance_sampling_ratio/frac_outside"] > 0.0


def test_off_policy_mask_measures_drift_on_the_full_softmax_scale(tiny_model_path, tmp_path):
    """On-policy, negative advantages, δ = 0.1, a top-p sampler that kept S = 0.8 on every token: its processed
    log-probs are higher by −log 0.8 = 0.223 > δ, so without the kept mass every sequence would be dropped (loss 0);
    with it the drift is 0 and every sequence is kept."""
    args = fast_config(
        GRPOConfig, tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        rollout_importance_sampling=True, off_policy_mask_threshold=0.1,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(4)])
    trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=dataset)
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 6)
    logps = -torch.rand(4, 6, generator=generator) - 0.5
    inputs = {
        "advantages": -torch.ones(4),
        "importance_sampling_ratio": torch.ones(4, 6),
        "sampling_per_token_logps": logps - math.log(0.8),  # log(p / S)
        "sampling_log_kept_mass": torch.full((4, 6), math.log(0.8)),
    }
    kept, _ = trainer._policy_term(logps, logps, inputs, mask, None)
    assert (kept != 0).all()
    uncorrected = {k: v for k, v in inputs.items() if k != "sampling_log_kept_mass"}
    dropped, _ = trainer._policy_term(logps, logps, uncorrected, mask, None)
    assert (dropped == 0).all()


@pytest.mark.parametrize(
    "knobs",
    [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.1, temperature=0.3)],
    ids=["top_p", "top_k", "min_p"],
)
def test_on_policy_ratio_is_one_with_the_sampling_mask_replayed(tiny_model_path, tmp_path, knobs):
    """keep_sampling_mask: π_old is the masked softmax over the sampler's kept support, i.e. the sampler's own
    processed distribution, so the ratio against the processed log-probs is 1 on every token with no kept-mass
    correction (``uncorrected_*`` = raw); without the mask the same comparison shows the bias (< 1)."""
    logs = {}
    for keep in (True, False):
        args = fast_config(
            GRPOConfig, tmp_path / str(keep), per_device_train_batch_size=4, num_generations=2,
            max_completion_length=8, max_steps=1, learning_rate=1e-2, num_iterations=1,
            rollout_importance_sampling=True, vllm_importance_sampling_mode="token_truncate",
            keep_sampling_mask=keep, beta=0.04, **knobs,
        )  # fmt: skip
        dataset = Dataset.from_list([{"prompt": f"Question {i}:", "solution": str(i)} for i in range(8)])
        trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=dataset)
        trainer.train()
        logs[keep] = _logs(trainer)
    masked, full = logs[True], logs[False]
    for key in ("uncorrected_importance_sampling_ratio/min", "uncorrected_importance_sampling_ratio/max",
                "raw_importance_sampling_ratio/min", "raw_importance_sampling_ratio/max"):  # fmt: skip
        assert masked[f"sampling/{key}"] == pytest.approx(1.0, abs=1e-4), key
    assert masked["sampling/uncorrected_importance_sampling_ratio/frac_outside"] == 0.0
    assert masked["sampling/log_kept_mass/mean"] == 0.0  # no correction was needed on any token
    assert masked["sampling_mask/frac_full_softmax"] == 0.0
    assert masked["sampling_mask/frac_ids"] + masked["sampling_mask/frac_threshold"] == pytest.approx(1.0)
    if "top_k" in knobs:
        assert masked["sampling_mask/frac_ids"] == 1.0 and 1.0 <= masked["sampling_mask/mean_kept_ids"] <= 5.0
    # without the mask: the trainer's full softmax against the sampler's truncated distribution, the bias
    assert full["sampling/uncorrected_importance_sampling_ratio/mean"] < 0.99
    assert full["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)  # (TRL 1.17 fixes it)
    assert "sampling_mask/frac_ids" not in full
    # the entropy is over the kept support too: smaller than the full softmax's
    assert masked["entropy"] < full["entropy"]
    # π_ref over the same support: at the first step (policy = reference) the KL is 0 (a full-softmax π_ref against
    # the masked π_θ would give k3(log S) > 0 on every truncated token)
    assert masked["kl"] == pytest.approx(0.0, abs=1e-6)


def test_sampling_mask_is_replayed_without_an_importance_correction(tiny_model_path, tmp_path):
    """keep_sampling_mask alone (no rollout_importance_sampling: the sampler returns no log-probs) still records
    and replays the support: every token described, the entropy over the kept ids only (it used to do nothing)."""
    logs = {}
    for keep in (True, False):
        args = fast_config(
            GRPOConfig, tmp_path / str(keep), per_device_train_batch_size=4, num_generations=2,
            max_completion_length=8, max_steps=1, learning_rate=1e-2, top_k=5, keep_sampling_mask=keep,
        )  # fmt: skip
        dataset = Dataset.from_list([{"prompt": f"Question {i}:", "solution": str(i)} for i in range(8)])
        trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=dataset)
        trainer.train()
        logs[keep] = _logs(trainer)
    masked, full = logs[True], logs[False]
    assert masked["sampling_mask/frac_ids"] == 1.0 and 1.0 <= masked["sampling_mask/mean_kept_ids"] <= 5.0
    assert "sampling_mask/frac_ids" not in full
    assert masked["entropy"] <= math.log(5) + 1e-4 < full["entropy"]  # at most 5 kept tokens: H ≤ log 5
