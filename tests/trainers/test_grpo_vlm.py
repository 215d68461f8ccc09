"""GRPOTrainer and RLOOTrainer on vision-language data with the offline tiny LLaVA: TRL's dataset format (``prompt``
plus ``image`` / ``images``) with different image counts and sizes and a text-only row in one batch, both generation
backends, reward functions receiving the images as TRL passes them, the images reaching generation and every
log-prob forward, evaluation, and the errors raised before training."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from PIL import Image
from trainer_helpers import fast_config, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.data.vision_prompts import collate_vision_inputs, encode_vision_prompts
from posttrain.generation.base import SamplingConfig
from posttrain.generation.group_sampler import GroupSampler
from posttrain.generation.transformers_backend import TransformersBackend
from posttrain.models.completion_scoring import completion_token_stats
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer, build_tiny_vlm
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

RED = (255, 0, 0)
GREEN = (0, 255, 0)


def _image(rgb: tuple[int, int, int], size: tuple[int, int] = (20, 24)) -> Image.Image:
    return Image.new("RGB", size, rgb)


def mixed_rows() -> list[dict]:
    """One image, two images of other sizes, a text-only row, one image again: a batch of four prompts."""
    return [
        {"prompt": [{"role": "user", "content": "What colour is this?"}], "images": [_image(RED)]},
        {"prompt": [{"role": "user", "content": "Two?"}], "images": [_image(RED, (40, 10)), _image(GREEN, (9, 33))]},
        {"prompt": [{"role": "user", "content": "No picture here."}], "images": []},
        {"prompt": [{"role": "user", "content": "And this?"}], "images": [_image(GREEN)]},
    ]


def config(config_cls: type, tmp_path, **overrides):
    values = dict(
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=6,
        learning_rate=1e-2,
        seed=0,
        beta=0.1,
        dataloader_pin_memory=False,
    )
    values.update(overrides)
    return fast_config(config_cls, tmp_path, **values)


class RecordingReward:
    """Rewards the completion length and keeps what it was called with."""

    __name__ = "recording_reward"

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, prompts, completions, images, **kwargs):
        self.calls.append({"prompts": prompts, "images": images})
        return [float(len(c[0]["content"])) for c in completions]


def _image_blocks(prompt: list[dict]) -> list:
    return [b["image"] for m in prompt if isinstance(m["content"], list) for b in m["content"] if b["type"] == "image"]


def _check_trained(trainer, before: dict[str, torch.Tensor]) -> None:
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert any(n.startswith("model.language_model") for n in changed)
    # the images went through the vision tower and projector: their weights got gradients and moved
    assert any("multi_modal_projector" in n for n in changed)
    assert any("vision_tower" in n for n in changed)


@pytest.mark.parametrize("backend", ["posttrain", "transformers"])
def test_grpo_trains_vlm_on_mixed_image_batches(tmp_path, backend):
    model, processor = build_tiny_vlm()
    reward = RecordingReward()
    trainer = GRPOTrainer(
        model,
        reward_funcs=reward,
        args=config(GRPOConfig, tmp_path, generation_backend=backend),
        train_dataset=Dataset.from_list(mixed_rows()),
        processing_class=processor,
    )
    before = trainable_params(trainer.model)
    trainer.train()
    _check_trained(trainer, before)
    # rewards get TRL's arguments: the prompts with their images placed in them, and the `images` column as is
    call = reward.calls[0]
    assert len(call["prompts"]) == len(call["images"]) == 8
    counts = sorted(len(images) for images in call["images"])
    assert counts == [0, 0, 1, 1, 1, 1, 2, 2]
    for prompt, images in zip(call["prompts"], call["images"]):
        placed = _image_blocks(prompt)
        assert len(placed) == len(images) and all(a is b or a == b for a, b in zip(placed, images))
        assert all(isinstance(block, dict) for block in prompt[0]["content"])  # structured, as TRL's VLM prompts


def test_rloo_trains_vlm_with_single_image_column_and_text_rows(tmp_path):
    model, processor = build_tiny_vlm()
    rows = [{"prompt": r["prompt"], "image": (r["images"] or [None])[0]} for r in mixed_rows()]
    seen = []

    def reward(prompts, completions, image, **kwargs):
        seen.append(image)
        return [float(len(c[0]["content"])) for c in completions]

    trainer = RLOOTrainer(
        model,
        reward_funcs=reward,
        args=config(RLOOConfig, tmp_path, beta=0.05),
        train_dataset=Dataset.from_list(rows),
        processing_class=processor,
    )
    before = trainable_params(trainer.model)
    trainer.train()
    _check_trained(trainer, before)
    assert sum(image is None for image in seen[0]) == 2  # the text-only row's group
    assert all(image is None or isinstance(image, Image.Image) for image in seen[0])


def test_grpo_vlm_evaluates_eval_dataset(tmp_path):
    model, processor = build_tiny_vlm()
    trainer = GRPOTrainer(
        model,
        reward_funcs=RecordingReward(),
        args=config(GRPOConfig, tmp_path, per_device_eval_batch_size=4, max_steps=1),
        train_dataset=Dataset.from_list(mixed_rows()),
        eval_dataset=Dataset.from_list(mixed_rows()[:2]),
        processing_class=processor,
    )
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and math.isfinite(metrics["eval_reward"])


def test_forward_uses_the_images():
    """The policy log-probs of a batch with images equal the model's own forward with pixel_values, and change with
    the image (the vision inputs reach the forward), for the plain and the shared-prompt settings."""
    model, processor = build_tiny_vlm()
    model.eval()
    rows = [mixed_rows()[0], mixed_rows()[2]]
    _, _, prompt_ids, vision = encode_vision_prompts(rows, processor)
    completion = [[40, 41, 42], [43, 44]]
    width = max(map(len, prompt_ids))
    pad = processor.tokenizer.pad_token_id
    batch = {
        "prompt_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids]),
        "prompt_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids]),
        "completion_ids": torch.tensor([c + [pad] * (3 - len(c)) for c in completion]),
        "completion_lengths": torch.tensor([3, 2]),
        "vision_inputs": vision,
    }
    with torch.no_grad():
        plain = completion_token_stats(model, batch).logps
        shared = completion_token_stats(model, batch, share_prompts=True).logps
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]])], 1)
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
            pixel_values=vision[0]["pixel_values"],
        ).logits[:, width - 1 : -1]
        expected = logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
        other = dict(batch, vision_inputs=[{"pixel_values": torch.randn_like(vision[0]["pixel_values"])}, {}])
        changed = completion_token_stats(model, other).logps
    valid = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    torch.testing.assert_close(plain[valid], expected[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared, plain)
    assert not torch.allclose(changed[0], plain[0])  # row 0's image matters
    torch.testing.assert_close(changed[1], plain[1])  # the text-only row does not see another row's image


def test_group_sampler_prefills_each_image_prompt_once():
    """The vision tower runs once per prompt (not G times), prompts with equal ids but other images are not merged,
    and the image token is never sampled."""
    model, processor = build_tiny_vlm()
    same_text = [{"prompt": [{"role": "user", "content": "Colour?"}], "images": [_image(c)]} for c in (RED, GREEN)]
    _, _, prompt_ids, vision = encode_vision_prompts(same_text, processor)
    assert prompt_ids[0] == prompt_ids[1] and vision[0] is not vision[1]
    calls = []
    model.model.vision_tower.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    image_token = model.config.image_token_id
    sampling = SamplingConfig(
        max_new_tokens=12,
        eos_token_ids=[processor.tokenizer.eos_token_id],
        pad_token_id=processor.tokenizer.pad_token_id,
        generation_kwargs=None,
    )
    # make the image token the model's favourite next token, so only suppression keeps it out
    with torch.no_grad():
        model.lm_head.weight[image_token] = model.lm_head.weight.sum(0) * 3
    sampler = GroupSampler(model, processor)
    torch.manual_seed(0)
    out = sampler.generate(prompt_ids, sampling, num_generations=4, vision_inputs=vision)
    assert len(out) == 8 and sampler.last_stats["prefill_rows"] == 2
    assert calls == [2]  # one vision-tower call on the two prompts' two images
    assert all(image_token not in ids for ids in out.completion_ids)
    calls.clear()
    torch.manual_seed(0)
    reference = TransformersBackend(model, processor).generate(prompt_ids, sampling, 4, vision_inputs=vision)
    assert calls and calls[0] == 8  # model.generate encodes every row's image: G × prompts
    assert all(image_token not in ids for ids in reference.completion_ids)


def test_collate_vision_inputs_pads_and_aligns():
    rows = [
        {"pixel_values": torch.ones(1, 3, 2, 2), "token_type_ids": torch.tensor([0, 1, 1])},
        {},
        {"pixel_values": torch.full((2, 3, 2, 4), 2.0), "token_type_ids": torch.tensor([1, 0])},
    ]
    out = collate_vision_inputs(rows, prompt_width=4, completion_width=2)
    assert out["pixel_values"].shape == (3, 3, 2, 4)
    assert out["pixel_values"][0, :, :, 2:].abs().sum() == 0  # zero-padded trailing dims
    assert out["token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0], [0] * 6, [0, 0, 1, 0, 0, 0]]


# -- errors before training ------------------------------------------------------------------------------------
def test_images_on_a_text_only_model_raise(tmp_path):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer=tokenizer)
    with pytest.raises(ValueError, match="text-only model"):
        GRPOTrainer(
            model,
            reward_funcs=RecordingReward(),
            args=config(GRPOConfig, tmp_path),
            train_dataset=Dataset.from_list(mixed_rows()),
            processing_class=tokenizer,
        )


def test_placeholders_not_matching_images_raise(tmp_path):
    model, processor = build_tiny_vlm()
    rows = [
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}
            ],
            "images": [_image(RED)],
        }
    ] * 4
    with pytest.raises(ValueError, match=r"train_dataset row 0: Got 1 image\(s\) but the messages have 2"):
        RLOOTrainer(
            model,
            reward_funcs=RecordingReward(),
            args=config(RLOOConfig, tmp_path),
            train_dataset=Dataset.from_list(rows),
            processing_class=processor,
        )


def test_processor_without_chat_template_raises(tmp_path):
    model, processor = build_tiny_vlm()
    processor.chat_template = None
    processor.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        GRPOTrainer(
            model,
            reward_funcs=RecordingReward(),
            args=config(GRPOConfig, tmp_path),
            train_dataset=Dataset.from_list(mixed_rows()),
            processing_class=processor,
        )


def test_images_with_standard_prompts_raise(tmp_path):
    model, processor = build_tiny_vlm()
    rows = [{"prompt": "<image>What colour?", "images": [_image(RED)]}] * 4
    with pytest.raises(ValueError, match="requires conversational prompts"):
        GRPOTrainer(
            model,
            reward_funcs=RecordingReward(),
            args=config(GRPOConfig, tmp_path),
            train_dataset=Dataset.from_list(rows),
            processing_class=processor,
        )


def test_vllm_with_images_is_refused(tmp_path):
    model, processor = build_tiny_vlm()
    with pytest.raises(ValueError, match="does not support use_vllm=True with vllm_mode=.colocate. yet"):
        GRPOTrainer(
            model,
            reward_funcs=RecordingReward(),
            args=config(GRPOConfig, tmp_path, use_vllm=True, vllm_mode="colocate"),
            train_dataset=Dataset.from_list(mixed_rows()),
            processing_class=processor,
        )


def test_shared_prompt_forward_with_images_matches_plain_in_values_and_gradients():
    """Two prompts with the same text but other images, and a text-only prompt, G = 2 each: the shared-prompt layout
    (each prompt with its images encoded once) gives the plain forward's log-probs and parameter gradients."""
    from posttrain.models.completion_scoring import choose_shared_prompt_layout

    model, processor = build_tiny_vlm()
    model.eval()
    rows = [
        {"prompt": [{"role": "user", "content": "Colour?"}], "images": [_image(RED)]},
        {"prompt": [{"role": "user", "content": "Colour?"}], "images": [_image(GREEN, (30, 12))]},
        {"prompt": [{"role": "user", "content": "Words only, please."}], "images": []},
    ]
    grouped = [row for row in rows for _ in range(2)]
    _, _, prompt_ids, vision = encode_vision_prompts(grouped, processor)
    assert vision[0] is vision[1] and vision[1] is not vision[2]  # a group shares its prompt's processor outputs
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
    layout = choose_shared_prompt_layout(model, batch)
    assert layout is not None and layout.input_ids.shape[0] == 3  # one pack per prompt-with-images
    assert int((layout.input_ids == model.config.image_token_id).sum()) == 8  # 4 image tokens per image, once each
    valid = torch.arange(4).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)

    def run(share: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logps = completion_token_stats(model, batch, share_prompts=share).logps
        (logps * valid).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logps.detach(), grads

    shapes = []
    model.model.language_model.register_forward_hook(lambda m, args, kwargs, out: shapes.append(
        tuple(kwargs["inputs_embeds"].shape[:2])), with_kwargs=True)  # fmt: skip
    plain, plain_grads = run(False)
    shared, shared_grads = run(True)
    assert shapes[0][0] == 6 and shapes[1] == tuple(layout.input_ids.shape)  # the shared run took the packed layout
    torch.testing.assert_close(shared[valid], plain[valid], atol=1e-5, rtol=1e-5)
    assert set(shared_grads) == set(plain_grads) and any("vision_tower" in n for n in plain_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_grpo_vlm_streams_and_replays_generation_batches(tmp_path):
    """A streamed dataset, two micro-batches per generation (the buffer shuffles and splits rows with their vision
    inputs), two iterations (π_old is scored with the images) and the completions log keeps the images as TRL."""
    model, processor = build_tiny_vlm()
    stream = Dataset.from_list(mixed_rows()).to_iterable_dataset()
    args = config(
        GRPOConfig,
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        max_steps=2,
        generation_backend="posttrain",
    )
    trainer = GRPOTrainer(
        model, reward_funcs=RecordingReward(), args=args, train_dataset=stream, processing_class=processor
    )
    before = trainable_params(trainer.model)
    trainer.train()
    _check_trained(trainer, before)
    assert trainer.pipeline.settings.compute_old_logps
    logged = list(trainer._logs["images"])
    assert len(logged) == 8 and sorted(len(images or []) for images in logged) == [0, 0, 1, 1, 1, 1, 2, 2]


def test_text_only_batches_of_a_vision_run_use_the_vlm_prompt_format(tmp_path):
    """TRL renders every prompt of a VLM run in content blocks through the processor, a batch without images too:
    reward functions see that format, and training works on such batches."""
    model, processor = build_tiny_vlm()
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "images": []} for i in range(4)]
    reward = RecordingReward()
    trainer = GRPOTrainer(
        model,
        reward_funcs=reward,
        args=config(GRPOConfig, tmp_path, max_steps=1),
        train_dataset=Dataset.from_list(rows),
        processing_class=processor,
    )
    trainer.train()
    prompt = reward.calls[0]["prompts"][0]
    assert prompt[0]["content"][0]["type"] == "text"
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_grpo_loads_vlm_and_processor_from_a_path(tmp_path):
    """As the seed's quick start: the model id alone; the processor (with its chat template) is loaded beside it."""
    from posttrain.models.tiny import save_tiny_vlm

    path = save_tiny_vlm(tmp_path / "tiny-vlm")
    trainer = GRPOTrainer(
        path,
        reward_funcs=RecordingReward(),
        args=config(GRPOConfig, tmp_path / "out", max_steps=1),
        train_dataset=Dataset.from_list(mixed_rows()),
    )
    assert type(trainer.model).__name__ == "LlavaForConditionalGeneration"
    assert type(trainer.processing_class).__name__ == "LlavaProcessor"
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_grpo_vlm_trains_a_lora_adapter(tmp_path):
    """LoRA on the attention projections (language model and vision tower): only adapter weights train, and the
    reference (the adapter switched off) scores the images too — the KL is 0 at the first step, positive after."""
    from peft import LoraConfig

    model, processor = build_tiny_vlm()
    trainer = GRPOTrainer(
        model,
        reward_funcs=RecordingReward(),
        args=config(GRPOConfig, tmp_path),
        train_dataset=Dataset.from_list(mixed_rows()),
        processing_class=processor,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    before = trainable_params(trainer.model)
    assert before and all("lora_" in name for name in before)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(before[n], after[n].detach()) for n in before if "lora_B" in n)
    kls = [log["kl"] for log in trainer.state.log_history if "kl" in log]
    assert kls[0] == 0.0 and kls[1] > 0.0


