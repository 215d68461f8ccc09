"""TRL's ``trl.experimental.utils`` collators.

- :class:`DPODataCollatorWithPadding` — the legacy DPO/CPO/ORPO collator: pads every ``*_input_ids`` /
  ``*_attention_mask`` / ``*_labels`` / ``*_pixel_values`` column of pre-tokenized rows (prompt columns on the left).
- :class:`DataCollatorForChatML` — ``messages`` rows (the last message is the completion) → left-padded
  ``input_ids`` / ``attention_mask`` / ``labels`` (prompt masked) plus the prompt alone (``prompts``,
  ``prompt_attention_mask``) for on-policy generation, and completion-relative ``byte_offsets``.
- :class:`DataCollatorForVisionLanguageChatML` — the same for images + ``prompt``/``completion`` rows, processed
  with a multimodal processor, plus the raw prompt/completion text.
- ``truncate_dataset`` — re-exported from :mod:`posttrain.data_utils` (TRL exports it here too).

``byte_offsets`` hold each completion token's ``(start, end)`` UTF-8 byte span counted from the start of the
completion (``(0, 0)`` on prompt and padding positions); they are computed from the fast tokenizer's character
offsets, so they are exact for every fast tokenizer (TRL fills zeros for non-byte-level ones); a slow tokenizer
gets zeros.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.collators import pad
from posttrain.data.vision_collators import _PER_TOKEN_KEYS, _ProcessorCollator, _row_images
from posttrain.data_utils import truncate_dataset

__all__ = [
    "DPODataCollatorWithPadding",
    "DataCollatorForChatML",
    "DataCollatorForVisionLanguageChatML",
    "truncate_dataset",
]

IGNORE_INDEX = -100


@dataclass
class DPODataCollatorWithPadding:
    """Pads the tokenized columns of a batch to its longest row (TRL's legacy DPO collator).

    Columns ending in ``_input_ids`` are padded with ``pad_token_id``, ``_attention_mask`` with 0, ``_labels`` with
    -100 and ``_pixel_values`` with 0 (float32); ``prompt_input_ids`` / ``prompt_attention_mask`` on the left, the
    rest on the right. ``*_logps`` columns become float tensors; anything else is passed through as a list. With
    ``is_encoder_decoder`` every padded column is right-padded and completion columns use -100.

    Args:
        pad_token_id: The tokenizer's pad token id.
        is_encoder_decoder: Whether the model is an encoder-decoder model.
    """

    pad_token_id: int = 0
    is_encoder_decoder: bool | None = False

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        for key in features[0]:
            if key.endswith(("_input_ids", "_attention_mask", "_labels", "_pixel_values")):
                value, side, dtype = self._padding(key)
                batch[key] = pad([torch.tensor(ex[key], dtype=dtype) for ex in features], value, side)
            elif key.endswith("_logps"):  # cached reference log-probs
                batch[key] = torch.tensor([ex[key] for ex in features])
            else:
                batch[key] = [ex[key] for ex in features]
        return batch

    def _padding(self, key: str) -> tuple[Any, str, torch.dtype]:
        """(padding value, side, dtype) of a padded column."""
        if key.endswith("_input_ids") and (not self.is_encoder_decoder or key.startswith("prompt")):
            if self.pad_token_id is None:
                raise ValueError(
                    "Padding is enabled, but the tokenizer is not configured with a padding token. Explicitly set "
                    "`tokenizer.pad_token` (e.g. `tokenizer.pad_token = tokenizer.eos_token`) before calling the "
                    "trainer."
                )
            value: Any = self.pad_token_id
        elif key.endswith("_attention_mask"):
            value = 0
        elif key.endswith("_pixel_values"):
            value = 0.0
        elif key.endswith("_labels") or (
            self.is_encoder_decoder and (key.startswith(("chosen", "rejected", "completion")) or "decoder" in key)
        ):
            value = IGNORE_INDEX
        else:
            raise ValueError(f"Unexpected key in batch '{key}'")
        left = not self.is_encoder_decoder and key in ("prompt_input_ids", "prompt_attention_mask")
        dtype = torch.float32 if key.endswith("_pixel_values") else torch.int64
        return value, "left" if left else "right", dtype


def _byte_level_alphabet() -> frozenset[str]:
    from posttrain.models.tiny import _bytes_to_unicode

    return frozenset(_bytes_to_unicode().values())


def _byte_spans(
    text: str, offsets: Sequence[tuple[int, int]], base_char: int, tokenizer: Any = None, ids: Sequence[int] = ()
) -> list[tuple[int, int]]:
    """UTF-8 byte spans of character ``offsets`` into ``text``, counted from character ``base_char``.

    Consecutive tokens that share one character (a multi-byte character split by a byte-level tokenizer) split its
    bytes by their pieces' byte lengths when those add up (byte-level BPE: one alphabet character per byte);
    otherwise the first token gets the character's bytes and the others an empty span at its end."""
    base = len(text[:base_char].encode("utf-8"))
    spans = [(len(text[:s].encode("utf-8")) - base, len(text[:e].encode("utf-8")) - base) for s, e in offsets]
    alphabet = _byte_level_alphabet() if tokenizer is not None else frozenset()
    i = 0
    while i < len(spans):
        j = i
        while j + 1 < len(spans) and offsets[j + 1] == offsets[i]:
            j += 1
        if j > i:
            start, end = spans[i]
            pieces = tokenizer.convert_ids_to_tokens(list(ids[i : j + 1])) if tokenizer is not None else []
            lengths = [len(p) for p in pieces] if pieces and all(set(p) <= alphabet for p in pieces) else []
            if sum(lengths) != end - start:
                lengths = [end - start] + [0] * (j - i)
            for k, n in enumerate(lengths):
                spans[i + k] = (start, start + n)
                start += n
        i = j + 1
    return spans


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids of ``text`` and their character offsets (None for a slow tokenizer)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None


@dataclass
class DataCollatorForChatML:
    """Collator for ChatML ``messages`` rows (TRL's, used by GKD-style on-policy trainers).

    The last message of each row is the completion; the ones before it, rendered with the generation prompt, are
    the prompt. Rows are cut to their last ``max_length`` tokens (oldest prompt context dropped first). Rows that
    already have ``input_ids`` are used as they are (the prompt ends where ``completion_mask`` turns 1, or is the
    tokenized ``prompt`` text).

    Args:
        tokenizer: A tokenizer with a chat template and a pad token.
        ignore_index: Label of the prompt and padding positions.
        max_length: Maximum tokens per row; None → ``min(tokenizer.model_max_length, 1024)``.
        prompt_key: Column holding an already formatted prompt (optional).
        messages_key: Column holding the conversation.

    Returns (from ``__call__``):
        ``input_ids``, ``attention_mask``, ``labels``, ``prompts``, ``prompt_attention_mask`` (all left-padded),
        ``byte_offsets`` ``(B, L, 2)``; ``original_prompt_text`` / ``original_completion_text`` when the rows have
        them.
    """

    tokenizer: Any
    ignore_index: int = IGNORE_INDEX
    max_length: int | None = None
    prompt_key: str = "prompt"
    messages_key: str = "messages"

    def __post_init__(self):
        if self.tokenizer.pad_token_id is None:
            raise ValueError("The tokenizer does not have a pad token. Please set `pad_token_id` in the tokenizer.")
        if self.max_length is None:
            self.max_length = min(self.tokenizer.model_max_length, 1024)

    def _prompt_text(self, example: Mapping[str, Any]) -> str:
        text = example.get(self.prompt_key, example.get("original_prompt_text"))
        if text is None:
            if self.messages_key not in example:
                raise KeyError(
                    f"DataCollatorForChatML needs a {self.messages_key!r} (or {self.prompt_key!r}) column; got "
                    f"{sorted(example)}."
                )
            text = self.tokenizer.apply_chat_template(
                example[self.messages_key][:-1], add_generation_prompt=True, tokenize=False
            )
        return text

    def _from_messages(self, example: Mapping[str, Any], prompt_text: str):
        """(ids, prompt length, byte offsets) of a ``messages`` row, cut to the last ``max_length`` tokens."""
        full_text = self.tokenizer.apply_chat_template(
            example[self.messages_key], add_generation_prompt=False, tokenize=False
        )
        ids, offsets = _encode_with_offsets(self.tokenizer, full_text)
        if offsets is not None:
            start = next((i for i, (s, _) in enumerate(offsets) if s >= len(prompt_text)), len(ids))
            spans = [(0, 0)] * start + _byte_spans(
                full_text, offsets[start:], len(prompt_text), self.tokenizer, ids[start:]
            )
        else:
            start = len(self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
            spans = [(0, 0)] * len(ids)
        if self.max_length is not None and len(ids) > self.max_length:
            cut = len(ids) - self.max_length
            ids, spans, start = ids[cut:], spans[cut:], max(0, start - cut)
            if start == 0 and spans and offsets is not None:  # truncation reached the completion: rebase at byte 0
                base = spans[0][0]
                spans = [(s - base, e - base) for s, e in spans]
        return ids, start, spans

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        rows, prompt_lens, byte_offsets, masks = [], [], [], []
        for example in examples:
            prompt_text = self._prompt_text(example)
            if "input_ids" not in example:
                ids, prompt_len, spans = self._from_messages(example, prompt_text)
                mask = [1] * len(ids)
            else:
                ids = list(example["input_ids"])
                mask = list(example.get("attention_mask", [1] * len(ids)))
                completion_mask = example.get("completion_mask")
                if completion_mask is not None:
                    completion_mask = list(completion_mask)
                    prompt_len = completion_mask.index(1) if 1 in completion_mask else len(ids)
                else:
                    prompt_ids = self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
                    prompt_len = min(len(prompt_ids), len(ids))
                spans = [tuple(o) for o in example.get("byte_offsets", [(0, 0)] * len(ids))]
            if prompt_len == 0:
                raise ValueError(
                    f"An example has no prompt tokens left after truncation to max_length={self.max_length}. This "
                    "happens when the completion alone fills the whole window, so the prompt is entirely dropped, "
                    "leaving nothing to generate from. Increase `max_length`."
                )
            rows.append(ids)
            masks.append(mask)
            prompt_lens.append(prompt_len)
            byte_offsets.append(spans)

        def left(seqs: list[list[int]], value: int) -> torch.Tensor:
            return pad([torch.tensor(s, dtype=torch.long) for s in seqs], value, "left")

        labels = [[self.ignore_index] * n + ids[n:] for ids, n in zip(rows, prompt_lens)]
        input_ids = left(rows, self.tokenizer.pad_token_id)
        out = {
            "input_ids": input_ids,
            "attention_mask": left(masks, 0),
            "labels": left(labels, self.ignore_index),
            "prompts": left([ids[:n] for ids, n in zip(rows, prompt_lens)], self.tokenizer.pad_token_id),
            "prompt_attention_mask": left([[1] * n for n in prompt_lens], 0),
            "byte_offsets": pad(
                [torch.tensor(s, dtype=torch.long).reshape(-1, 2) for s in byte_offsets], 0, "left"
            ).reshape(len(rows), input_ids.shape[1], 2),
        }
        if "original_prompt_text" in examples[0] and "original_completion_text" in examples[0]:
            out["original_prompt_text"] = [ex["original_prompt_text"] for ex in examples]
            out["original_completion_text"] = [ex["original_completion_text"] for ex in examples]
        return out


def _raw_text(value: Any) -> str:
    """The plain text of a string or of a conversation's text blocks (turns joined with newlines)."""
    if isinstance(value, str):
        return value
    parts = []
    for turn in value:
        content = turn.get("content", "")
        if isinstance(content, str):
            if content:
                parts.append(content)
            continue
        texts = [
            b.get("text", "") if isinstance(b, dict) else b
            for b in content
            if (isinstance(b, dict) and b.get("type") == "text" and b.get("text")) or (isinstance(b, str) and b)
        ]
        if texts:
            parts.append("\n".join(texts))
    return "\n".join(parts)


@dataclass
class DataCollatorForVisionLanguageChatML(_ProcessorCollator):
    """Collator for vision-language ``prompt``/``completion`` rows with images, for on-policy distillation (TRL's,
    used by GOLD): the prompt (with its images) is processed by the multimodal processor, the completion is text.

    Args:
        processor: A multimodal processor (e.g. ``LlavaProcessor``) with a chat template.
        max_length: Truncate each prompt+completion row to this many tokens (never through image tokens); None: no
            truncation.
        return_tensors: Only ``"pt"``.

    Returns (from ``__call__``):
        ``input_ids``, ``attention_mask``, ``labels`` (prompt and padding -100), ``byte_offsets`` (right-padded), any
        other per-token processor output (``token_type_ids``, ...), the image outputs (``pixel_values``, ...),
        ``prompts`` / ``prompt_attention_mask`` (the prompts alone, left-padded) and ``original_prompt_text`` /
        ``original_completion_text`` (the rows' plain text).
    """

    max_length: int | None = None
    return_tensors: str = "pt"

    def __post_init__(self):
        if self.return_tensors != "pt":
            raise ValueError(f"return_tensors={self.return_tensors!r} is not supported; use 'pt'.")

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if "prompt" not in examples[0] or "completion" not in examples[0]:
            raise KeyError(
                "DataCollatorForVisionLanguageChatML requires 'prompt' and 'completion' keys in examples. "
                f"Got keys: {list(examples[0].keys())}."
            )
        indices = range(len(examples))
        images = [_row_images(ex, i) for i, ex in zip(indices, examples)]
        texts = [
            self._prompt_completion_texts(ex["prompt"], ex["completion"], imgs, i)
            for i, ex, imgs in zip(indices, examples, images)
        ]
        processed = self._process([p for p, _ in texts], images if any(images) else None, indices)
        keys = [k for k in _PER_TOKEN_KEYS if k in processed]
        image_ids = torch.tensor(sorted(self._image_token_ids()), dtype=torch.long)
        rows, prompts, spans = [], [], []
        for i, (_, completion) in enumerate(texts):
            prompt = self._prompt_row(processed, i, keys)
            cids, offsets = _encode_with_offsets(self.tokenizer, completion)
            row = self._join_completion(prompt, torch.tensor(cids, dtype=torch.long), image_ids, i)
            n_prompt = len(prompt["input_ids"])
            if offsets is not None:
                completion_spans = _byte_spans(completion, offsets, 0, self.tokenizer, cids)
            else:
                completion_spans = [(0, 0)] * len(cids)
            spans.append(([(0, 0)] * n_prompt + completion_spans)[: len(row["input_ids"])])
            prompt_ids = prompt["input_ids"] if self.max_length is None else prompt["input_ids"][: self.max_length]
            prompts.append(prompt_ids)
            rows.append(row)
        out = {k: v for k, v in processed.items() if k not in _PER_TOKEN_KEYS}
        batch = self._pad_rows(rows)
        labels = batch["input_ids"].clone()
        labels[(batch["attention_mask"] == 0) | (batch.pop("completion_mask") == 0)] = IGNORE_INDEX
        out.update(batch)
        out["labels"] = labels
        out["byte_offsets"] = pad([torch.tensor(s, dtype=torch.long).reshape(-1, 2) for s in spans], 0, "right")
        out["prompts"] = pad(prompts, self._pad_token_id(), "left")
        out["prompt_attention_mask"] = pad([torch.ones_like(p) for p in prompts], 0, "left")
        out["original_prompt_text"] = [_raw_text(ex["prompt"]) for ex in examples]
        out["original_completion_text"] = [_raw_text(ex["completion"]) for ex in examples]
        return out
