"""DPOTrainer on vision-language preference data with the offline tiny LLaVA: raw rows reach the vision collator,
the first loss is log 2 (policy = reference), training moves parameters, the images reach both forwards, and the
options vision data cannot honour raise."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from datasets import Dataset
from PIL import Image
from trainer_helpers import params_changed, quiet_single_thread, trainable_params  # noqa: F401
from vision_helpers import color_rows, vision_config

from posttrain.data.vision_collators import DataCollatorForVisionPreference
from posttrain.models.preference_scoring import score_preference_completions
from posttrain.models.tiny import build_tiny_vlm, save_tiny_vlm
from posttrain.trainers.dpo import DPOConfig, DPOTrainer


def preference_dataset(column: str = "images") -> Dataset:
    rows = [
        {
            column: image,
            "prompt": [{"role": "user", "content": "What color is this?"}],
            "chosen": [{"role": "assistant", "content": f"It is {name}."}],
            "rejected": [{"role": "assistant", "content": f"It is {wrong}."}],
        }
        for _, name, wrong, image in color_rows(column)
    ]
    return Dataset.from_list(rows)


def config(tmp_path, **overrides) -> DPOConfig:
    return vision_config(DPOConfig, tmp_path, **overrides)


def test_dpo_trains_on_images(tmp_path):
    model, processor = build_tiny_vlm()
    trainer = DPOTrainer(model, args=config(tmp_path), train_dataset=preference_dataset(), processing_class=processor)
    assert isinstance(trainer.data_collator, DataCollatorForVisionPreference)
    assert trainer.data_collator.max_length == 64
    # raw columns are kept for the collator (no tokenization up front)
    assert set(trainer.train_dataset.column_names) == {"images", "prompt", "chosen", "rejected"}
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference at step 0
    assert logs[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)


def test_dpo_loads_vlm_and_processor_from_path_with_single_image_column(tmp_path):
    path = save_tiny_vlm(tmp_path / "tiny-vlm")
    trainer = DPOTrainer(path, args=config(tmp_path / "out"), train_dataset=preference_dataset("image"))
    assert type(trainer.model).__name__ == "LlavaForConditionalGeneration"
    assert type(trainer.processing_class).__name__ == "LlavaProcessor"
    assert type(trainer.reference.model).__name__ == "LlavaForConditionalGeneration"  # a frozen copy
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    assert all(math.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)


def test_pixel_values_reach_the_model():
    """The completion log-probs depend on the image: the collator's pixel_values are passed to the forward."""
    model, processor = build_tiny_vlm()
    model.eval()
    collator = DataCollatorForVisionPreference(processor)
    rows = [preference_dataset()[0]]
    batch = collator(rows)
    other = collator([{**rows[0], "images": [Image.new("RGB", (20, 24), (0, 0, 0))]}])
    assert torch.equal(batch["input_ids"], other["input_ids"])

    def logps(b):
        extra = {k: v for k, v in b.items() if k not in ("input_ids", "attention_mask", "completion_mask")}
        with torch.no_grad():
            scores = score_preference_completions(model, b["input_ids"], b["attention_mask"], b["completion_mask"], **extra)
        return scores.sequence_sums()

    assert not torch.allclose(logps(batch), logps(other))


@pytest.mark.parametrize(
    ("overrides", "warning", "needle"),
    [
        ({"precompute_ref_log_probs": True}, None, "precompute_ref_log_probs=True is not supported for vision"),
        ({"padding_free": True}, UserWarning, "padding_free=True is not supported for vision"),
        ({"truncation_mode": "keep_end"}, FutureWarning, "truncation_mode='keep_end' is not supported for vision"),
    ],
)
def test_unsupported_options_raise(tmp_path, overrides, warning, needle):
    model, processor = build_tiny_vlm()
    with pytest.warns(warning) if warning else contextlib.nullcontext():
        args = config(tmp_path, **overrides)
    with pytest.raises(ValueError, match=needle):
        DPOTrainer(model, args=args, train_dataset=preference_dataset(), processing_class=processor)


def test_image_columns_only_in_eval_dataset_raise(tmp_path, tiny_model_path):
    text = Dataset.from_dict({"prompt": ["a"] * 2, "chosen": ["b"] * 2, "rejected": ["c"] * 2})
    with pytest.raises(ValueError, match="eval dataset has image columns but the train dataset has none"):
        DPOTrainer(tiny_model_path, args=config(tmp_path), train_dataset=text, eval_dataset=preference_dataset())
