"""GRPOWithReplayBufferTrainer on the tiny offline model: zero-variance groups are swapped for buffered ones in the
training batch (and then train), TRL's config field, GRPO's metrics, and (slow) learning a cheap reward."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.experimental.grpo_with_replay_buffer import GRPOWithReplayBufferConfig, GRPOWithReplayBufferTrainer


def flat_for_odd_prompts(prompts, completion_ids, **kwargs):
    """Constant reward for odd-numbered questions (zero-std groups), a varying one for even ones."""
    return [1.0 if int(p.split()[1][:-1]) % 2 else float(sum(ids) % 7) for p, ids in zip(prompts, completion_ids)]


def _config(tmp_path, **kw) -> GRPOWithReplayBufferConfig:
    values = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, max_steps=4,
                  learning_rate=1e-2, shuffle_dataset=False)  # fmt: skip
    return fast_config(GRPOWithReplayBufferConfig, tmp_path, **{**values, **kw})


def _dataset(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


def test_config_default_and_validation(tmp_path):
    assert GRPOWithReplayBufferConfig(output_dir=str(tmp_path), report_to="none").replay_buffer_size == 64
    with pytest.raises(ValueError, match="replay_buffer_size"):
        GRPOWithReplayBufferConfig(output_dir=str(tmp_path), report_to="none", replay_buffer_size=-1)


def test_zero_std_groups_are_replaced_and_train(tmp_path, tiny_model_path):
    trainer = GRPOWithReplayBufferTrainer(
        tiny_model_path, flat_for_odd_prompts, _config(tmp_path), train_dataset=_dataset()
    )
    served = []
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda rows: served.append(prepare(rows)) or served[-1]
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logs = [h for h in trainer.state.log_history if "replay_buffer/replaced_groups" in h]
    # at least the flat group of each step (the varying one may tie by chance) is replaced
    assert len(logs) == 4 and all(h["replay_buffer/replaced_groups"] >= 1 for h in logs)
    assert 1.0 <= logs[-1]["replay_buffer/size"] <= 4.0
    for key in ("loss", "reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/region_mean"):
        assert key in trainer.state.log_history[0], key
    assert trainer.state.log_history[0]["frac_reward_zero_std"] == 0.5  # logged before the swap, as TRL
    for batch in served:  # after the swap no group of the served batch has zero advantages
        assert (batch["advantages"].abs().reshape(-1, 2).sum(dim=1) > 0).all()
        assert "old_per_token_logps" in batch
        assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())


def test_size_zero_is_plain_grpo(tmp_path, tiny_model_path):
    trainer = GRPOWithReplayBufferTrainer(
        tiny_model_path, flat_for_odd_prompts, _config(tmp_path, replay_buffer_size=0, max_steps=1),
        train_dataset=_dataset(),
    )  # fmt: skip
    trainer.train()
    assert trainer.replay_buffer is None
    assert not any("replay_buffer/size" in h for h in trainer.state.log_history)


@pytest.mark.slow
def test_learns_a_cheap_reward(tmp_path, tiny_model_path):
    """reward = fraction of completion tokens equal to the byte "a": it rises from ~0 within a few dozen steps."""

    def fraction_of_a(completion_ids, **kwargs):
        return [sum(t == 97 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = _config(tmp_path, per_device_train_batch_size=32, num_generations=16, max_completion_length=4,
                   max_steps=20, learning_rate=2e-2, seed=0, shuffle_dataset=True)  # fmt: skip
    trainer = GRPOWithReplayBufferTrainer(
        tiny_model_path, fraction_of_a, args, train_dataset=Dataset.from_list([{"prompt": "a:"}] * 8)
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert rewards[0] < 0.05
    assert sum(rewards[-5:]) / 5 > 0.5
    assert torch.isfinite(torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])).all()
