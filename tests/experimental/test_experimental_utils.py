"""posttrain.experimental.utils collators: DPODataCollatorWithPadding, DataCollatorForChatML and
DataCollatorForVisionLanguageChatML on the tiny tokenizer / tiny VLM processor."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from posttrain.experimental.utils import (
    DataCollatorForChatML,
    DataCollatorForVisionLanguageChatML,
    DPODataCollatorWithPadding,
)
from posttrain.models.tiny import build_tiny_tokenizer, build_tiny_vlm


def test_dpo_collator_with_padding():
    collator = DPODataCollatorWithPadding(pad_token_id=7)
    batch = collator(
        [
            {"prompt_input_ids": [1, 2], "prompt_attention_mask": [1, 1], "chosen_labels": [3], "ref_chosen_logps": -1.0, "prompt": "a"},
            {"prompt_input_ids": [4], "prompt_attention_mask": [1], "chosen_labels": [5, 6], "ref_chosen_logps": -2.0, "prompt": "b"},
        ]
    )  # fmt: skip
    assert batch["prompt_input_ids"].tolist() == [[1, 2], [7, 4]]  # prompts on the left
    assert batch["prompt_attention_mask"].tolist() == [[1, 1], [0, 1]]
    assert batch["chosen_labels"].tolist() == [[3, -100], [5, 6]]
    assert batch["ref_chosen_logps"].tolist() == [-1.0, -2.0] and batch["prompt"] == ["a", "b"]
    with pytest.raises(ValueError, match="Unexpected key"):  # encoder-decoder: an unknown padded column
        DPODataCollatorWithPadding(is_encoder_decoder=True)([{"other_input_ids": [1]}])
    enc_dec = DPODataCollatorWithPadding(pad_token_id=7, is_encoder_decoder=True)
    out = enc_dec(
        [{"prompt_input_ids": [1, 2], "chosen_labels": [3]}, {"prompt_input_ids": [4], "chosen_labels": [5, 6]}]
    )
    assert out["prompt_input_ids"].tolist() == [[1, 2], [4, 7]] and out["chosen_labels"].tolist() == [
        [3, -100],
        [5, 6],
    ]


def test_chatml_collator_masks_the_prompt_and_returns_it_alone():
    tok = build_tiny_tokenizer()
    messages = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello é!"}],
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    ]
    batch = DataCollatorForChatML(tokenizer=tok)([{"messages": m} for m in messages])
    for b, conv in enumerate(messages):
        prompt_text = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=False)
        full_text = tok.apply_chat_template(conv, tokenize=False)
        ids = tok(full_text, add_special_tokens=False)["input_ids"]
        n_prompt = len(tok(prompt_text, add_special_tokens=False)["input_ids"])
        width = batch["input_ids"].shape[1]
        assert batch["input_ids"][b, width - len(ids) :].tolist() == ids  # left padded
        labels = batch["labels"][b, width - len(ids) :].tolist()
        assert labels == [-100] * n_prompt + ids[n_prompt:]
        prompts = batch["prompts"][b][batch["prompt_attention_mask"][b].bool()].tolist()
        assert prompts == ids[:n_prompt]
        completion_bytes = full_text[len(prompt_text) :].encode("utf-8")
        spans = batch["byte_offsets"][b][batch["labels"][b] != -100].tolist()
        assert spans[0][0] == 0 and spans[-1][1] == len(completion_bytes)  # completion-relative, contiguous
        assert all(a[1] == c[0] for a, c in zip(spans, spans[1:]))


def test_chatml_collator_keeps_the_last_max_length_tokens():
    tok = build_tiny_tokenizer()
    conv = [{"role": "user", "content": "A long question " * 4}, {"role": "assistant", "content": "Yes."}]
    full = tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    batch = DataCollatorForChatML(tokenizer=tok, max_length=20)([{"messages": conv}])
    assert batch["input_ids"][0].tolist() == full[-20:]
    with pytest.raises(ValueError, match="no prompt tokens"):
        DataCollatorForChatML(tokenizer=tok, max_length=2)([{"messages": conv}])


def test_vision_chatml_collator():
    _, processor = build_tiny_vlm()
    rows = [
        {
            "images": [Image.new("RGB", (20, 24), (255, 0, 0))],
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
            "completion": [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}],
        },
        {
            "images": [Image.new("RGB", (20, 24), (0, 0, 255))],
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour is it?"}]}
            ],
            "completion": [{"role": "assistant", "content": [{"type": "text", "text": "Blue, I think."}]}],
        },
    ]
    batch = DataCollatorForVisionLanguageChatML(processor=processor)(rows)
    assert batch["pixel_values"].shape[0] == 2
    assert batch["original_prompt_text"] == ["Colour?", "Which colour is it?"]
    assert batch["original_completion_text"] == ["Red.", "Blue, I think."]
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    for b in range(2):
        keep = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][keep]
        prompt = batch["prompts"][b][batch["prompt_attention_mask"][b].bool()]
        assert torch.equal(ids[: len(prompt)], prompt) and (prompt == image_id).any()
        labels = batch["labels"][b][keep]
        assert (labels[: len(prompt)] == -100).all() and torch.equal(labels[len(prompt) :], ids[len(prompt) :])
    assert batch["byte_offsets"].shape[:2] == batch["input_ids"].shape
