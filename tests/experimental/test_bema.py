"""BEMACallback (posttrain.BEMACallback and the experimental one) on the offline tiny model: the BEMA weights
equal the formula applied to the recorded parameter trajectory, they are saved to output_dir/bema, and the
experimental DPOTrainer's reference model tracks them (seed doc example included)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from experimental_helpers import pairs
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401
from transformers import TrainerCallback

import posttrain
from posttrain import SFTConfig, SFTTrainer


class _Recorder(TrainerCallback):
    """Records one trainable parameter after every optimizer step."""

    def __init__(self, name: str):
        self.name, self.values = name, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.values.append(dict(model.named_parameters())[self.name].detach().clone())

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.values.append(dict(model.named_parameters())[self.name].detach().clone())


def _sft_data(n: int = 6) -> Dataset:
    return Dataset.from_dict({"text": ["The sky is blue.", "Grass is green.", "Snow is white."] * (n // 3)})


def test_top_level_export_is_lazy_and_stable():
    assert posttrain.BEMACallback.__module__ == "posttrain.callbacks"
    # the stable callback does not import posttrain.experimental (which would emit the experimental notice)
    assert "posttrain.experimental" not in Path(posttrain.callbacks.__file__).read_text()
    assert "BEMACallback" in posttrain.__all__


def test_bema_weights_follow_the_formula(tmp_path, tiny_model_path):
    name = "model.layers.0.mlp.down_proj.weight"
    recorder = _Recorder(name)
    bema = posttrain.BEMACallback(update_freq=1, lag=2, ema_power=0.5, bias_power=0.2, multiplier=1.0)
    args = fast_config(SFTConfig, tmp_path, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2)
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=_sft_data(), callbacks=[recorder, bema])
    trainer.train()
    theta = recorder.values  # θ_0 .. θ_3
    ema = theta[0].clone()
    for t in (1, 2, 3):  # update_after=0: θ_0 is the initial snapshot, every step updates
        beta, alpha = (2 + t) ** -0.5, (2 + t) ** -0.2
        ema = (1 - beta) * ema + beta * theta[t]
        expected = ema + alpha * (theta[t] - theta[0])
    got = dict(bema.running_model.named_parameters())[name]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(got, theta[3])  # the average differs from the last iterate
    assert os.path.isfile(os.path.join(tmp_path, "bema", "config.json"))


def test_paper_index_example_runs(tmp_path, tiny_model_path):
    # paper_index.md, "EMA Without the Lag" (s/trl/posttrain/; `...` filled with a tiny local run)
    from posttrain import BEMACallback, SFTTrainer

    trainer = SFTTrainer(
        model=tiny_model_path,
        args=fast_config(SFTConfig, tmp_path, max_steps=1, per_device_train_batch_size=2),
        train_dataset=_sft_data(),
        callbacks=[BEMACallback()],
    )
    trainer.train()
    assert os.path.isdir(os.path.join(tmp_path, "bema"))


def test_seed_doc_example_bema_for_reference_model(tmp_path, tiny_model_path, monkeypatch):
    # bema_for_reference_model.md (s/trl/posttrain/; hub model and dataset replaced by local tiny ones)
    monkeypatch.chdir(tmp_path)
    from posttrain.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

    dataset = pairs(4)
    bema_callback = BEMACallback(update_ref_model=True)
    trainer = DPOTrainer(
        model=tiny_model_path,
        args=fast_config(posttrain.DPOConfig, tmp_path / "out", max_steps=1, per_device_train_batch_size=2),
        train_dataset=dataset,
        callbacks=[bema_callback],
    )
    trainer.train()
    assert bema_callback.running_model is not None


def test_reference_tracks_bema_weights(tmp_path, tiny_model_path):
    from posttrain.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

    bema = BEMACallback(update_freq=1, update_ref_model=True, ref_model_update_freq=2, lag=2)
    args = fast_config(posttrain.DPOConfig, tmp_path, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2)
    trainer = DPOTrainer(tiny_model_path, args=args, train_dataset=pairs(4), callbacks=[bema])
    ref = trainer.reference.model
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    trainer.train()
    running = dict(bema.running_model.named_parameters())
    changed = False
    for n, p in ref.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), running[n].detach())  # the reference holds the BEMA weights
        changed |= not torch.equal(p.detach(), before[n])
        assert not p.requires_grad
    assert changed
    policy = dict(trainer.model.named_parameters())
    assert any(not torch.equal(policy[n].detach(), p.detach()) for n, p in ref.named_parameters())


def test_reference_updates_need_a_separate_reference(tmp_path, tiny_model_path):
    from posttrain.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

    args = fast_config(
        posttrain.DPOConfig, tmp_path, max_steps=1, per_device_train_batch_size=2, precompute_ref_log_probs=True
    )
    with pytest.raises(ValueError, match="separate reference model"):
        DPOTrainer(tiny_model_path, args=args, train_dataset=pairs(2), callbacks=[BEMACallback(update_ref_model=True)])
    # a plain trainer passes no ref_model to its callbacks
    sft_args = fast_config(SFTConfig, tmp_path / "sft", max_steps=1, per_device_train_batch_size=2)
    trainer = SFTTrainer(
        tiny_model_path, args=sft_args, train_dataset=_sft_data(), callbacks=[BEMACallback(update_ref_model=True)]
    )
    with pytest.raises(ValueError, match="separate reference model"):
        trainer.train()
