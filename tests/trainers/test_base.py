"""BaseTrainer: metric averaging with eval_ prefix, metrics.jsonl, atomic saves, config defaults."""

import json
import os

import pytest
import torch
from datasets import Dataset

from posttrain.models.loading import create_model_from_path, load_processing_class
from posttrain.trainers.base import BaseConfig, BaseTrainer, nanmean_or_none


class _ToyTrainer(BaseTrainer):
    _tag_names = ["posttrain", "sft"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(input_ids=inputs["input_ids"], labels=inputs["input_ids"])
        self.record_metric("custom", 1.0)
        self.record_metric("custom", float("nan"))
        self.record_metric("custom", 3.0)
        return (out.loss, out) if return_outputs else out.loss


def _make(tmp_path, model_path, **kw):
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 6]] * 8})
    args = BaseConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        **kw,
    )
    return _ToyTrainer(
        model=create_model_from_path(model_path),
        args=args,
        train_dataset=ds,
        processing_class=load_processing_class(model_path),
    )


def test_defaults_follow_trl():
    args = BaseConfig(output_dir="x")
    assert args.logging_steps == 10 and args.gradient_checkpointing is True
    assert args.bf16 is False  # CPU: resolved off (TRL turns it on; see module docstring)
    with pytest.raises(ValueError, match="JSON object string"):
        BaseConfig(output_dir="x", model_init_kwargs="{bad")
    assert BaseConfig(output_dir="x", model_init_kwargs='{"dtype": "float32"}').model_init_kwargs == {
        "dtype": "float32"
    }


def test_nanmean_ignores_nan():
    assert nanmean_or_none([1.0, float("nan"), 3.0]) == 2.0
    assert nanmean_or_none([float("nan")]) is None


def test_metrics_are_averaged_and_logged_to_jsonl(tmp_path, tiny_model_path):
    trainer = _make(tmp_path, tiny_model_path)
    trainer.train()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    step_records = [r for r in records if "loss" in r]
    assert len(step_records) == 2 and all(r["custom"] == 2.0 for r in step_records)
    assert json.load(open(tmp_path / "run_config.json"))["max_steps"] == 2
    trainer.evaluate(Dataset.from_dict({"input_ids": [[1, 2, 3]] * 2, "labels": [[1, 2, 3]] * 2}))
    last = json.loads(open(tmp_path / "metrics.jsonl").readlines()[-1])
    assert last["eval_custom"] == 2.0 and "custom" not in last


def test_save_model_is_loadable_and_leaves_no_temp_dirs(tmp_path, tiny_model_path):
    trainer = _make(tmp_path, tiny_model_path)
    out = tmp_path / "final"
    trainer.save_model(str(out))
    assert not [n for n in os.listdir(out) if n.startswith(".tmp")]
    reloaded = create_model_from_path(str(out))
    for a, b in zip(reloaded.parameters(), trainer.model.parameters()):
        assert torch.equal(a, b)
    assert load_processing_class(str(out)).eos_token == "<|im_end|>"


def test_report_written_at_train_end(tmp_path, tiny_model_path):
    trainer = _make(tmp_path, tiny_model_path, write_report=True)
    trainer.train()
    index = tmp_path / "report" / "index.html"
    assert index.exists()
    html = index.read_text()
    assert "data:image/png;base64," in html and "trainer: <b>sft</b>" in html
