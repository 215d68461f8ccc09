"""Every trainer runs a whole epoch whose last batch is smaller than the others (dataset size not a multiple of
the batch size): metric reductions over that batch must not trim fixed-size statistics vectors (issue 18, item 1).
The 2-process (torchrun + gloo) variant for SFT, DPO and Reward is in tests/reliability/test_multiprocess.py."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain import (
    DistillationConfig,
    DistillationTrainer,
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
)

N = 10  # rows: batches of 4, 4 and 2


def _pairs(n=N):
    return Dataset.from_list(
        [{"prompt": f"Q{i}:", "chosen": " yes" * (1 + i % 3), "rejected": " no" * (1 + i % 2)} for i in range(n)]
    )


def _unpaired(n=N):
    return Dataset.from_list(
        [{"prompt": f"Q{i}:", "completion": " yes" if i % 2 else " no no", "label": bool(i % 2)} for i in range(n)]
    )


CASES = {
    "sft": (SFTConfig, SFTTrainer, lambda: Dataset.from_list([{"text": f"Row {i} text" * (1 + i % 3)} for i in range(N)]), {}),
    "sft_packing": (
        SFTConfig, SFTTrainer, lambda: Dataset.from_list([{"text": f"Row {i} text" * (1 + i % 3)} for i in range(18)]),
        {"packing": True, "max_length": 32},
    ),
    "dpo": (DPOConfig, DPOTrainer, _pairs, {}),
    "kto": (KTOConfig, KTOTrainer, _unpaired, {}),
    "reward": (RewardConfig, RewardTrainer, _pairs, {}),
    "grpo": (GRPOConfig, GRPOTrainer, lambda: Dataset.from_list([{"prompt": f"Q{i}:"} for i in range(N // 2)]),
             {"num_generations": 2, "max_completion_length": 4}),
    "rloo": (RLOOConfig, RLOOTrainer, lambda: Dataset.from_list([{"prompt": f"Q{i}:"} for i in range(N // 2)]),
             {"num_generations": 2, "max_completion_length": 4}),
    "distillation": (DistillationConfig, DistillationTrainer, lambda: Dataset.from_list([{"prompt": f"Q{i}:"} for i in range(N)]),
                     {"max_completion_length": 4}),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(CASES))
def test_one_epoch_with_a_short_last_batch(kind, tiny_model_path, tiny_reward_model_path, tmp_path):
    config_class, trainer_class, data, extra = CASES[kind]
    args = fast_config(
        config_class, tmp_path, per_device_train_batch_size=4, num_train_epochs=1, learning_rate=1e-3, **extra
    )
    kwargs = {}
    if kind in ("grpo", "rloo"):
        kwargs["reward_funcs"] = varied_reward
    if kind == "reward":
        model = tiny_reward_model_path
    else:
        model = tiny_model_path
    if kind == "distillation":
        kwargs["teacher_model"] = tiny_model_path
    trainer = trainer_class(model, args=args, train_dataset=data(), **kwargs)
    seen = []
    if kind == "reward":
        log_metrics = trainer._log_reward_metrics

        def spy(mode, inputs, chosen, rejected):
            seen.append(torch.cat([chosen, rejected]))
            return log_metrics(mode, inputs, chosen, rejected)

        trainer._log_reward_metrics = spy
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    # online trainers draw whole generation batches (TRL's RepeatSampler drops a partial one); the others step
    # on the short last batch too
    if kind in ("grpo", "rloo", "distillation"):
        assert len(logs) == trainer.state.max_steps == 2
    else:
        rows = len(trainer.train_dataset)  # packed rows for sft_packing
        assert rows % 4 in (1, 2) and len(logs) == trainer.state.max_steps == math.ceil(rows / 4)
    assert trainer.state.epoch == 1
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    if kind.startswith("sft"):
        counts = [entry["num_tokens"] for entry in logs]
        assert counts == sorted(counts) and counts[-1] > counts[-2]
    if kind == "reward":  # the last batch's rewards: both halves, not the chosen half cut to the batch's row count
        assert len(seen[-1]) == 4
        assert logs[-1]["mean_reward"] == pytest.approx(seen[-1].mean().item(), rel=1e-5)
        assert logs[-1]["min_reward"] == pytest.approx(seen[-1].min().item(), rel=1e-5)
