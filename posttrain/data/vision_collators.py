"""TRL's ``DataCollatorForVisionLanguageModeling``: raw image+text rows → processed, padded batches with labels.

Vision-language SFT cannot pre-tokenize: the processor turns each image placeholder into the model's image tokens and
the images into ``pixel_values`` together, so this collator does the whole pipeline on the fly, per batch:

1. images from ``images`` (a list) or ``image`` (one image);
2. text: conversational ``messages`` (language modelling) or ``prompt``/``completion`` get the images placed with
   :func:`~posttrain.data.multimodal.prepare_multimodal_messages` and are rendered with the processor's chat template;
   standard rows (``dataset_text_field``, or string ``prompt``/``completion``) must already hold the image placeholders;
3. the processor runs on text + images; every row is truncated to ``max_length`` (an error, never a silent cut, when
   that would drop image tokens) and right-padded;
4. ``labels`` = ``input_ids`` with -100 on padding, on image tokens, and on the prompt of prompt-completion rows when
   ``completion_only_loss``.

Deliberate difference from TRL: image tokens are masked in ``labels`` (TRL leaves them to the model), since posttrain's
SFT loss is computed from ``labels`` directly and an image placeholder is never a token worth predicting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.collators import pad
from posttrain.data.multimodal import prepare_multimodal_messages
from posttrain.data.tokenization import IGNORE_INDEX

# Processor outputs with one value per token (padded and truncated with input_ids); others (pixel_values,
# image_sizes, image_grid_thw, ...) describe the images and pass through unchanged.
_PER_TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def _row_images(example: Mapping[str, Any], index: int) -> list[Any]:
    """The row's images as a list, from ``images`` (a list) or ``image`` (one image)."""
    if "images" in example:
        images = example["images"]
        if images is None:
            raise ValueError(f"Row {index}: column 'images' is None; give a list of images ([] for none).")
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            raise ValueError(
                f"Row {index}: column 'images' must be a list of images, got {type(images).__name__}; wrap a single "
                "image as [image] or name the column 'image'."
            )
        return list(images)
    if "image" in example:
        if example["image"] is None:
            raise ValueError(f"Row {index}: column 'image' is None; every row needs its image (or drop the row).")
        return [example["image"]]
    raise ValueError(
        f"Row {index} has no 'images' or 'image' column (columns: {sorted(example)}). Add the row's images, or use "
        "DataCollatorForLanguageModeling for text-only data."
    )


def _check_keeps_image_tokens(ids: torch.Tensor, image_ids: torch.Tensor, limit: int, option: str, row: int) -> None:
    """Raise if keeping the first ``limit`` of ``ids`` would cut image tokens (the model would then fail or misread)."""
    cut = torch.isin(ids[limit:], image_ids)
    if cut.any():
        last = int(torch.isin(ids, image_ids).nonzero().max()) + 1
        raise ValueError(
            f"Row {row}: truncating to {option}={limit} would cut {int(cut.sum())} of its image tokens (its images "
            f"end at token {last}). Raise {option} to at least {last}, or use smaller/fewer images."
        )


