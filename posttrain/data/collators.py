"""Data collators: lists of tokenized rows → padded tensors, for every trainer; and TRL's ``pad``.

- ``DataCollatorForLanguageModeling`` (SFT): right padding, labels with -100, optional padding-free batches.
- ``DataCollatorForPreference`` (DPO): prompt+chosen and prompt+rejected stacked into ``(2B, L)``.
- ``DataCollatorForUnpairedPreference`` (KTO): prompt+completion, ``label``, optional KL completions.
- ``DataCollatorForRewardPreference`` (reward modelling): full chosen and rejected sequences stacked into ``(2B, L)``.

The public collators' default output is TRL 1.16's, key for key and tensor for tensor (checked against TRL's own
output in ``tests/compat/test_trl_collator_fixture.py``); their fields are in TRL's order, posttrain's additions last.

Padding-free batches put all sequences of a batch into one row with ``position_ids`` restarting at every sequence
(and at every packed document, from ``seq_lengths``). Attention must still be kept inside each sequence. With
``transformers`` 5 the model derives that from the position ids only when it is given no ``attention_mask`` and
builds no KV cache (``use_cache=False``; FlashAttention always uses them); with ``use_cache=True`` (the config default)
sequences would attend to each other. So posttrain's SFT trainer sets ``block_diagonal_mask=True`` (except with
FlashAttention): the collator then emits an explicit 4-D block-diagonal causal ``attention_mask`` of shape
``(1, 1, L, L)`` (or ``(B, 1, L, L)`` for packed rows kept apart): boolean (True = attend) for ``sdpa``/``flex``
attention, or additive (0 / most negative value) when ``mask_dtype`` is a float dtype, which ``eager`` attention needs
(it *adds* the mask to the scores, so a boolean mask would be silently wrong there). The mask costs L² bytes per row.
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


def _check_return_tensors(collator: Any, return_tensors: str | None) -> None:
    kind = return_tensors if return_tensors is not None else collator.return_tensors
    if kind != "pt":
        raise ValueError(
            f"{type(collator).__name__} supports only return_tensors='pt' (PyTorch tensors), got {kind!r}."
        )


@dataclass
class DataCollatorForLanguageModeling:
    """Collator for (packed or not) language-modeling rows: ``input_ids`` [+ ``labels``] [+ ``seq_lengths``].

    With its default options the output is TRL 1.16's, key for key (see ``tests/compat/test_trl_collator_fixture.py``):

    - ``input_ids`` right-padded with ``pad_token_id``; ``labels`` (the row's ``labels``, else a copy of its
      ``input_ids``) right-padded with -100; both ``(B, L)`` int64, ``L`` rounded up to ``pad_to_multiple_of``.
    - padded mode: ``attention_mask`` ``(B, L)`` (1 on tokens, 0 on padding), and ``position_ids`` only when
      ``return_position_ids`` (restarting at every ``seq_lengths`` document of a packed row; padding 0).
    - ``padding_free``: the batch flattened into one row ``(1, L)``: ``position_ids`` restart at every sequence (every
      packed document), the label at every position 0 is -100 (no prediction across a boundary), no attention mask,
      plus the variable-length kernel inputs ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 boundaries),
      ``max_length_q``/``max_length_k`` (an int) and ``seq_idx`` ``(1, L)`` int32. As in TRL, with
      ``pad_to_multiple_of`` each padding position (position id 0) counts as a one-token sequence.

    posttrain's trainer adds options whose defaults leave the output as above:

    Args:
        pad_token_id: Id used to pad ``input_ids``.
        padding_free: Flatten the batch into one row (see above).
        return_position_ids: Also return ``position_ids`` for padded batches.
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        return_tensors: Only ``"pt"``.
        completion_only_loss: For rows without ``labels``, set -100 where the row's ``completion_mask`` is 0 (TRL's
            collator ignores ``completion_mask``; its trainer folds it into ``labels`` beforehand).
        assistant_only_loss: For rows without ``labels``, set -100 where the row's ``assistant_masks`` is 0.
        block_diagonal_mask: When sequences share a row (padding-free, or packed rows with ``seq_lengths``), return a
            4-D block-diagonal causal ``attention_mask`` ``(B, 1, L, L)`` and ``position_ids``, and set -100 on the
            first label of every sequence, so that attention stays inside each sequence for sdpa/eager/flex attention
            (see the module docstring); no variable-length kernel inputs are returned then.
        mask_dtype: dtype of the block-diagonal mask: ``torch.bool`` for sdpa/flex, the model's float dtype for eager.
        return_varlen_kwargs: Return ``cu_seq_lens_*``/``max_length_*``/``seq_idx`` with padding-free batches.
    """

    pad_token_id: int
    padding_free: bool = False
    return_position_ids: bool = False
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"
    completion_only_loss: bool = False
    assistant_only_loss: bool = False
    block_diagonal_mask: bool = False
    mask_dtype: torch.dtype = torch.bool
    return_varlen_kwargs: bool = True

    def __call__(self, examples: list[Mapping[str, Any]], return_tensors: str | None = None) -> dict[str, Any]:
        _check_return_tensors(self, return_tensors)
        if not examples:
            raise ValueError("Cannot collate an empty batch.")
        input_ids = [_as_long(ex["input_ids"]) for ex in examples]
        labels = []
        for ex, ids in zip(examples, input_ids):
            if ex.get("labels") is not None:
                labels.append(_as_long(ex["labels"]))
                continue
            lab = ids.clone()
            if self.completion_only_loss and ex.get("completion_mask") is not None:
                lab[_as_long(ex["completion_mask"]) == 0] = IGNORE_INDEX
            if self.assistant_only_loss and ex.get("assistant_masks") is not None:
                lab[_as_long(ex["assistant_masks"]) == 0] = IGNORE_INDEX
            labels.append(lab)
        # as in TRL, a batch is packed when its first row carries seq_lengths
        packed = "seq_lengths" in examples[0]
        lengths = [
            _seq_lengths(ex, len(ids), i) if packed else [len(ids)]
            for i, (ex, ids) in enumerate(zip(examples, input_ids))
        ]
        positions = [_positions(n) for n in lengths]
        several_per_row = self.padding_free or packed
        block_mask = self.block_diagonal_mask and several_per_row
        if block_mask and not self.padding_free:
            # a sequence's first token must not be predicted from the previous sequence's last token
            for lab, pos in zip(labels, positions):
                lab[pos == 0] = IGNORE_INDEX

        if self.padding_free:
            segments = [_segments([n for row in lengths for n in row])]
            input_ids, labels, positions = [torch.cat(input_ids)], [torch.cat(labels)], [torch.cat(positions)]
        else:
            segments = [_segments(n) for n in lengths]

        multiple = self.pad_to_multiple_of
        out: dict[str, Any] = {
            "input_ids": pad(input_ids, self.pad_token_id, "right", multiple),
            "labels": pad(labels, IGNORE_INDEX, "right", multiple),
        }
        position_ids = pad(positions, 0, "right", multiple)
        if self.padding_free:
            out["position_ids"] = position_ids
            out["labels"][position_ids == 0] = IGNORE_INDEX
            if block_mask:
                # padding gets a segment of its own so that it never attends to (or is attended by) real tokens
                out["attention_mask"] = block_diagonal_causal_mask(
                    pad(segments, -1, "right", multiple), self.mask_dtype
                )
            elif self.return_varlen_kwargs:
                out.update(_varlen_kwargs(position_ids))
            return out
        if block_mask:
            out["position_ids"] = position_ids
            out["attention_mask"] = block_diagonal_causal_mask(pad(segments, -1, "right", multiple), self.mask_dtype)
            return out
        if self.return_position_ids:
            out["position_ids"] = position_ids
        out["attention_mask"] = pad([torch.ones_like(ids) for ids in input_ids], 0, "right", multiple)
        return out

    @staticmethod
    def get_position_ids_from_packed_seq_lengths(batch_seq_lengths: list[list[int]]) -> list[torch.Tensor]:
        """Position ids of packed rows: for each row's document lengths, ``arange`` per document, concatenated.

        Args:
            batch_seq_lengths: One list of document lengths per packed row, e.g. ``[[2, 3], [4]]``.

        Returns:
            One int64 tensor per row, e.g. ``[tensor([0, 1, 0, 1, 2]), tensor([0, 1, 2, 3])]``.
        """
        return [_positions([int(n) for n in row]) for row in batch_seq_lengths]


def _varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """Sequence boundaries of a padding-free row ``(1, L)`` for variable-length attention kernels, as TRL builds them
    (every position id 0 starts a sequence; computed here on the CPU, sparing the model a device sync per layer)."""
    starts = (position_ids[0] == 0).nonzero().flatten()
    cu_seq_lens = torch.cat([starts, torch.tensor([position_ids.size(1)])]).to(torch.int32)
    lengths = cu_seq_lens.diff()
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
        "seq_idx": torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int32), lengths)[None],
    }


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
        return _pad_rows(seqs, masks, self.pad_token_id, self.pad_to_multiple_of)


def _pad_rows(
    seqs: list[torch.Tensor], masks: list[torch.Tensor] | None, pad_token_id: int, multiple: int | None
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` [and ``completion_mask``] of right-padded rows."""
    out = {
        "input_ids": pad(seqs, pad_token_id, "right", multiple),
        "attention_mask": pad([torch.ones_like(s) for s in seqs], 0, "right", multiple),
    }
    if masks is not None:
        out["completion_mask"] = pad(masks, 0, "right", multiple)
    return out


