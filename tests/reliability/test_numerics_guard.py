"""Numerics guard: NaN/inf loss or gradient → stop with a report of step and batch, or skip the step exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from reliability_toy import ToyTrainer, make_toy
from transformers import TrainerCallback

from posttrain.reliability.numerics import NonFiniteError, NumericsGuard, describe_batch
from posttrain.trainers.base import BaseConfig


class _Snapshots(TrainerCallback):
    """Parameters after every optimizer step."""

    def __init__(self):
        self.after = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = [p.detach().clone() for p in model.parameters()]


def _nan_loss_on_step(step: int, micro: int | None = None):
    """A loss hook that returns NaN on optimizer step ``step`` (1-based), optionally only on one micro-batch."""
    calls = {"n": 0}

    def hook(trainer, model, loss, inputs):
        calls["n"] += 1
        ga = trainer.args.gradient_accumulation_steps
        this_step, this_micro = (calls["n"] - 1) // ga + 1, (calls["n"] - 1) % ga
        if this_step == step and (micro is None or micro == this_micro):
            return loss * float("nan")
        return loss

    return hook


def _with_hook(hook):
    class Hooked(ToyTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(input_ids=inputs["input_ids"], labels=inputs["input_ids"])
            loss = hook(self, model, out.loss, inputs)
            return (loss, out) if return_outputs else loss

    return Hooked


def test_config_rejects_unknown_policy():
    with pytest.raises(ValueError, match=r"nan_policy='ignore' is not valid; use one of \['stop', 'skip'\]"):
        BaseConfig(output_dir="x", nan_policy="ignore")
    assert BaseConfig(output_dir="x").nan_policy is None  # resolved by the trainer: "skip" (TRL users expect
    # training to go on), "stop" under DeepSpeed


def test_default_policy_skips_and_training_goes_on(tmp_path, tiny_model_path):
    """Issue 18: a NaN loss (e.g. an fp16/bf16 run) no longer aborts by default; the step is skipped and counted."""
    trainer = make_toy(tmp_path, tiny_model_path, trainer_cls=_with_hook(_nan_loss_on_step(2)), max_steps=3)
    assert trainer._numerics.policy == "skip"
    trainer.train()
    assert trainer.state.global_step == 3 and trainer._numerics.skipped_at == [2]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_stop_reports_step_microbatch_and_saves_the_batch(tmp_path, tiny_model_path):
    trainer = make_toy(
        tmp_path, tiny_model_path, trainer_cls=_with_hook(_nan_loss_on_step(2, micro=1)), gradient_accumulation_steps=2,
        nan_policy="stop",
    )
    snapshots = _Snapshots()
    trainer.add_callback(snapshots)
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    message = str(info.value)
    assert "optimizer step 2 on process 0" in message
    assert "micro-batch(es) [1] (of 2)" in message
    assert "input_ids: tensor(2," in message and "nan_policy='skip'" in message
    dump = tmp_path / "numerics" / "step-2-process-0.pt"
    assert str(dump) in message
    saved = torch.load(dump, weights_only=False)
    assert len(saved) == 1 and saved[0]["input_ids"].shape[0] == 2
    assert list(snapshots.after) == [1]  # the bad step never reached the optimizer


def test_skip_leaves_parameters_and_optimizer_untouched_and_counts(tmp_path, tiny_model_path):
    trainer = make_toy(
        tmp_path, tiny_model_path, trainer_cls=_with_hook(_nan_loss_on_step(2)), max_steps=3, nan_policy="skip"
    )
    snapshots = _Snapshots()
    trainer.add_callback(snapshots)
    trainer.train()
    for a, b in zip(snapshots.after[1], snapshots.after[2]):
        assert torch.equal(a, b)  # step 2 skipped exactly (Adam moments and weight decay included)
    assert any(not torch.equal(a, b) for a, b in zip(snapshots.after[2], snapshots.after[3]))  # training continues
    optimizer_steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert optimizer_steps == {2}
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    counts = [r.get("numerics/skipped_steps") for r in records if "loss" in r]
    assert counts == [None, 1, 1]  # logged from the first skip on: a clean run logs TRL's metrics only
    assert trainer.resume_state_dict()["numerics"] == {"skipped_steps": 1, "skipped_at": [2]}


def test_nonfinite_gradient_with_finite_loss_is_caught(tmp_path, tiny_model_path):
    def inf_grad(trainer, model, loss, inputs):
        # sqrt'(0) = inf, times 0 → NaN gradients while the loss itself stays finite.
        zero = next(model.parameters()).sum() * 0.0
        return loss + 0.0 * torch.sqrt(zero)

    trainer = make_toy(tmp_path, tiny_model_path, trainer_cls=_with_hook(inf_grad), max_steps=1, nan_policy="stop")
    with pytest.raises(NonFiniteError, match=r"optimizer step 1 .*the gradient norm is nan \(losses were finite\)"):
        trainer.train()
    assert os.path.exists(tmp_path / "numerics" / "step-1-process-0.pt")


def test_guard_unit_behaviour(tmp_path):
    guard = NumericsGuard("skip", dump_dir=None)
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    guard.observe_loss(torch.tensor(1.0), {"x": torch.zeros(1, 3)})
    assert guard.check_step(torch.tensor(2.0), step=1, parameters=lambda: [param]) is True
    assert param.grad is not None
    guard.observe_loss(torch.tensor(float("inf")), {"x": torch.zeros(1, 3)})
    assert guard.check_step(torch.tensor(2.0), step=2, parameters=lambda: [param]) is False
    assert param.grad is None and guard.skipped_steps == 1
    # Another process saw the problem: this one must skip too.
    param.grad = torch.ones(2)
    guard.observe_loss(torch.tensor(1.0), [{"prompt": "a"}])
    assert guard.check_step(1.0, step=3, parameters=lambda: [param], reduce_any=lambda flag: True) is False
    assert guard.skipped_at == [2, 3]
    with pytest.raises(ValueError, match="nan_policy='x'"):
        NumericsGuard("x")
    assert (
        describe_batch({"ids": torch.zeros(2, 5, dtype=torch.long), "t": ["a"]})
        == "{ids: tensor(2, 5) int64, t: list[1]}"
    )
    assert describe_batch([{"prompt": "p"}]) == "list[1] of {prompt: str}"
