"""Exact resume: N uninterrupted steps ≡ k steps, stop, fresh trainer resumes to N (bitwise on CPU).

Each test runs three trainers on the tiny model: (A) N steps straight; (B) the same run stopped after step k by a
callback, right after saving checkpoint-k; (C) a new trainer, built from scratch like B, that resumes from
checkpoint-k and trains to N. C's final parameters must equal A's bit for bit: CPU math is deterministic, so any
difference means some state (optimizer, scheduler, RNG, data position, generation buffer, controller) was lost.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

COMMON = dict(
    logging_steps=1,
    report_to="none",
    gradient_checkpointing=False,
    disable_tqdm=True,
    per_device_train_batch_size=2,
    learning_rate=1e-3,
)


class _StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _check_exact_resume(make, tmp_path, total: int, stop_at: int) -> tuple:
    """Run A/B/C (see the module docstring); returns (trainer A, trainer C) after asserting bitwise equality."""
    full = make(tmp_path / "full", max_steps=total, save_strategy="no")
    initial = _params(full.model)
    full.train()

    stopped = make(tmp_path / "stopped", max_steps=total, save_strategy="steps", save_steps=stop_at)
    stopped.add_callback(_StopAt(stop_at))
    stopped.train()
    assert stopped.state.global_step == stop_at
    checkpoint = tmp_path / "stopped" / f"checkpoint-{stop_at}"
    assert checkpoint.is_dir()

    resumed = make(tmp_path / "stopped", max_steps=total, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == total

    assert any(not torch.equal(a, b) for a, b in zip(initial, full.model.parameters()))  # the test has teeth
    for (name, a), b in zip(resumed.model.named_parameters(), full.model.parameters()):
        assert torch.equal(a, b), f"{name} differs after resume (max abs diff {(a - b).abs().max().item():.3g})"
    return full, resumed


@pytest.mark.invariance
def test_sft_resume_mid_epoch_across_epoch_boundary(tmp_path, tiny_model_path):
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": [f"row {i}: " + "abc" * (i % 4 + 1) for i in range(8)]})

    def make(out, **kw):
        args = SFTConfig(output_dir=str(out), **COMMON, **kw)
        return SFTTrainer(tiny_model_path, args=args, train_dataset=data)

    # 4 steps per epoch (shuffled): stop mid-epoch 1 at step 3, resume to step 6 in epoch 2.
    _check_exact_resume(make, tmp_path, total=6, stop_at=3)


@pytest.mark.invariance
def test_dpo_resume(tmp_path, tiny_model_path):
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    data = Dataset.from_dict(
        {
            "prompt": [f"q{i}? " for i in range(8)],
            "chosen": [f"yes {i}" for i in range(8)],
            "rejected": [f"no {'x' * i}" for i in range(8)],
        }
    )

    def make(out, **kw):
        args = DPOConfig(output_dir=str(out), **COMMON, **kw)
        return DPOTrainer(tiny_model_path, args=args, train_dataset=data)

    _check_exact_resume(make, tmp_path, total=4, stop_at=2)


def _reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 7) for c in completions]


@pytest.mark.invariance
def test_grpo_resume_mid_generation_round_with_adaptive_entropy(tmp_path, tiny_model_path):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    data = Dataset.from_dict({"prompt": [f"count {i}:" for i in range(8)]})

    def make(out, **kw):
        args = GRPOConfig(
            output_dir=str(out),
            num_generations=2,
            max_completion_length=6,
            steps_per_generation=2,  # one generation round serves 2 optimizer steps: stopping at 1 is mid-round
            use_adaptive_entropy=True,
            entropy_coef=0.01,
            entropy_coef_delta=0.002,
            **COMMON,
            **kw,
        )
        return GRPOTrainer(tiny_model_path, reward_funcs=_reward, args=args, train_dataset=data)

    full, resumed = _check_exact_resume(make, tmp_path, total=4, stop_at=1)
    saved = torch.load(tmp_path / "stopped" / "checkpoint-1" / "posttrain_state_0.pt", weights_only=True)
    assert saved["rollout_buffer"]["micro_batches"] is not None  # the half-used generation round was saved
    assert resumed.entropy_ctrl.state_dict() == full.entropy_ctrl.state_dict()
    assert full.entropy_ctrl.coef != 0.01  # the controller moved, so restoring it mattered
