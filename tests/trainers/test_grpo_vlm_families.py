"""GRPO and RLOO on each tiny vision-language family of :func:`posttrain.models.tiny.build_tiny_vlm` (the families
TRL's VLM GRPO documents: LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Gemma 3 and Idefics3/SmolVLM): two in-process
steps on a batch mixing one image, two images of other sizes and a text-only row, with each family's own vision
inputs (``pixel_values`` + ``image_grid_thw`` / ``image_sizes`` / ``pixel_attention_mask`` / ``token_type_ids`` /
``mm_token_type_ids``); and the saved models with their processors loading back offline by path."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from test_grpo_vlm import RecordingReward, config, mixed_rows
from trainer_helpers import fast_config, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.data.vision_prompts import encode_vision_prompts
from posttrain.models.tiny import VLM_FAMILIES, build_tiny_vlm, save_tiny_vlm
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

# the per-family vision inputs the processor must produce for an image row (beyond pixel_values)
FAMILY_KEYS = {
    "llava": set(),
    "llava_next": {"image_sizes"},
    "qwen2_vl": {"image_grid_thw", "mm_token_type_ids"},
    "qwen2_5_vl": {"image_grid_thw", "mm_token_type_ids"},
    "gemma3": {"token_type_ids"},
    "idefics3": {"pixel_attention_mask"},
}
VISION_PARTS = ("vision_tower", "visual", "vision_model", "multi_modal_projector", "connector", "merger")


def test_every_family_is_covered():
    assert set(FAMILY_KEYS) == set(VLM_FAMILIES)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_grpo_trains_each_vlm_family_on_mixed_image_batches(tmp_path, family):
    model, processor = build_tiny_vlm(family=family)
    _, _, _, vision = encode_vision_prompts(mixed_rows(), processor)
    assert set(vision[0]) == {"pixel_values"} | FAMILY_KEYS[family] and vision[2] == {}
    reward = RecordingReward()
    trainer = GRPOTrainer(
        model,
        reward_funcs=reward,
        args=config(GRPOConfig, tmp_path),
        train_dataset=Dataset.from_list(mixed_rows()),
        processing_class=processor,
    )
    before = trainable_params(trainer.model)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert any("language_model" in n or n.startswith("model.text_model") for n in changed), sorted(changed)[:5]
    # the images reached the vision encoder: its weights got gradients and moved
    assert any(part in n for n in changed for part in VISION_PARTS), sorted(changed)
    counts = sorted(len(images) for images in reward.calls[0]["images"])
    assert counts == [0, 0, 1, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "idefics3", "llava_next"])
def test_saved_family_loads_by_path_offline(tmp_path, family):
    """GRPOTrainer(model=<path>) loads the saved tiny VLM and its processor (AutoProcessor, no torchvision)."""
    path = save_tiny_vlm(tmp_path / "model", family=family)
    trainer = GRPOTrainer(
        path,
        reward_funcs=RecordingReward(),
        args=config(GRPOConfig, tmp_path, max_steps=1),
        train_dataset=Dataset.from_list(mixed_rows()),
    )
    _, expected = build_tiny_vlm(family=family)
    assert type(trainer.processing_class) is type(expected)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])
