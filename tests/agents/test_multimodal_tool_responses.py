"""Multimodal tool responses in the tool loop: a tool answering ``[{"type": "image", ...}, {"type": "text", ...}]``
to a vision-language policy adds the image to the conversation (its placeholder expanded to the model's image
tokens), the next turn is generated with the prompt's and the tool's images, and the tool tokens (image tokens
included) are masked out of the loss (``tool_mask`` 0)."""

from __future__ import annotations

import torch
from agent_helpers import EOS, ScriptedLM, call, tool_responses
from PIL import Image

from posttrain.agents.loop import ToolCallingBackend
from posttrain.data.vision_prompts import encode_vision_prompts
from posttrain.generation.base import SamplingConfig
from posttrain.generation.group_sampler import GroupSampler
from posttrain.models.tiny import IMAGE_TOKEN, build_tiny_vlm, chatml_template

RED, BLUE = (255, 0, 0), (0, 0, 255)


def look() -> list:
    """Take a picture of the scene.

    Returns:
        The picture and its caption.
    """
    return [{"type": "image", "image": Image.new("RGB", (20, 24), BLUE)}, {"type": "text", "text": "the scene"}]


def _vlm_tool_template() -> str:
    """The tiny ChatML tool template whose message contents may be lists of blocks (image blocks -> ``<image>``)."""
    blocks = (
        "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for b in message.content %}"
        "{%- if b.type == 'image' %}{{- '" + IMAGE_TOKEN + "' }}{%- else %}{{- b.text }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
    )
    template = chatml_template()
    tool = "{{- '<|im_start|>tool\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' }}"
    user = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    assert tool in template and user in template
    template = template.replace(tool, "{{- '<|im_start|>tool\\n<tool_response>' }}" + blocks
                                + "{{- '</tool_response><|im_end|>\\n' }}")  # fmt: skip
    return template.replace(user, "{{- '<|im_start|>' + message.role + '\\n' }}" + blocks + "{{- '<|im_end|>\\n' }}")


def test_tool_image_reaches_the_next_turn_and_never_the_loss():
    model, processor = build_tiny_vlm()
    model.eval()
    processor.chat_template = _vlm_tool_template()
    tok = processor.tokenizer
    tok.padding_side = "left"
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)

    def script(context: str) -> str:
        return call("look", "{}") if not tool_responses(context) else "blue"

    scripted = ScriptedLM(model, tok, script).eval()
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["pixel_values"]) if kwargs.get("pixel_values") is not None
        else None, with_kwargs=True)  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
             "images": [Image.new("RGB", (20, 24), RED)]}]  # fmt: skip
    _, _, prompt_ids, vision = encode_vision_prompts(rows, processor)
    backend = ToolCallingBackend(
        GroupSampler(scripted, tok), processor, [look], max_completion_length=120, tool_call_parser="hermes",
        check_chat_template=False,
    )  # fmt: skip
    sampling = SamplingConfig(max_new_tokens=120, eos_token_ids=[EOS], pad_token_id=tok.pad_token_id)
    out = backend.generate(prompt_ids, sampling, 2, vision_inputs=vision)

    assert len(out) == 2 and out.extra["tool_call_count"] == [1, 1]
    for ids, mask, rollout_vision in zip(out.completion_ids, out.extra["tool_mask"], out.extra["vision_inputs"]):
        image_positions = [k for k, t in enumerate(ids) if t == image_id]
        assert len(image_positions) == 4  # the tool's image, expanded to the model's 4 image tokens
        assert all(mask[k] == 0 for k in image_positions)  # tool tokens: never in the loss
        assert tok.decode([t for t, m in zip(ids, mask) if m]).endswith("blue<|im_end|>")
        # the rollout's vision inputs: the prompt's image, then the tool's
        assert rollout_vision["pixel_values"].shape[0] == 2
        torch.testing.assert_close(rollout_vision["pixel_values"][:1], vision[0]["pixel_values"])
    tool_pixels = processor.image_processor(images=[look()[0]["image"]], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(out.extra["vision_inputs"][0]["pixel_values"][1:], tool_pixels)
    # the first turn prefilled the prompt once with its image; the second turn ran both rollouts, each with the
    # prompt's image and then the tool's
    assert [p.shape[0] for p in seen] == [1, 4]
    torch.testing.assert_close(seen[-1][1::2], torch.cat([tool_pixels, tool_pixels]).to(seen[-1].dtype))
    torch.testing.assert_close(seen[-1][0::2], torch.cat([vision[0]["pixel_values"]] * 2).to(seen[-1].dtype))
    messages = out.extra["completion_messages"][0]
    assert messages[1]["role"] == "tool" and messages[1]["content"][0]["type"] == "image"

    # scoring the rollouts with their images (prompt's, then tool's): the shared-prompt forward equals the plain one
    from posttrain.models.completion_scoring import completion_token_stats

    width = max(map(len, out.completion_ids))
    batch = {
        "prompt_ids": torch.tensor(out.prompt_ids),
        "prompt_mask": torch.ones(2, len(out.prompt_ids[0]), dtype=torch.long),
        "completion_ids": torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids in out.completion_ids]),
        "completion_lengths": torch.tensor([len(ids) for ids in out.completion_ids]),
        "vision_inputs": out.extra["vision_inputs"],
    }
    with torch.no_grad():
        plain = completion_token_stats(model, batch, share_prompts=False).logps
        shared = completion_token_stats(model, batch, share_prompts=True).logps
    valid = torch.arange(width)[None] < batch["completion_lengths"][:, None]
    torch.testing.assert_close(shared[valid], plain[valid], atol=1e-5, rtol=1e-5)


