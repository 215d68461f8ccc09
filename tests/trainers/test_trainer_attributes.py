"""Attributes and methods TRL users and callbacks touch (issue 18, item 7): ``ref_model``, ``aux_loss_enabled``,
``reward_processing_classes``, ``GRPOTrainer.get_high_entropy_mask`` / ``get_off_policy_mask``, ``entropy_coef``,
model tags. (Without a train dataset every trainer raises as TRL: tests/trainers/test_trl_errors.py.)"""

from __future__ import annotations

import pytest
import torch
from reward_helpers import varied_reward as _reward
from test_epoch_remainder import CASES
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain import GRPOConfig, GRPOTrainer


def _build(kind, tmp_path, model_path, reward_model_path, **overrides):
    config_class, trainer_class, data, extra = CASES[kind]
    args = fast_config(config_class, tmp_path, per_device_train_batch_size=4, max_steps=1, **{**extra, **overrides})
    kwargs = {"reward_funcs": _reward} if kind in ("grpo", "rloo") else {}
    if kind == "distillation":
        kwargs["teacher_model"] = model_path
    model = reward_model_path if kind == "reward" else model_path
    return trainer_class(model, args=args, train_dataset=data(), **kwargs)


@pytest.mark.parametrize(("kind", "overrides", "separate"), [
    ("dpo", {}, True), ("kto", {}, True), ("grpo", {}, False), ("grpo", {"beta": 0.1}, True), ("rloo", {}, True),
])  # fmt: skip
def test_ref_model(kind, overrides, separate, tiny_model_path, tmp_path):
    trainer = _build(kind, tmp_path, tiny_model_path, None, **overrides)
    if separate:
        assert isinstance(trainer.ref_model, torch.nn.Module) and trainer.ref_model is not trainer.model
        assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    else:  # β = 0: no reference, as TRL
        assert trainer.ref_model is None


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_aux_loss_enabled_follows_the_router_logits(kind, tiny_model_path, tmp_path):
    trainer = _build(kind, tmp_path, tiny_model_path, None)
    assert trainer.aux_loss_enabled is False  # a dense model returns no router logits


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_reward_processing_classes(kind, tiny_model_path, tiny_reward_model_path, tmp_path):
    config_class, trainer_class, data, extra = CASES[kind]
    args = fast_config(config_class, tmp_path, per_device_train_batch_size=4, max_steps=1, **extra)
    trainer = trainer_class(tiny_model_path, reward_funcs=[_reward, tiny_reward_model_path], args=args,
                            train_dataset=data())  # fmt: skip
    classes = trainer.reward_processing_classes
    assert len(classes) == 2 and classes[0] is None
    assert classes[1] is not None and classes[1].pad_token_id is not None


def test_grpo_high_entropy_mask_and_off_policy_mask(tiny_model_path, tmp_path):
    trainer = _build("grpo", tmp_path, tiny_model_path, None)
    entropies = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.2, 0.7, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # valid entropies 0.1 0.2 0.5 0.7 0.9: the 0.5 quantile is 0.5
    high = trainer.get_high_entropy_mask(entropies, mask, 0.5)
    assert high.dtype == torch.bool
    assert high.tolist() == [[False, True, True, False], [False, True, False, False]]
    assert trainer.get_high_entropy_mask(entropies, mask, 1.0).tolist() == [[False, False, True, False], [False] * 4]
    assert not trainer.get_high_entropy_mask(entropies, torch.zeros_like(mask), 0.5).any()

    advantages = torch.tensor([[1.0], [-1.0], [-1.0]])
    logps = torch.zeros(3, 2)
    sampling = torch.tensor([[2.0, 2.0], [1.0, 1.0], [0.1, 0.1]])  # mean KL per sequence: 2, 1, 0.1
    keep = GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, torch.ones(3, 2), off_policy_threshold=0.5)
    assert keep.shape == (3, 1) and keep.flatten().tolist() == [1.0, 0.0, 1.0]


def test_grpo_entropy_coef_attribute(tiny_model_path, tmp_path):
    args = fast_config(GRPOConfig, tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                       max_steps=1, entropy_coef=0.1, use_adaptive_entropy=True)  # fmt: skip
    trainer = GRPOTrainer(tiny_model_path, reward_funcs=_reward, args=args, train_dataset=CASES["grpo"][2]())
    assert trainer.entropy_coef == pytest.approx(0.1)
    trainer.entropy_coef = 0.25
    assert trainer.entropy_ctrl.coef == pytest.approx(0.25)


@pytest.mark.parametrize("kind", ["sft", "dpo", "kto", "reward", "grpo", "rloo", "distillation"])
def test_model_tags(kind, tiny_model_path, tiny_reward_model_path, tmp_path):
    trainer = _build(kind, tmp_path, tiny_model_path, tiny_reward_model_path)
    assert trainer.model.model_tags is not None
    for tag in trainer._tag_names:
        assert tag in trainer.model.model_tags
