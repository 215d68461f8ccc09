"""A2POTrainer on the tiny offline model: TRL's config defaults, stage 1 V* from num_value_samples samples (and
filter_all_incorrect), the stage-2 loss on a fixed rollout, an end-to-end run with TRL's metric names, and (slow)
learning a cheap reward."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from reward_helpers import VariedReward
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.core.masking import masked_sum
from posttrain.experimental.a2po import A2POConfig, A2POTrainer

varied_reward = VariedReward(modulus=2)  # rewards 0/1, like a verifier's


def _config(tmp_path, **kw) -> A2POConfig:
    values = dict(per_device_train_batch_size=4, max_completion_length=6, max_steps=2, learning_rate=1e-2,
                  num_value_samples=4, filter_all_incorrect=False)  # fmt: skip
    return fast_config(A2POConfig, tmp_path, **{**values, **kw})


def _dataset(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


def test_config_defaults(tmp_path):
    args = A2POConfig(output_dir=str(tmp_path), report_to="none")
    assert (args.num_value_samples, args.beta1, args.beta2, args.filter_all_incorrect) == (8, 0.5, 1e-3, True)
    assert (args.max_prompt_length, args.max_completion_length, args.temperature, args.top_p) == (512, 256, 1.0, 1.0)
    assert args.learning_rate == 5e-5 and args.num_generations == 1 and args.beta == 1e-3
    with pytest.raises(ValueError):
        A2POConfig(output_dir=str(tmp_path), report_to="none", num_generations=2)


def test_stage_one_values_and_filter(tmp_path, tiny_model_path):
    seen = []

    def first_prompts_only(prompts, completion_ids, **kwargs):
        seen.append(len(prompts))
        return [1.0 if p in ("Question 0:", "Question 1:") and i % 2 == 0 else 0.0 for i, p in enumerate(prompts)]

    args = _config(tmp_path, filter_all_incorrect=True, per_device_train_batch_size=2)
    trainer = A2POTrainer(tiny_model_path, first_prompts_only, args, train_dataset=_dataset(4))
    trainer._estimate_optimal_values()
    assert seen == [8, 8]  # two chunks of 2 prompts × num_value_samples = 4
    values = sorted(trainer._optimal_values.values())
    # prompts 0, 1: rewards [1, 0, 1, 0] → 0.5·log((2e² + 2)/4); prompts 2, 3: all zero → 0 (and filtered)
    expected = 0.5 * math.log((2 * math.e**2 + 2) / 4)
    assert values == pytest.approx([0.0, 0.0, expected, expected])
    assert sorted(trainer.train_dataset["prompt"]) == ["Question 0:", "Question 1:"]


def test_loss_on_a_fixed_rollout_equals_the_formula(tmp_path, tiny_model_path):
    trainer = A2POTrainer(tiny_model_path, varied_reward, _config(tmp_path, beta2=0.1), train_dataset=_dataset())
    batch = {
        "prompt_ids": torch.tensor([[40, 41], [0, 43]]),
        "prompt_mask": torch.tensor([[1, 1], [0, 1]]),
        "completion_ids": torch.tensor([[50, 51, 52], [53, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "completion_lengths": torch.tensor([3, 1]),
        "advantages": torch.tensor([0.3, -0.2]),
        "num_items_in_batch": torch.tensor(4),
    }
    logps = trainer._token_stats(trainer.model, batch).logps.detach()
    mask = batch["completion_mask"].float()
    batch["ref_per_token_logps"] = (logps - torch.tensor([[0.5], [-1.0]]) / mask.sum(1, keepdim=True)) * mask
    loss = float(trainer.compute_loss(trainer.model, batch))
    # implicit rewards 0.1 · (0.5, −1.0); targets (0.3, −0.2)
    assert math.isclose(loss, ((0.05 - 0.3) ** 2 + (-0.1 + 0.2) ** 2) / 2, rel_tol=1e-4)
    assert masked_sum(logps, mask, dim=-1).shape == (2,)


def test_trains_and_logs_trl_metrics(tmp_path, tiny_model_path):
    trainer = A2POTrainer(tiny_model_path, varied_reward, _config(tmp_path), train_dataset=_dataset())
    assert trainer.reference.kind != "none"
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logs = {k: v for h in trainer.state.log_history for k, v in h.items()}
    for key in ("loss", "reward", "v_star", "implicit_reward", "advantage", "completions/mean_length"):
        assert key in logs, key
    assert len(trainer._optimal_values) == 8


@pytest.mark.slow
def test_learns_a_cheap_reward(tmp_path, tiny_model_path):
    """reward = fraction of completion tokens equal to the byte "a": it rises from ~0 within a few dozen steps."""

    def fraction_of_a(completion_ids, **kwargs):
        return [sum(t == 97 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = _config(tmp_path, per_device_train_batch_size=16, max_completion_length=4, max_steps=20,
                   learning_rate=2e-2, lr_scheduler_type="constant", beta2=0.02, num_value_samples=8, seed=0)  # fmt: skip
    dataset = Dataset.from_list([{"prompt": f"a{i}:"} for i in range(32)])
    trainer = A2POTrainer(tiny_model_path, fraction_of_a, args, train_dataset=dataset)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert rewards[0] < 0.05
    assert sum(rewards[-5:]) / 5 > 0.5