def test_extend_vision_appends_images_and_per_token_types():
    """A rollout's vision inputs grow by a tool suffix's: image-level outputs concatenated (tile counts padded, as
    the processors pad a batch), per-token types zero over the generated text between and the suffix's after."""
    from posttrain.agents.loop import _extend_vision

    prompt = {"pixel_values": torch.ones(1, 3, 2, 2, 2), "image_sizes": torch.tensor([[4, 4]]),
              "mm_token_type_ids": torch.tensor([0, 1, 1, 0])}  # fmt: skip
    suffix = {"pixel_values": torch.full((1, 5, 2, 2, 2), 2.0), "image_sizes": torch.tensor([[8, 4]]),
              "mm_token_type_ids": torch.tensor([0, 1, 0])}  # fmt: skip
    out = _extend_vision(prompt, suffix, length=6)  # 4 prompt tokens, 2 generated, then the suffix
    assert out["pixel_values"].shape == (2, 5, 2, 2, 2)
    assert (
        torch.equal(out["pixel_values"][0, :3], prompt["pixel_values"][0]) and out["pixel_values"][0, 3:].eq(0).all()
    )
    assert torch.equal(out["image_sizes"], torch.tensor([[4, 4], [8, 4]]))
    assert out["mm_token_type_ids"].tolist() == [0, 1, 1, 0, 0, 0, 0, 1, 0]
    # a text-only prompt whose tool answers with an image
    assert _extend_vision({}, suffix, length=3)["mm_token_type_ids"].tolist() == [0, 0, 0, 0, 1, 0]


def test_grpo_trains_vlm_with_a_tool_that_answers_with_an_image(tmp_path):
    """GRPO with images and tools: the scripted policy calls ``look`` (an image + caption), then answers; every
    training forward sees the prompt's images and the tool's, and training runs on the model's own tokens only."""
    import math

    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer

    model, processor = build_tiny_vlm()
    processor.chat_template = _vlm_tool_template()
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    rows = [
        {"prompt": [{"role": "user", "content": "What is there?"}], "images": [Image.new("RGB", (20, 24), RED)]},
        {"prompt": [{"role": "user", "content": "Look around."}], "images": []},
    ]

    def reward(completions, **kwargs):
        return [float(len(c[-1]["content"])) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=120,
        max_steps=2, learning_rate=1e-2, beta=0.1, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, write_report=False, dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows), processing_class=processor,
        tools=[look],
    )  # fmt: skip
    answers = iter(["blue", "a blue thing", "blue!", "it is blue"] * 4)

    def script(context: str) -> str:
        return call("look", "{}") if not tool_responses(context) else next(answers)

    trainer.backend.inner = GroupSampler(ScriptedLM(trainer.model, processor.tokenizer, script), processor.tokenizer)
    forwards: list[tuple[int, int]] = []  # (image tokens in input_ids, images in pixel_values) of each forward
    trainer.model.register_forward_pre_hook(
        lambda m, args, kwargs: forwards.append((int((kwargs["input_ids"] == image_id).sum()),
                                                 0 if kwargs.get("pixel_values") is None
                                                 else kwargs["pixel_values"].shape[0])),
        with_kwargs=True)  # fmt: skip
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    assert all(log["tools/call_frequency"] == 1.0 for log in logs)
    # the scoring forwards held the prompt's image (on the image rows) and every rollout's tool image, each image's
    # 4 tokens matched by one image in pixel_values
    scoring = [f for f in forwards if f[1] > 1]
    assert scoring and all(tokens == 4 * images for tokens, images in scoring)
    assert any(images == 2 * 1 + 4 for _, images in scoring)  # 2 image-prompt rows + 4 tool images


def test_tool_images_for_per_token_type_models_raise_a_clear_error():
    """Per-token types past the prompt (a tool image for Qwen2-VL / Gemma 3) cannot be scored yet: a clear error;
    prompt-only per-token types and image-feature rows pass."""
    import pytest

    from posttrain.data.vision_prompts import check_tool_image_inputs

    prompt_only = {"pixel_values": torch.ones(4, 8), "mm_token_type_ids": torch.tensor([0, 1, 0])}
    check_tool_image_inputs([prompt_only, {}, {"pixel_values": torch.ones(2, 3, 4, 4)}], [[1, 2, 3], [4], [5, 6]])
    extended = {"pixel_values": torch.ones(8, 8), "mm_token_type_ids": torch.tensor([0, 1, 0, 0, 0, 1, 0])}
    with pytest.raises(ValueError, match="per-token 'mm_token_type_ids'.*Return text from the tool"):
        check_tool_image_inputs([prompt_only, extended], [[1, 2, 3], [1, 2, 3]])


def test_tools_with_images_on_a_generation_server_are_refused(tmp_path):
    """Server-mode tool turns with images are not wired yet: refused before training, naming the option."""
    import pytest
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer

    model, processor = build_tiny_vlm()
    processor.chat_template = _vlm_tool_template()
    rows = [{"prompt": [{"role": "user", "content": "What?"}], "images": [Image.new("RGB", (20, 24), RED)]}] * 2
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to="none",
                      use_vllm=True, vllm_mode="server", max_steps=1)  # fmt: skip
    with pytest.raises(ValueError, match="does not support tools with use_vllm=True"):
        GRPOTrainer(model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                    train_dataset=Dataset.from_list(rows), processing_class=processor, tools=[look])  # fmt: skip