def _is_conversational(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0


@dataclass
class _ProcessorCollator:
    """Helpers the vision collators share: the processor's tokenizer, pad and image-token ids, rendering, processing."""

    processor: Any

    # -- helpers -------------------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    def _pad_token_id(self) -> int:
        tok = self.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad_id is None:
            raise ValueError("The processor's tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token.")
        return pad_id

    def _image_token_ids(self) -> set[int]:
        """Ids of the placeholder tokens that stand for image (and video) features."""
        ids = set()
        for kind in ("image", "video"):
            token_id = getattr(self.processor, f"{kind}_token_id", None)
            token = getattr(self.processor, f"{kind}_token", None)
            if token_id is None and isinstance(token, str):
                token_id = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != getattr(self.tokenizer, "unk_token_id", None):
                ids.add(token_id)
        return ids

    def _render(self, messages: list[dict], **kwargs: Any) -> str:
        """Render one conversation with the collator's ``chat_template`` when it has one, else the processor's (the
        tokenizer's when the processor has none)."""
        owner = self.processor if getattr(self.processor, "chat_template", None) else self.tokenizer
        template = getattr(self, "chat_template", None)
        if template is not None:
            kwargs["chat_template"] = template
        elif not getattr(owner, "chat_template", None):
            raise ValueError(
                "The processor has no chat template to render conversational rows; set processor.chat_template."
            )
        text = owner.apply_chat_template(messages, tokenize=False, **kwargs)
        return text[0] if isinstance(text, list) else text

    def _process(self, texts: list[str], images: list[list[Any]] | None, rows: range) -> Any:
        kwargs = dict(text=texts, padding=True, padding_side="right", add_special_tokens=False, return_tensors="pt")
        if images is not None:
            kwargs["images"] = images
        try:
            return self.processor(**kwargs)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"The processor failed on rows {rows.start}-{rows.stop - 1}: {err} Check that every row's images match "
                "its image placeholders (standard text rows must contain the image token once per image)."
            ) from err

    def _prompt_completion_texts(
        self, prompt: Any, completion: Any, images: list[Any], index: int, column: str = "completion"
    ) -> tuple[str, str]:
        """(prompt text with the images' placeholders, completion text) of one row; ``column`` names the completion."""
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion
        if not (_is_conversational(prompt) and _is_conversational(completion)):
            raise ValueError(
                f"Row {index}: 'prompt' and {column!r} must both be strings or both be lists of messages."
            )
        messages = prepare_multimodal_messages(list(prompt) + list(completion), images)
        prompt_messages = messages[: len(prompt)]
        continue_final = prompt_messages[-1].get("role") == "assistant"
        prompt_text = self._render(
            prompt_messages, add_generation_prompt=not continue_final, continue_final_message=continue_final
        )
        full_text = self._render(messages)
        if not full_text.startswith(prompt_text):
            raise ValueError(
                f"Row {index}: the chat template renders the prompt differently when the completion follows it, so "
                "the prompt/completion boundary is unknown. Use a template whose prompt rendering is a prefix of the "
                "full conversation, or a language-modelling 'messages' dataset."
            )
        return prompt_text, full_text[len(prompt_text) :]

    def _prompt_row(self, processed: Any, index: int, keys: list[str]) -> dict[str, torch.Tensor]:
        """Row ``index`` of the processed prompts without the processor's padding."""
        keep = processed["attention_mask"][index].bool()
        return {k: processed[k][index][keep] for k in keys}

    def _join_completion(
        self, prompt: dict[str, torch.Tensor], cids: torch.Tensor, image_ids: torch.Tensor, index: int
    ) -> dict[str, torch.Tensor]:
        """prompt + completion ids with ``completion_mask``, cut to ``max_length`` (never through image tokens, never
        leaving no completion token)."""
        n_prompt = len(prompt["input_ids"])
        row = {}
        for k, v in prompt.items():
            extra = cids if k == "input_ids" else torch.ones_like(cids) if k == "attention_mask" else None
            row[k] = torch.cat([v, extra if extra is not None else torch.zeros_like(cids)])
        row["completion_mask"] = torch.cat([torch.zeros(n_prompt, dtype=torch.long), torch.ones_like(cids)])
        limit = getattr(self, "max_length", None)
        if limit is not None and len(row["input_ids"]) > limit:
            _check_keeps_image_tokens(row["input_ids"], image_ids, limit, "max_length", index)
            if n_prompt >= limit:
                raise ValueError(
                    f"Row {index}: its prompt ({n_prompt} tokens with the image tokens) fills max_length={limit}, "
                    "leaving no completion token. Raise max_length or shorten the prompt."
                )
            row = {k: v[:limit] for k, v in row.items()}
        return row

    def _pad_rows(self, rows: list[dict[str, torch.Tensor]], prefix: str = "") -> dict[str, torch.Tensor]:
        """Right-pad the rows' per-token tensors into ``(N, L)`` batches, keys prefixed with ``prefix``."""
        pad_to = getattr(self, "pad_to_multiple_of", None)
        return {
            f"{prefix}{k}": pad([r[k] for r in rows], self._pad_token_id() if k == "input_ids" else 0, "right", pad_to)
            for k in rows[0]
        }


