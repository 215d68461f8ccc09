"""``trainer.create_model_card(model_name=, dataset_name=, tags=)``: TRL's signature, which open-r1's and
alignment-handbook's scripts call after training (transformers' own method has no ``dataset_name``)."""

from __future__ import annotations

import os

import yaml
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer


def _trainer(tmp_path, model):
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(4)]
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", max_steps=1, max_length=32,
                     per_device_train_batch_size=2, save_strategy="no")
    return SFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows))


def _metadata(path) -> dict:
    text = open(path).read()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_create_model_card_takes_trls_arguments(tmp_path, tiny_model_path):
    trainer = _trainer(tmp_path, tiny_model_path)
    trainer.create_model_card(model_name="my-model", dataset_name="trl-lib/Capybara", tags=["open-r1"])
    card = os.path.join(trainer.args.output_dir, "README.md")
    meta = _metadata(card)
    assert meta["model_name"] == "my-model"
    assert meta["datasets"] == "trl-lib/Capybara"
    assert meta["library_name"] == "transformers"
    assert {"open-r1", "sft"} <= set(meta["tags"])
    # A local model folder is not a hub id: no base_model link.
    assert "base_model" not in meta
    assert "SFTTrainer" in open(card).read()


def test_create_model_card_accepts_a_single_tag_and_no_arguments(tmp_path, tiny_model_path):
    trainer = _trainer(tmp_path, tiny_model_path)
    trainer.create_model_card(tags="alignment-handbook")
    assert "alignment-handbook" in _metadata(os.path.join(trainer.args.output_dir, "README.md"))["tags"]
    trainer.create_model_card()
    meta = _metadata(os.path.join(trainer.args.output_dir, "README.md"))
    assert meta["model_name"] == "out" and "datasets" not in meta
