"""MergeModelCallback / MergeConfig: a clear ImportError without mergekit; with it (optional extra), a tiny offline
run writes a merged model equal to the linear mix of the trained and the initial weights."""

from __future__ import annotations

import os

import pytest
import torch
from experimental_helpers import pairs
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

import posttrain.experimental.merge_model_callback as merge_module
from posttrain import DPOConfig, DPOTrainer


def test_clear_error_without_mergekit(monkeypatch):
    monkeypatch.setattr(merge_module, "is_mergekit_available", lambda: False)
    for build in (merge_module.MergeConfig, merge_module.MergeModelCallback):
        with pytest.raises(ImportError, match="pip install mergekit"):
            build()


def test_method_defaults_and_unknown_method():
    pytest.importorskip("mergekit")
    assert merge_module.MergeConfig().policy_model_weight == 0.5
    ties = merge_module.MergeConfig("ties")
    assert ties.policy_model_density == [1.0, 0.7, 0.1] and ties.normalize == 1.0
    assert merge_module.MergeConfig("slerp").t_values == 0.5
    with pytest.raises(ValueError, match="linear, ties, dare_ties, slerp"):
        merge_module.MergeConfig("avg")


@pytest.mark.parametrize("every_checkpoint", [False, True])
def test_linear_merge_of_a_tiny_run(tmp_path, tiny_model_path, every_checkpoint):
    pytest.importorskip("mergekit")
    from transformers import AutoModelForCausalLM

    callback = merge_module.MergeModelCallback(
        merge_module.MergeConfig("linear"), merge_at_every_checkpoint=every_checkpoint
    )
    save = {"save_strategy": "steps", "save_steps": 1} if every_checkpoint else {}
    args = fast_config(DPOConfig, tmp_path, max_steps=1, per_device_train_batch_size=2, learning_rate=1e-2, **save)
    trainer = DPOTrainer(tiny_model_path, args=args, train_dataset=pairs(2), callbacks=[callback])
    trainer.train()
    merged_dir = (
        os.path.join(tmp_path, "checkpoint-1", "merged") if every_checkpoint else os.path.join(tmp_path, "merged")
    )
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    name = "model.layers.0.mlp.down_proj.weight"
    trained = dict(trainer.model.named_parameters())[name].detach()
    expected = 0.5 * trained + 0.5 * dict(initial.named_parameters())[name].detach()
    torch.testing.assert_close(dict(merged.named_parameters())[name].detach(), expected, atol=2e-3, rtol=1e-2)
    assert not torch.allclose(expected, trained)
    assert os.path.isfile(os.path.join(merged_dir, "tokenizer_config.json"))