@dataclass
class DataCollatorForVisionLanguageModeling(_ProcessorCollator):
    """Collator for vision-language SFT rows: images + ``messages`` / ``prompt``-``completion`` / text → batch.

    Args:
        processor: A multimodal processor (e.g. ``LlavaProcessor``) with a chat template and a tokenizer.
        max_length: Truncate each row to this many tokens (after image-token expansion); ``None`` = no truncation.
            A row whose image tokens would be cut raises (raise ``max_length``).
        completion_only_loss: For prompt-completion rows, -100 on the prompt tokens (no effect on other rows).
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        dataset_text_field: Column holding the text of standard (non-conversational) language-modelling rows.
        assistant_only_loss: For conversational ``messages`` rows, -100 on every token outside the assistant turns
            (the ``{% generation %}`` blocks of the chat template, which must have them).
        chat_template: Chat template used to render ``messages`` rows (default: the processor's).
        return_tensors: Only ``"pt"``.

    Fields are in TRL's order. As in TRL, ``completion_only_loss=True`` on language-modelling rows and
    ``assistant_only_loss=True`` on non-conversational rows raise ``ValueError``.

    Returns (from ``__call__``):
        ``input_ids``, ``attention_mask``, ``labels`` ``(B, L)`` (right padded), any other per-token output of the
        processor (``token_type_ids``, ...), and its image outputs (``pixel_values``, ...).
    """

    max_length: int | None = None
    completion_only_loss: bool = False
    pad_to_multiple_of: int | None = None
    dataset_text_field: str = "text"
    assistant_only_loss: bool = False
    chat_template: str | None = None
    return_tensors: str = "pt"

    def __post_init__(self):
        if self.return_tensors != "pt":
            raise ValueError(f"return_tensors={self.return_tensors!r} is not supported; use 'pt'.")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be a positive int or None, got {self.max_length}.")

    # -- text of each row ----------------------------------------------------------------------------------------
    def _kind(self, example: Mapping[str, Any], index: int) -> str:
        if "messages" in example:
            if not _is_conversational(example["messages"]):
                raise ValueError(f"Row {index}: column 'messages' is empty or not a list of messages.")
            return "messages"
        if "prompt" in example and "completion" in example:
            for column in ("prompt", "completion"):
                if example[column] is None:
                    raise ValueError(f"Row {index}: column {column!r} is None; give it text or messages.")
            return "prompt-completion"
        if self.dataset_text_field in example:
            if not isinstance(example[self.dataset_text_field], str):
                raise ValueError(
                    f"Row {index}: column {self.dataset_text_field!r} must be a string (containing the image "
                    f"placeholders), got {type(example[self.dataset_text_field]).__name__}."
                )
            return "text"
        raise ValueError(
            f"Row {index} has no text (columns: {sorted(example)}). Expected 'messages', 'prompt' + 'completion', or "
            f"the dataset_text_field {self.dataset_text_field!r}."
        )

    # -- collation -----------------------------------------------------------------------------------------------
    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("Cannot collate an empty batch.")
        rows = range(len(examples))
        images = [_row_images(ex, i) for i, ex in zip(rows, examples)]
        kinds = [self._kind(ex, i) for i, ex in zip(rows, examples)]
        if len(set(kinds)) > 1:
            raise ValueError(
                f"A batch mixes row formats ({', '.join(sorted(set(kinds)))}); rows 0 and "
                f"{next(i for i, k in enumerate(kinds) if k != kinds[0])} differ. Use one format per dataset."
            )
        if self.assistant_only_loss and kinds[0] != "messages":
            raise ValueError(
                "The `assistant_only_loss` argument is only supported for conversational language modeling datasets. "
                f"These rows are {kinds[0]} rows; give them a `messages` column or set assistant_only_loss=False."
            )
        if self.completion_only_loss and kinds[0] != "prompt-completion":
            raise ValueError(
                "The `completion_only_loss` argument is not supported for language modeling datasets. Use "
                "prompt-completion rows (`prompt` and `completion` columns) or set completion_only_loss=False."
            )
        # processors need images=None when no row has one
        batch_images = images if any(images) else None
        assistant_masks = None
        if kinds[0] == "prompt-completion":
            pairs = [
                self._prompt_completion_texts(ex["prompt"], ex["completion"], imgs, i)
                for i, ex, imgs in zip(rows, examples, images)
            ]
            processed = self._process([p for p, _ in pairs], batch_images, rows)
            completions = self.tokenizer(
                [c for _, c in pairs], padding=True, padding_side="right", add_special_tokens=False,
                return_tensors="pt",
            )  # fmt: skip
        else:
            if kinds[0] == "messages":
                texts = [
                    self._render(prepare_multimodal_messages(ex["messages"], imgs))
                    for ex, imgs in zip(examples, images)
                ]
            else:
                texts = [ex[self.dataset_text_field] for ex in examples]
            processed = self._process(texts, batch_images, rows)
            completions = None
            if self.assistant_only_loss:
                assistant_masks = self._assistant_masks(examples, images, processed)
        return self._finish(processed, completions, assistant_masks)

    def _assistant_masks(self, examples: Sequence[Mapping[str, Any]], images: list, processed: Any) -> list:
        """Per row (unpadded), 1 on the tokens the chat template's ``{% generation %}`` blocks produce."""
        from posttrain.data.chat_templates import has_generation_markers

        template = self.chat_template or getattr(self.processor, "chat_template", None)
        if not has_generation_markers(template):
            raise ValueError(
                "assistant_only_loss=True needs a chat template with `{% generation %}` ... `{% endgeneration %}` "
                "around the assistant turns, to know which tokens are the assistant's; this one has none. Pass "
                "chat_template= with such markers, or set assistant_only_loss=False."
            )
        marked = self.processor.apply_chat_template(
            [prepare_multimodal_messages(ex["messages"], imgs) for ex, imgs in zip(examples, images)],
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            return_assistant_tokens_mask=True,
            processor_kwargs={"padding": True, "padding_side": "right", "add_special_tokens": False},
        )
        masks = []
        for b in range(processed["input_ids"].shape[0]):
            ids = processed["input_ids"][b][processed["attention_mask"][b].bool()]
            keep = marked["attention_mask"][b].bool()
            if not torch.equal(marked["input_ids"][b][keep], ids):
                raise ValueError(
                    f"Row {b}: the chat template tokenizes differently with and without assistant masks; "
                    "assistant_only_loss cannot align them. Use a chat_template whose rendering does not depend on "
                    "tokenization."
                )
            masks.append(marked["assistant_masks"][b][keep].bool())
        return masks

    def _finish(
        self, processed: Any, completions: Any, assistant_masks: list[torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Split rows out of the processor's padding, append completions, truncate, re-pad, build labels."""
        keys = [k for k in _PER_TOKEN_KEYS if k in processed]
        image_ids = torch.tensor(sorted(self._image_token_ids()), dtype=torch.long)
        columns: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        prompt_flags: list[torch.Tensor] = []
        for b in range(processed["input_ids"].shape[0]):
            keep = processed["attention_mask"][b].bool()
            row = {k: processed[k][b][keep] for k in keys}
            is_prompt = torch.full_like(row["input_ids"], completions is not None, dtype=torch.bool)
            if completions is not None:
                ckeep = completions["attention_mask"][b].bool()
                cids = completions["input_ids"][b][ckeep]
                for k in keys:
                    extra = cids if k == "input_ids" else torch.ones_like(cids) if k == "attention_mask" else None
                    row[k] = torch.cat([row[k], extra if extra is not None else torch.zeros_like(cids)])
                is_prompt = torch.cat([is_prompt, torch.zeros_like(cids, dtype=torch.bool)])
            if assistant_masks is not None:
                # "prompt" here: every token outside the assistant turns
                is_prompt = ~assistant_masks[b]
            if self.max_length is not None and len(row["input_ids"]) > self.max_length:
                _check_keeps_image_tokens(row["input_ids"], image_ids, self.max_length, "max_length", b)
                row = {k: v[: self.max_length] for k, v in row.items()}
                is_prompt = is_prompt[: self.max_length]
            for k in keys:
                columns[k].append(row[k])
            prompt_flags.append(is_prompt)

        out = {k: v for k, v in processed.items() if k not in _PER_TOKEN_KEYS}
        for k in keys:
            value = self._pad_token_id() if k == "input_ids" else 0
            out[k] = pad(columns[k], value, "right", self.pad_to_multiple_of)
        labels = out["input_ids"].clone()
        labels[out["attention_mask"] == 0] = IGNORE_INDEX
        labels[torch.isin(labels, image_ids)] = IGNORE_INDEX
        if (self.completion_only_loss and completions is not None) or assistant_masks is not None:
            labels[pad(prompt_flags, False, "right", self.pad_to_multiple_of)] = IGNORE_INDEX
        out["labels"] = labels
        return out


@dataclass
class DataCollatorForVisionPreference(_ProcessorCollator):
    """TRL's vision DPO collator: images + ``prompt``/``chosen``/``rejected`` rows → one ``(2B, L)`` scored batch.

    Each row's prompt (with its images placed by :func:`~posttrain.data.multimodal.prepare_multimodal_messages` and
    rendered with the processor's chat template) goes through the processor once; the chosen and rejected
    completions (the rendered suffix after the prompt) through the tokenizer. Implicit-prompt rows are split with
    :func:`posttrain.data.utils.maybe_extract_prompt`. Standard (string) rows must already hold the image placeholders
    in their prompt and get EOS appended to their completions, as in text DPO.

    Args:
        processor: A multimodal processor (e.g. ``LlavaProcessor``) with a chat template and a tokenizer.
        max_length: Keep the first this-many tokens of each prompt+completion (DPOConfig's ``max_length``); raises
            when that would cut image tokens or leave no completion token.
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        return_tensors: Only ``"pt"``.
        max_prompt_length: posttrain's: keep the last this-many prompt tokens; raises when that would cut image
            tokens.
        max_completion_length: posttrain's: keep the first this-many tokens of each completion.

    Returns (from ``__call__``):
        ``input_ids``, ``attention_mask``, ``completion_mask`` ``(2B, L)`` (right padded; rows ``0..B-1`` are
        prompt+chosen, ``B..2B-1`` prompt+rejected, as :class:`~posttrain.data.collators.DataCollatorForPreference`),
        any other per-token output of the processor, and its image outputs (``pixel_values``, ``image_sizes``, ...)
        repeated for the chosen and rejected halves.
    """

    # TRL's fields first, in TRL's order (positional arguments mean the same); posttrain's additions after them
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"
    max_prompt_length: int | None = None
    max_completion_length: int | None = None

    def __post_init__(self):
        if self.return_tensors != "pt":
            raise ValueError(f"return_tensors={self.return_tensors!r} is not supported; use 'pt'.")
        for option in ("max_prompt_length", "max_completion_length", "max_length", "pad_to_multiple_of"):
            value = getattr(self, option)
            if value is not None and value < 1:
                raise ValueError(f"{option} must be a positive int or None, got {value}.")

    def _texts(self, example: Mapping[str, Any], images: list[Any], index: int) -> tuple[str, str, str]:
        """(prompt, chosen, rejected) texts of one row; the prompt carries the images' placeholders."""
        from posttrain.data.utils import maybe_extract_prompt

        for column in ("chosen", "rejected"):
            if example.get(column) is None:
                raise ValueError(
                    f"Row {index}: column {column!r} is missing or None (columns: {sorted(example)}); vision "
                    "preference rows need 'prompt' (or an implicit prompt), 'chosen' and 'rejected'."
                )
        example = maybe_extract_prompt(example)
        if example.get("prompt") is None or len(example["prompt"]) == 0:
            raise ValueError(
                f"Row {index}: the prompt is empty; the images are placed in the prompt, so give a 'prompt' column "
                "(or chosen/rejected conversations that share their opening user message)."
            )
        prompt, chosen = self._prompt_completion_texts(example["prompt"], example["chosen"], images, index, "chosen")
        prompt_r, rejected = self._prompt_completion_texts(
            example["prompt"], example["rejected"], images, index, "rejected"
        )
        if prompt_r != prompt:
            raise ValueError(
                f"Row {index}: the chat template renders the prompt differently before 'chosen' and 'rejected'; use "
                "a template whose prompt rendering does not depend on the completion."
            )
        return prompt, chosen, rejected

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("Cannot collate an empty batch.")
        rows = range(len(examples))
        images = [_row_images(ex, i) for i, ex in zip(rows, examples)]
        texts = [self._texts(ex, imgs, i) for i, ex, imgs in zip(rows, examples, images)]
        processed = self._process([t[0] for t in texts], images if any(images) else None, rows)
        completions = self.tokenizer([t[1] for t in texts] + [t[2] for t in texts], add_special_tokens=False)[
            "input_ids"
        ]
        eos = self.tokenizer.eos_token_id
        standard = [isinstance(ex.get("chosen"), str) for ex in examples]
        keys = [k for k in _PER_TOKEN_KEYS if k in processed]
        image_ids = torch.tensor(sorted(self._image_token_ids()), dtype=torch.long)
        joined = []
        for j, completion in enumerate(completions):
            b = j % len(examples)
            row = self._truncate_prompt(self._prompt_row(processed, b, keys), image_ids, b)
            cids = list(completion) + ([eos] if standard[b] and eos is not None else [])
            if self.max_completion_length is not None:
                cids = cids[: self.max_completion_length]
            joined.append(self._join_completion(row, torch.tensor(cids, dtype=torch.long), image_ids, b))

        out: dict[str, Any] = {}
        for k, v in processed.items():
            if k not in _PER_TOKEN_KEYS:  # image outputs: one copy for the chosen half, one for the rejected half
                out[k] = torch.cat([v, v]) if isinstance(v, torch.Tensor) else list(v) + list(v)
        out.update(self._pad_rows(joined))
        return out

    def _truncate_prompt(self, row: dict[str, torch.Tensor], image_ids: torch.Tensor, index: int) -> dict:
        """Keep the last ``max_prompt_length`` prompt tokens (the ones next to the completion), never image tokens."""
        limit, ids = self.max_prompt_length, row["input_ids"]
        if limit is None or len(ids) <= limit:
            return row
        dropped = torch.isin(ids[: len(ids) - limit], image_ids)
        if dropped.any():
            first = int(torch.isin(ids, image_ids).nonzero().min())
            raise ValueError(
                f"Row {index}: truncating the prompt to max_prompt_length={limit} (keeping its end) would cut "
                f"{int(dropped.sum())} of its image tokens. Raise max_prompt_length to at least {len(ids) - first}, "
                "or use smaller/fewer images."
            )
        return {k: v[len(ids) - limit :] for k, v in row.items()}


@dataclass
class DataCollatorForVisionUnpairedPreference(_ProcessorCollator):
    """TRL's vision KTO collator: images + ``prompt``/``completion``/``label`` rows → a ``(B, L)`` scored batch.

    Each row's prompt (with its images placed and rendered as in :class:`DataCollatorForVisionPreference`) goes
    through the processor once; the completion (rendered suffix after the prompt; EOS appended to standard string
    rows, as in text KTO) through the tokenizer. With ``calculate_kl`` the KL rows pair each prompt, and so its images,
    with the previous row's completion (rotation by one inside the batch, as the text KL pairs).

    Args:
        processor: A multimodal processor (e.g. ``LlavaProcessor``) with a chat template and a tokenizer.
        max_length: Keep the first this-many tokens of each prompt+completion; raises when that would cut image
            tokens or leave no completion token.
        calculate_kl: Also build the mismatched ``KL_*`` rows (KTOConfig ``loss_type="kto"``).
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        return_tensors: Only ``"pt"``.

    Returns (from ``__call__``):
        The keys of :class:`~posttrain.data.collators.DataCollatorForUnpairedPreference`: ``input_ids``,
        ``attention_mask``, ``completion_mask`` ``(B, L)``, ``label`` ``(B,)`` bool (True = desirable), with
        ``calculate_kl`` ``KL_input_ids``, ``KL_attention_mask``, ``KL_completion_mask`` (and ``KL_`` copies of any
        other per-token processor output); plus the processor's image outputs (``pixel_values``, ...) shared by the
        rows and their KL rows, and ``ref_logps`` / ``ref_KL_logps`` passed through when present.
    """

    max_length: int | None = None
    calculate_kl: bool = True
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __post_init__(self):
        if self.return_tensors != "pt":
            raise ValueError(f"return_tensors={self.return_tensors!r} is not supported; use 'pt'.")
        for option in ("max_length", "pad_to_multiple_of"):
            value = getattr(self, option)
            if value is not None and value < 1:
                raise ValueError(f"{option} must be a positive int or None, got {value}.")

    @staticmethod
    def _label(example: Mapping[str, Any], index: int) -> bool:
        label = example.get("label")
        scalar_array = getattr(label, "dtype", None) is not None and getattr(label, "ndim", None) == 0  # numpy/torch
        if not (isinstance(label, (bool, int)) or scalar_array):
            raise ValueError(
                f"Row {index}: column 'label' must be a bool (True = desirable completion), got {label!r} (columns: "
                f"{sorted(example)})."
            )
        return bool(label)

    def _texts(self, example: Mapping[str, Any], images: list[Any], index: int) -> tuple[str, str]:
        """(prompt, completion) texts of one row; the prompt carries the images' placeholders."""
        for column in ("prompt", "completion"):
            if example.get(column) is None or len(example[column]) == 0:
                raise ValueError(
                    f"Row {index}: column {column!r} is missing or empty (columns: {sorted(example)}); vision unpaired "
                    "rows need 'prompt' (holding the images' turn), 'completion' and 'label'."
                )
        return self._prompt_completion_texts(example["prompt"], example["completion"], images, index)

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("Cannot collate an empty batch.")
        rows = range(len(examples))
        images = [_row_images(ex, i) for i, ex in zip(rows, examples)]
        labels = [self._label(ex, i) for i, ex in zip(rows, examples)]
        texts = [self._texts(ex, imgs, i) for i, ex, imgs in zip(rows, examples, images)]
        processed = self._process([t[0] for t in texts], images if any(images) else None, rows)
        eos = self.tokenizer.eos_token_id
        completions = [
            list(ids) + ([eos] if isinstance(ex["completion"], str) and eos is not None else [])
            for ids, ex in zip(self.tokenizer([t[1] for t in texts], add_special_tokens=False)["input_ids"], examples)
        ]
        keys = [k for k in _PER_TOKEN_KEYS if k in processed]
        image_ids = torch.tensor(sorted(self._image_token_ids()), dtype=torch.long)
        prompts = [self._prompt_row(processed, b, keys) for b in rows]

        def build(completion_ids: list[list[int]], prefix: str) -> dict[str, torch.Tensor]:
            joined = [
                self._join_completion(prompts[b], torch.tensor(completion_ids[b], dtype=torch.long), image_ids, b)
                for b in rows
            ]
            return self._pad_rows(joined, prefix)

        out: dict[str, Any] = {k: v for k, v in processed.items() if k not in _PER_TOKEN_KEYS}
        out.update(build(completions, ""))
        out["label"] = torch.tensor(labels, dtype=torch.bool)
        if self.calculate_kl:  # row b's prompt (and images) with row b-1's completion
            out.update(build(completions[-1:] + completions[:-1], "KL_"))
        for key in ("ref_logps", "ref_KL_logps"):
            if key in examples[0]:
                out[key] = torch.tensor([float(ex[key]) for ex in examples])
        return out
