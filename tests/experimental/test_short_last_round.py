"""An epoch whose last batch is short: Online DPO, A2PO and GKD train on it, as TRL's versions do (their plain
Trainer dataloader keeps it; 7 prompts at batch 2 are 4 steps, the last with 1 prompt), unless
``dataloader_drop_last``; the RepeatSampler trainers (GRPO, RLOO, distillation, GOLD, IW-OPD, SDPO, SDFT) drop it."""

from __future__ import annotations

import math

import pytest
from datasets import Dataset
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.experimental.a2po import A2POConfig, A2POTrainer
from posttrain.experimental.gkd import GKDConfig, GKDTrainer
from posttrain.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

N = 7


def _reward(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def _prompts(n=N):
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


def _conversations(n=N):
    return Dataset.from_list(
        [{"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "abc" * (1 + i % 2)}]}
         for i in range(n)]
    )  # fmt: skip


def _trainer(kind, model, tmp_path, dataset=None, **extra):
    common = {**dict(per_device_train_batch_size=2, num_train_epochs=1, max_steps=-1, learning_rate=1e-3), **extra}
    if kind == "online_dpo":
        args = fast_config(OnlineDPOConfig, tmp_path, max_new_tokens=4, **common)
        return OnlineDPOTrainer(model, reward_funcs=_reward, args=args, train_dataset=dataset or _prompts())
    if kind == "a2po":
        args = fast_config(A2POConfig, tmp_path, max_completion_length=4, num_value_samples=2,
                           filter_all_incorrect=False, **common)  # fmt: skip
        return A2POTrainer(model, _reward, args, train_dataset=dataset or _prompts())
    args = fast_config(GKDConfig, tmp_path, max_new_tokens=4, **common)
    return GKDTrainer(model, model, args=args, train_dataset=dataset or _conversations())


def _round_rows(trainer):
    """Spy on the rollout: rows of each training round."""
    seen = []
    generate = trainer._generate_and_score

    def spy(rows, mode):
        if mode == "train":
            seen.append(len(rows))
        return generate(rows, mode)

    trainer._generate_and_score = spy
    return seen


@pytest.mark.parametrize("kind", ["online_dpo", "a2po", "gkd"])
def test_the_short_last_batch_is_trained(kind, tiny_model_path, tmp_path):
    trainer = _trainer(kind, tiny_model_path, tmp_path)
    rounds = _round_rows(trainer)
    trainer.train()
    per_prompt = 2 if kind == "online_dpo" else 1  # Online DPO's rows are each prompt twice
    assert trainer.state.global_step == trainer.state.max_steps == math.ceil(N / 2) == 4
    assert rounds == [2 * per_prompt] * 3 + [1 * per_prompt]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 4 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert trainer.state.epoch == 1


@pytest.mark.parametrize("kind", ["online_dpo", "gkd"])
def test_dataloader_drop_last_drops_it(kind, tiny_model_path, tmp_path):
    trainer = _trainer(kind, tiny_model_path, tmp_path, dataloader_drop_last=True)
    trainer.train()
    assert trainer.state.global_step == trainer.state.max_steps == 3


def test_a_stream_keeps_its_short_last_batch_too(tiny_model_path, tmp_path):
    stream = _prompts().to_iterable_dataset()
    trainer = _trainer("online_dpo", tiny_model_path, tmp_path, dataset=stream, max_steps=10)
    rounds = _round_rows(trainer)
    trainer.train()
    assert rounds[:4] == [4, 4, 4, 2]  # the stream's first pass: 3 full rounds and the short one


def test_gradient_accumulation_keeps_dropping_a_short_round(tiny_model_path, tmp_path):
    # GKD generates once per optimizer step: a round spans gradient_accumulation_steps micro-steps and cannot be
    # short (README, deliberate differences); 7 rows at 2 × 2 per step are 1 step plus 3 dropped rows.
    trainer = _trainer("gkd", tiny_model_path, tmp_path, gradient_accumulation_steps=2)
    trainer.train()
    assert trainer.state.global_step == 1