def _tiny_qwen2_vl():
    """The tiny Qwen2-VL of :func:`build_tiny_vlm` (multimodal RoPE, flattened patches with ``image_grid_thw``),
    its tokenizer, one image prompt's ids and that image's per-row vision inputs; also ``processor`` (the image-only
    Qwen2-VL processor, no torchvision) as a fifth item."""
    model, processor = build_tiny_vlm(family="qwen2_vl")
    model.eval()
    tok = processor.tokenizer
    names = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
    ids = dict(zip(names, tok.convert_tokens_to_ids(list(names))))
    pixels = processor.image_processor(images=[_image(RED)], return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // 4
    prompt = [257, ids["<|vision_start|>"], *[ids["<|image_pad|>"]] * n, ids["<|vision_end|>"], 72, 105, 10]
    types = torch.tensor([1 if t == ids["<|image_pad|>"] else 0 for t in prompt])
    vision = {
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
        "mm_token_type_ids": types,
    }
    return model, tok, prompt, vision, processor


def test_multimodal_rope_model_scores_and_samples_with_its_images():
    """Qwen2-VL's path: the forward takes no position_ids (the model derives its 3-D positions from the images and
    the per-token types), a left-padded mixed batch scores each row as it scores alone, and the group sampler hands
    such prompts to model.generate."""
    model, tok, prompt, vision, _ = _tiny_qwen2_vl()
    text_prompt = [257, 72, 105, 10]
    completion = [[40, 41, 42], [43, 44, 45]]
    width, pad = len(prompt), tok.pad_token_id
    batch = {
        "prompt_ids": torch.tensor([prompt, [pad] * (width - 4) + text_prompt]),
        "prompt_mask": torch.tensor([[1] * width, [0] * (width - 4) + [1] * 4]),
        "completion_ids": torch.tensor(completion),
        "completion_lengths": torch.tensor([3, 3]),
        "vision_inputs": [vision, {}],
    }
    with torch.no_grad():
        scored = completion_token_stats(model, batch, share_prompts=True).logps
        for row, (ids, inputs) in enumerate([(prompt, vision), (text_prompt, {})]):
            x = torch.tensor([ids + completion[row]])
            kwargs = {}
            if inputs:
                kwargs = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
                kwargs["mm_token_type_ids"] = torch.cat(
                    [inputs["mm_token_type_ids"], torch.zeros(3, dtype=torch.long)]
                )[None]
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), **kwargs).logits[0, len(ids) - 1 : -1]
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion[row])[:, None]).squeeze(-1)
            torch.testing.assert_close(scored[row], expected, atol=1e-4, rtol=1e-4)
    sampling = SamplingConfig(max_new_tokens=4, eos_token_ids=[tok.eos_token_id], pad_token_id=pad)
    sampler = GroupSampler(model, tok)
    out = sampler.generate([prompt], sampling, num_generations=2, vision_inputs=[vision])
    assert len(out) == 2 and sampler.last_stats["prefill_rows"] == 0  # sampled by model.generate instead
