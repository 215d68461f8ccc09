"""A tiny VLM learns an image-dependent task with GRPO: held-out reward rises.

The task: answer a red image with an even first token id and a blue one with an odd one (the reward reads
``completion_ids``, as TRL passes it). The reward is dense from the start (a random policy earns 0.5), and only
the image tells the colour — the prompt text is the same for every row — so a policy can only beat 0.5 by
reading the image through the vision tower and projector. Held-out images are shades and sizes never trained on;
the held-out reward is the policy's exact expected reward for the first token (the probability mass on the
tokens of the right parity), so the measure has no sampling noise — and a policy that ignores the image scores
exactly 0.5 on it (held-out rows are half red, half blue), whatever its parity preference.
"""

from __future__ import annotations

import random

import pytest
import torch
from datasets import Dataset
from PIL import Image
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.models.tiny import VLM_FAMILIES, build_tiny_vlm
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]


def _colour_image(rng: random.Random, red: bool) -> Image.Image:
    strong, weak = rng.randint(150, 255), rng.randint(0, 80)
    rgb = (strong, weak, rng.randint(0, 80)) if red else (rng.randint(0, 80), weak, strong)
    return Image.new("RGB", (rng.randint(12, 32), rng.randint(12, 32)), rgb)


def _rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        red = i % 2 == 0
        rows.append({"prompt": PROMPT, "images": [_colour_image(rng, red)], "red": red})
    return rows


def parity_reward(completions, completion_ids, red, **kwargs):
    """1 when the first completion token's parity matches the colour (even for red, odd for blue)."""
    return [float(bool(ids) and (ids[0] % 2 == 0) == r) for ids, r in zip(completion_ids, red)]


@torch.no_grad()
def expected_reward(model, processor, rows: list[dict]) -> float:
    """Mean over ``rows`` of the policy's probability of a first token of the right parity."""
    model.eval()
    total = 0.0
    for row in rows:
        text = processor.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=row["images"], return_tensors="pt")
        probs = model(**inputs).logits[0, -1].float().softmax(-1)
        ids = torch.arange(probs.numel())
        right = (ids % 2 == 0) if row["red"] else (ids % 2 == 1)
        total += probs[right].sum().item()
    model.train()
    return total / len(rows)


@pytest.mark.slow
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_tiny_vlm_learns_the_colour_of_its_image(tmp_path, family):
    model, processor = build_tiny_vlm(family=family, seed=0)
    held_out = _rows(24, seed=1)
    before = expected_reward(model, processor, held_out)
    # Gemma 3's RMS-normalised, pooled image embeddings separate the colours less at random init: it needs more
    # images per step (8 instead of 2) to learn in the same 30 steps.
    batch = 64 if family == "gemma3" else 16
    args = fast_config(
        GRPOConfig, tmp_path, max_steps=30, per_device_train_batch_size=batch, num_generations=8,
        max_completion_length=1, learning_rate=1e-2, beta=0.0, seed=0, temperature=1.0,
        dataloader_pin_memory=False, lr_scheduler_type="constant",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model, reward_funcs=parity_reward, args=args, train_dataset=Dataset.from_list(_rows(64, seed=0)),
        processing_class=processor,
    )  # fmt: skip
    trainer.train()
    after = expected_reward(trainer.model, processor, held_out)
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert abs(before - 0.5) < 0.1, before  # a random policy: chance level
    assert after > before + 0.25, (before, after, rewards)
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.15, rewards
