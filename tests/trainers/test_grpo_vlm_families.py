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
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

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


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_rloo_trains_each_vlm_family_with_an_image_column(tmp_path, family):
    """RLOO on TRL's single ``image`` column (None on the text-only row), two steps per family."""
    model, processor = build_tiny_vlm(family=family)
    rows = [{"prompt": r["prompt"], "image": (r["images"] or [None])[0]} for r in mixed_rows()]
    trainer = RLOOTrainer(
        model,
        reward_funcs=lambda completions, **kwargs: [float(len(c[0]["content"])) for c in completions],
        args=config(RLOOConfig, tmp_path, beta=0.05),
        train_dataset=Dataset.from_list(rows),
        processing_class=processor,
    )
    before = trainable_params(trainer.model)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    after = dict(trainer.model.named_parameters())
    assert any(part in n for n in before if not torch.equal(before[n], after[n].detach()) for part in VISION_PARTS)


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


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_each_family_sees_its_image(family):
    """A random tiny VLM's next-token logits change with the image: the image path is not constant (transformers
    zero-initialises Gemma 3's input projection, which made every image embed to 0 until the builder drew it)."""
    from PIL import Image

    model, processor = build_tiny_vlm(family=family)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    text = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    logits = []
    with torch.no_grad():
        for rgb in ((255, 0, 0), (0, 0, 255)):
            inputs = processor(text=[text], images=[Image.new("RGB", (20, 24), rgb)], return_tensors="pt")
            logits.append(model(**inputs).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_shared_prompt_forward_matches_plain_for_each_family(family):
    """Per family, two prompts with the same text but other images and a text-only prompt, G = 2 each: the scoring
    forward with prompt sharing (or its fallback) gives the plain forward's log-probs and parameter gradients."""
    from test_grpo_vlm import GREEN, RED, _image

    from posttrain.models.completion_scoring import completion_token_stats

    model, processor = build_tiny_vlm(family=family)
    model.eval()
    rows = [
        {"prompt": [{"role": "user", "content": "Colour?"}], "images": [_image(RED)]},
        {"prompt": [{"role": "user", "content": "Colour?"}], "images": [_image(GREEN, (30, 12))]},
        {"prompt": [{"role": "user", "content": "Words only, please."}], "images": []},
    ]
    grouped = [row for row in rows for _ in range(2)]
    _, _, prompt_ids, vision = encode_vision_prompts(grouped, processor)
    lengths = [3, 1, 4, 2, 3, 3]
    generator = torch.Generator().manual_seed(0)
    width, pad = max(map(len, prompt_ids)), processor.tokenizer.pad_token_id
    batch = {
        "prompt_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids]),
        "prompt_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids]),
        "completion_ids": torch.randint(40, 120, (6, 4), generator=generator),
        "completion_lengths": torch.tensor(lengths),
        "vision_inputs": vision,
    }
    valid = torch.arange(4).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)

    def run(share: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logps = completion_token_stats(model, batch, share_prompts=share).logps
        (logps * valid).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logps.detach(), grads

    plain, plain_grads = run(False)
    shared, shared_grads = run(True)
    torch.testing.assert_close(shared[valid], plain[valid], atol=1e-5, rtol=1e-5)
    assert set(shared_grads) == set(plain_grads)
    assert any(part in n for n in plain_grads for part in VISION_PARTS)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_image_only_qwen_processor_saves_loads_and_refuses_videos(tmp_path, family):
    """The image-only Qwen2-VL processor round-trips through AutoProcessor without torchvision, expands the image
    placeholder to grid/merge² tokens with mm_token_type_ids, and names the problem when given a video."""
    from test_grpo_vlm import RED, _image
    from transformers import AutoProcessor

    _, processor = build_tiny_vlm(family=family)
    processor.save_pretrained(tmp_path)
    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert type(loaded) is type(processor) and not hasattr(loaded, "video_processor")
    text = "<|vision_start|><|image_pad|><|vision_end|>hi"
    out = loaded(text=[text], images=[[_image(RED)]], return_tensors="pt")
    image_tokens = int(out["image_grid_thw"].prod()) // 4
    assert (
        int(out["mm_token_type_ids"].sum()) == image_tokens == int((out["input_ids"] == loaded.image_token_id).sum())
    )
    with pytest.raises(ValueError, match="images only"):
        loaded(text=[text], videos=[[_image(RED)]])


def test_unknown_family_names_the_choices():
    with pytest.raises(ValueError, match="family='pixtral' is not a tiny VLM family; choose one of llava, qwen2_vl"):
        build_tiny_vlm(family="pixtral")


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_each_family_with_an_uneven_last_batch_an_eval_dataset_and_a_stream(tmp_path, family):
    """Per family: 5 image/text rows at 2 prompts a step — the epoch's last, incomplete generation batch is dropped as
    TRL's ``RepeatSampler`` drops it (2 steps) — evaluation on an ``eval_dataset`` of 3 rows (an uneven last eval
    batch at 2 prompts) during and after training, and the same rows as a streaming ``IterableDataset``."""
    model, processor = build_tiny_vlm(family=family)
    rows = mixed_rows() + [mixed_rows()[1]]  # 5 rows: 2 full steps of 2 prompts, 1 row left over
    trainer = GRPOTrainer(
        model,
        reward_funcs=RecordingReward(),
        args=config(GRPOConfig, tmp_path / "map", max_steps=-1, num_train_epochs=1, per_device_train_batch_size=4,
                    per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=2),  # fmt: skip
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(mixed_rows()[:3]),
        processing_class=processor,
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert trainer.state.global_step == 2 and len(losses) == 2 and all(map(math.isfinite, losses))
    assert any("eval_loss" in log for log in trainer.state.log_history)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and math.isfinite(metrics["eval_reward"])
    streamed = GRPOTrainer(
        build_tiny_vlm(family=family)[0],
        reward_funcs=RecordingReward(),
        args=config(GRPOConfig, tmp_path / "stream", max_steps=2, per_device_train_batch_size=4),
        train_dataset=Dataset.from_list(rows).to_iterable_dataset(),
        processing_class=processor,
    )
    streamed.train()
    assert streamed.state.global_step == 2
    assert all(math.isfinite(log["loss"]) for log in streamed.state.log_history if "loss" in log)
