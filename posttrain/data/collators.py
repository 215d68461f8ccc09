"""Data collators: lists of tokenized rows → padded tensors, for every trainer; and TRL's ``pad``.

- ``DataCollatorForLanguageModeling`` (SFT): right padding, labels with -100, optional padding-free batches.
- ``DataCollatorForPreference`` (DPO): prompt+chosen and prompt+rejected stacked into ``(2B, L)``.
- ``DataCollatorForUnpairedPreference`` (KTO): prompt+completion, bool labels, optional KL completions.
- ``DataCollatorForRewardPreference`` (reward modelling): full chosen and rejected sequences stacked into ``(2B, L)``.

Padding-free batches put all sequences of a batch into one row with ``position_ids`` restarting at every sequence
(and at every packed document, from ``seq_lengths``). Attention must still be kept inside each sequence. With
``transformers`` 5 the model derives that from the position ids only when it is given no ``attention_mask`` and
builds no KV cache (``use_cache=False``; FlashAttention always uses them); with ``use_cache=True`` (the config default)
sequences would attend to each other. So by default the collator also emits an explicit 4-D block-diagonal causal
``attention_mask`` of shape ``(1, 1, L, L)``: boolean (True = attend) for ``sdpa``/``flex`` attention, or additive
(0 / most negative value) when ``mask_dtype`` is a float dtype, which ``eager`` attention needs (it *adds* the mask to
the scores, so a boolean mask would be silently wrong there). Set ``block_diagonal_mask=False`` for FlashAttention
(it reads ``position_ids`` and does not take 4-D masks). The mask costs L² bytes per row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from posttrain.data.tokenization import IGNORE_INDEX, truncate_sequence


def pad(
    tensors: Sequence[torch.Tensor],
    padding_value: Any = 0,
    padding_side: Literal["right", "left"] = "right",
    pad_to_multiple_of: int | None = None,
) -> torch.Tensor:
    """Stack tensors of different shapes into one, padding every dimension to the largest size.

    Args:
        tensors: ``B`` tensors with the same number of dimensions, e.g. ``(T_i,)`` or ``(T_i, D)``.
        padding_value: Fill value.
        padding_side: ``"right"`` (content first) or ``"left"`` (content last along the first dimension).
        pad_to_multiple_of: Round the first dimension up to a multiple of this.

    Returns:
        Tensor of shape ``(B, T_max, ...)`` with the dtype and device of the first tensor.

    Example:
        >>> pad([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
        tensor([[1, 2, 3],
                [4, 5, 0]])
    """
    if len(tensors) == 0:
        raise ValueError("pad() needs at least one tensor.")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}.")
    ndim = tensors[0].dim()
    if any(t.dim() != ndim for t in tensors):
        raise ValueError(f"pad() needs tensors with the same number of dimensions, got {[t.dim() for t in tensors]}.")
    shape = [max(t.shape[d] for t in tensors) for d in range(ndim)]
    if pad_to_multiple_of and ndim > 0:
        shape[0] = math.ceil(shape[0] / pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(tensors), *shape), padding_value, dtype=tensors[0].dtype, device=tensors[0].device)
    for i, t in enumerate(tensors):
        if ndim == 0:
            out[i] = t
            continue
        first = slice(0, t.shape[0]) if padding_side == "right" else slice(shape[0] - t.shape[0], shape[0])
        out[i][(first, *(slice(0, s) for s in t.shape[1:]))] = t
    return out


def block_diagonal_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """4-D causal mask that keeps attention inside each segment.

    ``mask[b, 0, i, j]`` allows attention iff ``j <= i`` and ``segment_ids[b, i] == segment_ids[b, j]``.

    Args:
        segment_ids: ``(B, L)`` integer ids, equal within a sequence (padding gets its own id).
        dtype: ``torch.bool`` (True = attend; sdpa/flex) or a float dtype (additive: 0 / ``finfo.min``; eager).

    Returns:
        ``(B, 1, L, L)`` mask.
    """
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal  # (B, L, L)
    allowed = allowed[:, None]
    if dtype == torch.bool:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def _as_long(values: Any) -> torch.Tensor:
    return values.long() if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.long)


def _seq_lengths(example: Mapping[str, Any], length: int, index: int) -> list[int]:
    lengths = example.get("seq_lengths")
    if lengths is None:
        return [length]
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if sum(lengths) != length:
        raise ValueError(
            f"Example {index}: seq_lengths sum to {sum(lengths)} but input_ids has {length} tokens; seq_lengths must "
            "describe the packed row exactly (use pack_dataset)."
        )
    return lengths


def _positions(lengths: Sequence[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)


def _segments(lengths: Sequence[int], start: int = 0) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(start, start + len(lengths)), torch.tensor(lengths, dtype=torch.long))


@dataclass
class DataCollatorForLanguageModeling:
    """Collator for (packed or not) language-modeling rows: ``input_ids`` [+ ``labels`` | ``completion_mask`` |
    ``assistant_masks``] [+ ``seq_lengths``].

    Labels: the row's ``labels`` if present, else ``input_ids`` with -100 where ``completion_mask`` is 0 (only when
    ``completion_only_loss``) or ``assistant_masks`` is 0; padding is always -100.

    Args:
        pad_token_id: Id used to pad ``input_ids``.
        completion_only_loss: Apply ``completion_mask`` when rows have one.
        padding_free: Concatenate the batch into one row ``(1, ΣT)``; ``position_ids`` restart per sequence (per
            ``seq_lengths`` entry for packed rows) and the first label of every sequence is -100.
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        return_position_ids: Also return ``position_ids`` for padded batches (always returned when padding-free or
            when rows are packed).
        block_diagonal_mask: When sequences share a row (padding-free or packed), return a 4-D block-diagonal causal
            ``attention_mask`` ``(B, 1, L, L)`` instead of relying on ``position_ids`` alone (see module docstring);
            ``False`` returns no mask for padding-free batches (FlashAttention), a 2-D padding mask otherwise.
        mask_dtype: ``torch.bool`` for sdpa/flex attention; a float dtype (the model's) for eager attention.

    Returns (from ``__call__``):
        ``input_ids`` ``(B, L)``, ``labels`` ``(B, L)``, ``attention_mask`` ``(B, L)`` or ``(B, 1, L, L)`` (absent for
        padding-free without block mask), ``position_ids`` ``(B, L)``.
    """

    pad_token_id: int
    completion_only_loss: bool = True
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    return_position_ids: bool = True
    block_diagonal_mask: bool = True
    mask_dtype: torch.dtype = torch.bool
    return_tensors: str = "pt"

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("Cannot collate an empty batch.")
        input_ids = [_as_long(ex["input_ids"]) for ex in examples]
        if "labels" in examples[0]:
            labels = [_as_long(ex["labels"]) for ex in examples]
        else:
            labels = [ids.clone() for ids in input_ids]
            for ex, lab in zip(examples, labels):
                if self.completion_only_loss and ex.get("completion_mask") is not None:
                    lab[_as_long(ex["completion_mask"]) == 0] = IGNORE_INDEX
                if ex.get("assistant_masks") is not None:
                    lab[_as_long(ex["assistant_masks"]) == 0] = IGNORE_INDEX
        lengths = [_seq_lengths(ex, len(ids), i) for i, (ex, ids) in enumerate(zip(examples, input_ids))]
        packed = any(len(n) > 1 for n in lengths) or any("seq_lengths" in ex for ex in examples)
        positions = [_positions(n) for n in lengths]
        if self.padding_free or packed:
            # a sequence's first token must not be predicted from the previous sequence's last token
            for lab, pos in zip(labels, positions):
                lab[pos == 0] = IGNORE_INDEX

        if self.padding_free:
            segments = [_segments([n for row in lengths for n in row])]
            input_ids, labels, positions = [torch.cat(input_ids)], [torch.cat(labels)], [torch.cat(positions)]
        else:
            segments = [_segments(n) for n in lengths]

        out: dict[str, torch.Tensor] = {
            "input_ids": pad(input_ids, self.pad_token_id, "right", self.pad_to_multiple_of),
            "labels": pad(labels, IGNORE_INDEX, "right", self.pad_to_multiple_of),
        }
        position_ids = pad(positions, 0, "right", self.pad_to_multiple_of)
        # padding gets a segment of its own so that it never attends to (or is attended by) real tokens
        segment_ids = pad(segments, -1, "right", self.pad_to_multiple_of)
        several_per_row = self.padding_free or packed
        if several_per_row and self.block_diagonal_mask:
            out["attention_mask"] = block_diagonal_causal_mask(segment_ids, self.mask_dtype)
        elif not self.padding_free:
            out["attention_mask"] = (segment_ids >= 0).long()
        if self.return_position_ids or several_per_row:
            out["position_ids"] = position_ids
        return out


def _cat_truncate(parts: Sequence[Any], max_length: int | None, mode: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate prompt and completion ids, truncate, and return (ids, completion_mask)."""
    prompt, completion = list(parts[0]), list(parts[1])
    ids = prompt + completion
    mask = [0] * len(prompt) + [1] * len(completion)
    ids = truncate_sequence(ids, max_length, mode)
    mask = truncate_sequence(mask, max_length, mode)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def _to_list(values: Any) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


@dataclass
class _PairedPadding:
    pad_token_id: int
    pad_to_multiple_of: int | None = None
    max_length: int | None = None
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"

    def _pad_sequences(self, seqs: list[torch.Tensor], masks: list[torch.Tensor] | None = None) -> dict:
        out = {
            "input_ids": pad(seqs, self.pad_token_id, "right", self.pad_to_multiple_of),
            "attention_mask": pad([torch.ones_like(s) for s in seqs], 0, "right", self.pad_to_multiple_of),
        }
        if masks is not None:
            out["completion_mask"] = pad(masks, 0, "right", self.pad_to_multiple_of)
        return out


@dataclass
class DataCollatorForPreference(_PairedPadding):
    """DPO collator: ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` → one right-padded ``(2B, L)`` batch.

    Rows ``0..B-1`` are prompt+chosen, rows ``B..2B-1`` prompt+rejected (same order). ``completion_mask`` is 1 on
    completion tokens. ``ref_chosen_logps``/``ref_rejected_logps`` (precomputed reference log-probs) are passed
    through as ``(B,)`` float tensors.

    Args:
        pad_token_id: Padding id for ``input_ids``.
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        max_length: Truncate each prompt+completion sequence to this many tokens (``None`` = no truncation).
        truncation_mode: ``"keep_start"`` or ``"keep_end"``.

    Returns:
        ``input_ids``, ``attention_mask``, ``completion_mask`` ``(2B, L)`` [+ ``ref_chosen_logps``,
        ``ref_rejected_logps`` ``(B,)``].
    """

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        seqs, masks = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for ex in examples:
                ids, mask = _cat_truncate(
                    (_to_list(ex.get("prompt_ids", [])), _to_list(ex[key])), self.max_length, self.truncation_mode
                )
                seqs.append(ids)
                masks.append(mask)
        out = self._pad_sequences(seqs, masks)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in examples[0]:
                out[key] = torch.tensor([float(ex[key]) for ex in examples])
        return out


@dataclass
class DataCollatorForUnpairedPreference(_PairedPadding):
    """KTO collator: ``prompt_ids``, ``completion_ids``, ``label`` [+ ``KL_completion_ids``] → padded batch.

    Returns:
        ``input_ids``, ``attention_mask``, ``completion_mask`` ``(B, L)``, ``labels`` ``(B,)`` bool (True =
        desirable); with ``KL_completion_ids``: ``KL_input_ids``, ``KL_attention_mask``, ``KL_completion_mask``
        (prompt + the mismatched completion used for the KL estimate); ``ref_logps``/``ref_KL_logps`` passed through.
    """

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        def build(key: str) -> dict[str, torch.Tensor]:
            pairs = [
                _cat_truncate((_to_list(ex["prompt_ids"]), _to_list(ex[key])), self.max_length, self.truncation_mode)
                for ex in examples
            ]
            return self._pad_sequences([p[0] for p in pairs], [p[1] for p in pairs])

        out = build("completion_ids")
        out["labels"] = torch.tensor([bool(ex["label"]) for ex in examples], dtype=torch.bool)
        if "KL_completion_ids" in examples[0]:
            out.update({f"KL_{k}": v for k, v in build("KL_completion_ids").items()})
        for key in ("ref_logps", "ref_KL_logps"):
            if key in examples[0]:
                out[key] = torch.tensor([float(ex[key]) for ex in examples])
        return out


@dataclass
class DataCollatorForRewardPreference(_PairedPadding):
    """Reward-model collator: ``chosen_ids``, ``rejected_ids`` [, ``margin``] → ``(2B, L)`` batch.

    Rows ``0..B-1`` are the chosen sequences, ``B..2B-1`` the rejected ones (right padding; the reward is read at
    the last non-pad token).

    Returns:
        ``input_ids``, ``attention_mask`` ``(2B, L)`` [+ ``margin`` ``(B,)`` float].
    """

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [
            torch.tensor(truncate_sequence(_to_list(ex[key]), self.max_length, self.truncation_mode), dtype=torch.long)
            for key in ("chosen_ids", "rejected_ids")
            for ex in examples
        ]
        out = self._pad_sequences(seqs)
        if "margin" in examples[0]:
            out["margin"] = torch.tensor([float(ex["margin"]) for ex in examples], dtype=torch.float)
        return out
