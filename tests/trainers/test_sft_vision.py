"""SFTTrainer on vision-language datasets with the offline tiny LLaVA: raw rows reach the vision collator, training
runs (finite loss, parameters move), the model and processor load from a path, and unsupported options raise."""

from __future__ import annotations

import math

import pytest
from datasets import Dataset
from PIL import Image
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.data.vision_collators import DataCollatorForVisionLanguageModeling
from posttrain.models.tiny import build_tiny_vlm, save_tiny_vlm
from posttrain.trainers.sft import SFTConfig, SFTTrainer

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}


def messages_dataset() -> Dataset:
    rows = [
        {
            "images": [Image.new("RGB", (20, 24), rgb)],
            "messages": [
                {"role": "user", "content": "What color is this?"},
                {"role": "assistant", "content": f"It is {name}."},
            ],
        }
        for name, rgb in COLORS.items()
    ]
    return Dataset.from_list(rows)


def prompt_completion_dataset() -> Dataset:
    rows = [
        {
            "image": Image.new("RGB", (24, 20), rgb),
            "prompt": [{"role": "user", "content": "Color?"}],
            "completion": [{"role": "assistant", "content": name}],
        }
        for name, rgb in COLORS.items()
    ]
    return Dataset.from_list(rows)


def config(tmp_path, **overrides) -> SFTConfig:
    values = dict(max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, seed=0, max_length=64)
    values.update(overrides)
    return fast_config(SFTConfig, tmp_path, dataloader_pin_memory=False, **values)


def test_sft_trains_on_images_with_a_processor_object(tmp_path):
    model, processor = build_tiny_vlm()
    trainer = SFTTrainer(model, args=config(tmp_path), train_dataset=messages_dataset(), processing_class=processor)
    assert isinstance(trainer.data_collator, DataCollatorForVisionLanguageModeling)
    assert trainer.data_collator.max_length == 64 and not trainer.data_collator.completion_only_loss
    # the raw columns are kept for the collator (no tokenization up front)
    assert set(trainer.train_dataset.column_names) == {"images", "messages"}
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert any("mean_token_accuracy" in log for log in trainer.state.log_history)


def test_sft_loads_vlm_and_processor_from_path(tmp_path):
    path = save_tiny_vlm(tmp_path / "tiny-vlm")
    trainer = SFTTrainer(path, args=config(tmp_path / "out"), train_dataset=prompt_completion_dataset())
    assert type(trainer.model).__name__ == "LlavaForConditionalGeneration"
    assert type(trainer.processing_class).__name__ == "LlavaProcessor"
    assert trainer.data_collator.completion_only_loss  # auto: prompt-completion data
    batch = trainer.data_collator([trainer.train_dataset[0]])
    tokenizer = trainer.processing_class.tokenizer
    assert tokenizer.decode(batch["labels"][0][batch["labels"][0] != -100]) == "red<|im_end|>\n"
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    assert all(math.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"packing": True}, r"packing=True is not supported for vision-language datasets"),
        ({"padding_free": True, "max_length": None}, r"padding_free=True is not supported for vision-language"),
        ({"assistant_only_loss": True}, r"assistant_only_loss=True is not supported for vision-language"),
    ],
)
def test_unsupported_options_raise(tmp_path, overrides, match):
    model, processor = build_tiny_vlm()
    with pytest.raises(ValueError, match=match):
        SFTTrainer(
            model, args=config(tmp_path, **overrides), train_dataset=messages_dataset(), processing_class=processor
        )


def test_formatting_func_raises(tmp_path):
    model, processor = build_tiny_vlm()
    with pytest.raises(ValueError, match="formatting_func is not supported for vision-language datasets"):
        SFTTrainer(
            model, args=config(tmp_path), train_dataset=messages_dataset(), processing_class=processor,
            formatting_func=lambda row: "text",
        )  # fmt: skip


def test_loss_matches_the_models_own_loss(tmp_path):
    """Chunked and full-logits SFT losses on an image batch equal LLaVA's own cross-entropy on the same labels."""
    rows = messages_dataset()
    losses = []
    for loss_type in ("chunked_nll", "nll"):
        model, processor = build_tiny_vlm()
        trainer = SFTTrainer(
            model, args=config(tmp_path, loss_type=loss_type), train_dataset=rows, processing_class=processor
        )
        batch = trainer.data_collator([rows[i] for i in range(4)])
        losses.append(trainer.compute_loss(model, batch).item())
    reference = build_tiny_vlm()[0](**batch).loss.item()
    assert losses == pytest.approx([reference, reference], rel=1e-5)
