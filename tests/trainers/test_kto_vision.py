"""KTOTrainer on vision-language unpaired data with the offline tiny LLaVA: raw rows reach the vision collator, training
moves parameters with a finite loss, the images reach the policy, reference and KL forwards, paired image data is
unpaired, and the options vision data cannot honour raise."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from PIL import Image
from trainer_helpers import params_changed, quiet_single_thread, trainable_params  # noqa: F401
from vision_helpers import COLORS, color_rows, vision_config

from posttrain.data.vision_collators import DataCollatorForVisionUnpairedPreference
from posttrain.models.tiny import build_tiny_vlm, save_tiny_vlm
from posttrain.trainers.kto import KTOConfig, KTOTrainer


def unpaired_dataset(column: str = "images") -> Dataset:
    rows = [
        {
            column: image,
            "prompt": [{"role": "user", "content": "What color is this?"}],
            "completion": [{"role": "assistant", "content": f"It is {name if i % 2 == 0 else wrong}."}],
            "label": i % 2 == 0,
        }
        for i, name, wrong, image in color_rows(column)
    ]
    return Dataset.from_list(rows)


def config(tmp_path, **overrides) -> KTOConfig:
    return vision_config(KTOConfig, tmp_path, **overrides)


def test_kto_trains_on_images(tmp_path):
    model, processor = build_tiny_vlm()
    trainer = KTOTrainer(model, args=config(tmp_path), train_dataset=unpaired_dataset(), processing_class=processor)
    collator = trainer.data_collator
    assert isinstance(collator, DataCollatorForVisionUnpairedPreference)
    assert collator.max_length == 64 and collator.calculate_kl
    # raw columns are kept for the collator (no tokenization, no KL column up front)
    assert set(trainer.train_dataset.column_names) == {"images", "prompt", "completion", "label"}
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # policy = reference at step 0


def test_apo_zero_unpaired_without_kl_rows_and_paired_image_data(tmp_path):
    """Paired image rows are unpaired (images copied to both rows); without a KL term no KL rows are built."""
    model, processor = build_tiny_vlm()
    paired = Dataset.from_list(
        [
            {
                "image": Image.new("RGB", (20, 24), rgb),
                "prompt": [{"role": "user", "content": "Color?"}],
                "chosen": [{"role": "assistant", "content": name}],
                "rejected": [{"role": "assistant", "content": "no idea"}],
            }
            for name, rgb in COLORS.items()
        ]
    )
    args = config(tmp_path, loss_type="apo_zero_unpaired")
    trainer = KTOTrainer(model, args=args, train_dataset=paired, processing_class=processor)
    assert len(trainer.train_dataset) == 8 and set(trainer.train_dataset.column_names) >= {"image", "completion"}
    assert not trainer.data_collator.calculate_kl
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert not any(k.startswith("KL_") for k in batch)
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    assert all(math.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)


def test_kto_loads_vlm_and_processor_from_path_with_single_image_column(tmp_path):
    path = save_tiny_vlm(tmp_path / "tiny-vlm")
    trainer = KTOTrainer(path, args=config(tmp_path / "out"), train_dataset=unpaired_dataset("image"))
    assert type(trainer.model).__name__ == "LlavaForConditionalGeneration"
    assert type(trainer.processing_class).__name__ == "LlavaProcessor"
    assert type(trainer.reference.model).__name__ == "LlavaForConditionalGeneration"  # a frozen copy
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)


def test_images_reach_policy_reference_and_kl_forwards(tmp_path):
    """Every forward receives the batch's pixel_values: changing only the images changes all three log-probs."""
    model, processor = build_tiny_vlm()
    trainer = KTOTrainer(model, args=config(tmp_path), train_dataset=unpaired_dataset(), processing_class=processor)
    rows = [unpaired_dataset()[i] for i in range(2)]
    black = [{**row, "images": [Image.new("RGB", (20, 24), (0, 0, 0))]} for row in rows]
    batch, other = trainer.data_collator(rows), trainer.data_collator(black)
    assert torch.equal(batch["input_ids"], other["input_ids"])
    assert torch.equal(batch["KL_input_ids"], other["KL_input_ids"])
    trainer.model.eval()
    seen = []
    original = type(trainer.model).forward

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("pixel_values"))
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(trainer.model), "forward", spy)
        loss = trainer.compute_loss(trainer.model, batch)
    # reference, reference-KL, policy-KL and policy forwards, each with the batch's images
    assert len(seen) == 4 and all(v is not None and torch.equal(v, batch["pixel_values"]) for v in seen)
    assert torch.isfinite(loss)
    ref, ref_kl = trainer._reference_logps(trainer.model, batch)
    ref_o, ref_kl_o = trainer._reference_logps(trainer.model, other)
    assert not torch.allclose(ref, ref_o) and not torch.allclose(ref_kl, ref_kl_o)


def test_precompute_ref_log_probs_is_refused(tmp_path):
    model, processor = build_tiny_vlm()
    with pytest.raises(ValueError, match="precompute_ref_log_probs=True is not supported for vision"):
        KTOTrainer(
            model,
            args=config(tmp_path, precompute_ref_log_probs=True),
            train_dataset=unpaired_dataset(),
            processing_class=processor,
        )


def test_image_columns_only_in_eval_dataset_raise(tmp_path, tiny_model_path):
    text = Dataset.from_dict({"prompt": ["a"] * 2, "completion": ["b"] * 2, "label": [True, False]})
    with pytest.raises(ValueError, match="eval dataset has image columns but the train dataset has none"):
        KTOTrainer(tiny_model_path, args=config(tmp_path), train_dataset=text, eval_dataset=unpaired_dataset())