@dataclass
class DataCollatorForPreference:
    """DPO collator: ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` → one right-padded ``(2B, L)`` batch, as TRL's.

    Rows ``0..B-1`` are prompt+chosen, rows ``B..2B-1`` prompt+rejected (same order). ``completion_mask`` is 1 on
    completion tokens. ``ref_chosen_logps``/``ref_rejected_logps`` (precomputed reference log-probs) are passed
    through as ``(B,)`` tensors. Fields are in TRL's order, so positional construction means the same.

    Args:
        pad_token_id: Padding id for ``input_ids``.
        max_length: Truncate each prompt+completion sequence to this many tokens (``None`` = no truncation).
        truncation_mode: ``"keep_start"`` or ``"keep_end"``.
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        return_tensors: Only ``"pt"``.

    Returns:
        ``input_ids``, ``attention_mask``, ``completion_mask`` ``(2B, L)`` int64 [+ ``ref_chosen_logps``,
        ``ref_rejected_logps`` ``(B,)``].
    """

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __call__(
        self, examples: list[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, torch.Tensor]:
        _check_return_tensors(self, return_tensors)
        seqs, masks = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for ex in examples:
                ids, mask = _cat_truncate(
                    (_to_list(ex.get("prompt_ids", [])), _to_list(ex[key])), self.max_length, self.truncation_mode
                )
                seqs.append(ids)
                masks.append(mask)
        out = _pad_rows(seqs, masks, self.pad_token_id, self.pad_to_multiple_of)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in examples[0]:
                out[key] = torch.tensor([ex[key] for ex in examples])
        return out


@dataclass
class DataCollatorForUnpairedPreference:
    """KTO collator: ``prompt_ids``, ``completion_ids``, ``label`` [+ ``KL_completion_ids``] → padded batch, as TRL's.

    Fields are in TRL's order (``pad_token_id, max_length, pad_to_multiple_of, return_tensors``); ``truncation_mode``
    is posttrain's addition (TRL always keeps the start).

    Returns:
        ``input_ids``, ``attention_mask``, ``completion_mask`` ``(B, L)`` int64; with ``KL_completion_ids``:
        ``KL_input_ids``, ``KL_attention_mask``, ``KL_completion_mask`` (prompt + the mismatched completion used for
        the KL estimate); ``ref_logps``/``ref_KL_logps`` ``(B,)`` when the rows have them; ``label`` ``(B,)`` (the
        rows' values as a tensor: bool for True/False labels; True = desirable).
    """

    pad_token_id: int
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"

    def __call__(
        self, examples: list[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, torch.Tensor]:
        _check_return_tensors(self, return_tensors)
        out: dict[str, torch.Tensor] = {}
        for prefix, key in (("", "completion_ids"), ("KL_", "KL_completion_ids")):
            if key not in examples[0]:
                continue
            pairs = [
                _cat_truncate((_to_list(ex["prompt_ids"]), _to_list(ex[key])), self.max_length, self.truncation_mode)
                for ex in examples
            ]
            rows = _pad_rows([p[0] for p in pairs], [p[1] for p in pairs], self.pad_token_id, self.pad_to_multiple_of)
            out.update({f"{prefix}{k}": v for k, v in rows.items()})
        for key in ("ref_logps", "ref_KL_logps"):
            if key in examples[0]:
                out[key] = torch.tensor([ex[key] for ex in examples])
        out["label"] = torch.tensor([ex["label"] for ex in examples])
        return out


@dataclass
class DataCollatorForRewardPreference:
    """Reward-model collator (TRL's ``trl.trainer.reward_trainer.DataCollatorForPreference``): ``chosen_ids``,
    ``rejected_ids`` [, ``margin``] → ``(2B, L)`` batch.

    Rows ``0..B-1`` are the chosen sequences, ``B..2B-1`` the rejected ones (right padding; the reward is read at
    the last non-pad token). Fields are in TRL's order; ``max_length``/``truncation_mode`` are posttrain's additions
    (no truncation by default, as TRL).

    Returns:
        ``input_ids``, ``attention_mask`` ``(2B, L)`` int64 [+ ``margin`` ``(B,)`` float32].
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"
    max_length: int | None = None
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"

    def __call__(
        self, examples: list[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, torch.Tensor]:
        _check_return_tensors(self, return_tensors)
        seqs = [
            torch.tensor(truncate_sequence(_to_list(ex[key]), self.max_length, self.truncation_mode), dtype=torch.long)
            for key in ("chosen_ids", "rejected_ids")
            for ex in examples
        ]
        out = _pad_rows(seqs, None, self.pad_token_id, self.pad_to_multiple_of)
        if "margin" in examples[0]:
            out["margin"] = torch.tensor([float(ex["margin"]) for ex in examples], dtype=torch.float)
        return out
