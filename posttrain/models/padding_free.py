"""Padding-free forwards of right-padded batches: the real tokens of every row in one row, attention kept per row.

A right-padded ``(B, T)`` batch of rows of very different lengths spends most of a CPU forward on padding: every
projection and MLP runs over ``B × T`` positions, and sdpa computes ``T²`` scores per row whatever the padding mask
says. :func:`padding_free_layout` lays the batch's real tokens out as one ``(1, N)`` row (``N = Σ n_i``), with
``position_ids`` restarting at every original row and a block-diagonal causal
:class:`~posttrain.models.tree_attention.TreeAttentionMask` whose sdpa calls run as block attention over each row's
own tokens (queries in runs, each seeing only the keys up to its own end). Projections then run over ``N`` tokens
and attention over about ``Σ n_i² / 2`` scores.

Every token sees exactly the keys it sees in the padded forward (its own row's earlier tokens) at the same positions,
so per-token log-probs, losses and gradients equal the padded forward's up to float summation order.
:meth:`PaddingFreeLayout.to_rows` puts per-token results back into the ``(B, T)`` layout (differentiably).

It applies only where that equality is known to hold and the work is clearly smaller (see
:func:`padding_free_layout`): CPU tensors (measured there; accelerators keep the padded call), sdpa attention (other implementations would run the ``N × N`` mask densely), right
padding, no MoE router loss (computed over the whole call), and a flat row short enough for its dense ``N × N``
boolean mask (:data:`MAX_FLAT_TOKENS`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.core.block_attention import BlockIndex, bucket_blocks
from posttrain.models.tree_attention import TreeAttentionMask
from posttrain.models.unwrap import unwrap_base_model

__all__ = ["MAX_FLAT_TOKENS", "PaddingFreeLayout", "padding_free_layout", "padding_free_cost"]

# The flat row's dense (1, 1, N, N) bool mask is N² bytes: 8192 tokens = 64 MiB. Longer batches stay padded.
MAX_FLAT_TOKENS = 8192
# Padding-free is used when its estimated cost is below this fraction of the padded forward's (the gathers and
# scatters of block attention are not free; below ~10 % of savings the padded call is kept).
MAX_COST_RATIO = 0.9
# Query-run lengths tried for each row's causal block (sdpa's CPU kernel tiles queries by 32 below 192 rows).
QUERY_CHUNKS = (32, 64, 128, 256)
# Block attention copies each run's keys and values (and their gradients): a gathered key row is counted as this
# many attention scores in the cost.
GATHER_COST = 6


@dataclass
class PaddingFreeLayout:
    """One flat row holding the real tokens of a right-padded ``(B, T)`` batch.

    Attributes:
        rows: ``(B, T)`` bool, the real tokens.
        index: ``(B, T)`` long, where each real token is computed in the flat row (0 at padding). Rows that share
            a prompt with an earlier row (``share_prompts``) point at that row's prompt tokens.
        input_ids: ``(1, N)`` long.
        position_ids: ``(1, N)`` long, each flat token's position in its padded row.
        attention_mask: ``(1, 1, N, N)`` :class:`TreeAttentionMask`, causal within each segment, plus a sharing
            segment's view of its source's prompt tokens.
        first: ``(1, N)`` bool, True at each segment's first token (no predictor before it in the flat row).
        shared: whether some row's tokens point at another row's.
    """

    rows: torch.Tensor
    index: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    first: torch.Tensor
    shared: bool = False

    def flatten(self, values: torch.Tensor) -> torch.Tensor:
        """``(B, T, ...)`` → ``(1, N, ...)``: the values at the real tokens (only without shared prompts, where each
        flat token is one row's)."""
        if self.shared:
            raise ValueError("flatten() is one-to-one only without shared prompts; use scored().")
        return values[self.rows].unsqueeze(0)

    def scored(self, mask: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` bool → ``(1, N)`` bool: flat tokens some row scores, never a segment's first token."""
        out = torch.zeros(self.input_ids.shape[1], dtype=torch.bool, device=mask.device)
        keep = mask.bool() & self.rows
        out[self.index[keep]] = True
        return out.unsqueeze(0) & ~self.first

    def to_rows(self, values: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """``(1, N, ...)`` → ``(B, T, ...)``, ``fill`` at padding. Differentiable in ``values``."""
        gathered = values[0][self.index]  # (B, T, ...)
        keep = self.rows.view(*self.rows.shape, *([1] * (values.dim() - 2)))
        return torch.where(keep, gathered, torch.full((), fill, dtype=values.dtype, device=values.device))


def _attention_window(config: Any) -> int | None:
    """How far back a token may attend when the model restricts it, None when every layer is full causal attention;
    0 for restrictions the flat row cannot express (e.g. chunked attention).

    A 4-D mask given to the model replaces the sliding-window masks transformers would build from a 2-D one, so
    the flat row equals the padded forward only when no row is longer than the window.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is not None:
        if any(t not in ("full_attention", "sliding_attention") for t in types):
            return 0
        if all(t == "full_attention" for t in types):
            return None
    elif window is None or getattr(text, "use_sliding_window", True) is False:
        return None
    return int(window) if window else 0


def _hidden_size(model: torch.nn.Module) -> int | None:
    config = getattr(unwrap_base_model(model), "config", None)
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text_config, "hidden_size", 0) or 0) or None


@dataclass
class _Segment:
    row: int
    skip: int  # tokens of the row before the segment (its source row's, shared)
    length: int  # tokens of the segment
    source: int  # the row whose first `skip` tokens it sees (-1: none)


def _segments(ids: list[list[int]], lengths: list[int], prompt_lengths: list[int] | None) -> list[_Segment]:
    """One segment per row; a row whose prompt (the tokens before its first scored one, at least 2) equals an
    earlier row's starts at its prompt's last token (a copy: the predictor of its first scored token) and sees the
    earlier row's other prompt tokens."""
    segments, sources = [], {}
    for row, n in enumerate(lengths):
        q = 0 if prompt_lengths is None else prompt_lengths[row]
        key = tuple(ids[row][:q]) if q >= 2 else None
        if key is not None and key in sources:
            segments.append(_Segment(row, q - 1, n - (q - 1), sources[key]))
            continue
        if key is not None:
            sources[key] = row
        segments.append(_Segment(row, 0, n, -1))
    return segments


def _blocks(segments: list[_Segment], starts: list[int], chunk: int) -> list[tuple[int, list[int], list[int]]]:
    """Block-attention blocks of the flat row: per segment, runs of ``chunk`` queries, each seeing its source's
    shared tokens and its segment's tokens up to the run's end. ``(pack 0, query positions, key positions)``."""
    row_start = {seg.row: start for seg, start in zip(segments, starts) if seg.source < 0}
    blocks = []
    for seg, start in zip(segments, starts):
        ancestors = [] if seg.source < 0 else list(range(row_start[seg.source], row_start[seg.source] + seg.skip))
        for first in range(start, start + seg.length, chunk):
            last = min(first + chunk, start + seg.length)
            blocks.append((0, list(range(first, last)), [*ancestors, *range(start, last)]))
    return blocks


def _flat_cost(segments: list[_Segment], hidden_size: int) -> tuple[float, int]:
    """(cost, best query chunk) of the flat forward: ``12·d`` per token, 2 per attention score of its block
    attention (padded to the buckets) and :data:`GATHER_COST` per gathered key."""
    longest = max(seg.length for seg in segments)
    best_cost, best_chunk = None, longest
    for chunk in sorted({c for c in QUERY_CHUNKS if c < longest} | {longest}):
        shapes = []
        for seg in segments:
            for first in range(0, seg.length, chunk):
                run = min(chunk, seg.length - first)
                shapes.append((run, seg.skip + first + run))
        _, area = bucket_blocks(shapes)
        cost = 2 * area + GATHER_COST * sum(k for _, k in shapes)
        if best_cost is None or cost < best_cost:
            best_cost, best_chunk = cost, chunk
    tokens = sum(seg.length for seg in segments)
    return float(tokens * 12 * hidden_size + best_cost), best_chunk


def padding_free_cost(lengths: list[int], width: int, hidden_size: int) -> tuple[float, float, int]:
    """(padded cost, padding-free cost, best query chunk) of a forward over rows of ``lengths`` padded to
    ``width`` (no shared prompts), in the units of :func:`posttrain.models.forward.plan_length_buckets`: ``12·d``
    per token for the projections and MLP, 2 per attention score (the padded call computes ``width²`` per row)."""
    padded = len(lengths) * width * (12 * hidden_size + 2 * width)
    flat, chunk = _flat_cost(_segments([[] for _ in lengths], lengths, None), hidden_size)
    return float(padded), flat, chunk


def padding_free_layout(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    *,
    share_prompts: torch.Tensor | None = None,
) -> PaddingFreeLayout | None:
    """The flat layout of a right-padded batch, or None where the padded forward is kept.

    Args:
        model: the causal LM about to run (its config decides: sdpa attention, no MoE router loss).
        input_ids: ``(B, T)``.
        attention_mask: ``(B, T)`` padding mask, 1 on a prefix of every row (right padding).
        position_ids: optional ``(B, T)`` positions; default ``0 … n_i - 1`` per row.
        share_prompts: optional ``(B, T)`` bool, the scored tokens (e.g. a completion mask). A row whose tokens
            before its first scored one equal an earlier row's (DPO's chosen and rejected rows: one prompt) then
            computes them once: its segment starts with a copy of the prompt's last token, at that token's
            position, which sees the earlier row's other prompt tokens, so every scored token sees the very same
            keys and positions as in its padded row. Ignored with ``position_ids``.

    None when: a row is longer than the model's sliding attention window (or the model restricts attention in
    another way), the mask is not 2-D, fewer than two rows, left padding or gaps, an empty row, tensors off the CPU
    (the cost model is the CPU kernels'; accelerators keep the padded call until measured), attention other than
    sdpa, ``output_router_logits`` (the MoE load-balancing loss is a statistic of the whole call), more than
    :data:`MAX_FLAT_TOKENS` flat tokens, or an estimated saving below ``1 − MAX_COST_RATIO``.
    """
    if attention_mask is None or attention_mask.dim() != 2 or input_ids.dim() != 2 or input_ids.shape[0] < 2:
        return None
    if attention_mask.shape != input_ids.shape or isinstance(attention_mask, TreeAttentionMask):
        return None
    if input_ids.device.type != "cpu":  # the cost model is the CPU kernels'; not yet measured on an accelerator
        return None
    config = getattr(unwrap_base_model(model), "config", None)
    if config is None or str(getattr(config, "_attn_implementation", None) or "") != "sdpa":
        return None
    if getattr(config, "output_router_logits", False):
        return None
    window = _attention_window(config)
    if window is not None and (window <= 0 or input_ids.shape[1] > window):
        return None
    hidden_size = _hidden_size(model)
    if hidden_size is None:
        return None
    key = _cache_key(hidden_size, input_ids, attention_mask, position_ids, share_prompts)
    cached = _LAST[0]
    if key is not None and cached is not None and cached[0] == key[0] and all(
        ref() is tensor for ref, tensor in zip(cached[1], key[1])
    ):
        return cached[2]
    rows = attention_mask.bool()
    lengths_t = rows.sum(dim=1)
    batch, width = input_ids.shape
    prefix = torch.arange(width, device=rows.device).unsqueeze(0) < lengths_t.unsqueeze(1)
    if not torch.equal(prefix, rows):  # left padding, or holes: keep the padded call
        return None
    lengths = [int(n) for n in lengths_t.tolist()]
    if min(lengths) < 1:
        return None
    ids_host, prompt_lengths = None, None
    if share_prompts is not None and position_ids is None:
        scored = share_prompts.bool() & rows
        has = scored.any(dim=1)
        firsts = torch.where(has, scored.int().argmax(dim=1), torch.zeros_like(lengths_t))
        prompt_lengths = [int(q) for q in firsts.tolist()]
        ids_host = input_ids.tolist()
    segments = _segments(ids_host or [[] for _ in lengths], lengths, prompt_lengths)
    total = sum(seg.length for seg in segments)
    if total > MAX_FLAT_TOKENS:
        return None
    flat_cost, chunk = _flat_cost(segments, hidden_size)
    if flat_cost > MAX_COST_RATIO * batch * width * (12 * hidden_size + 2 * width):
        return None
    layout = _materialize(input_ids, rows, position_ids, segments, chunk)
    _LAST[0] = None if key is None else (key[0], tuple(weakref.ref(t) for t in key[1]), layout)
    return layout


# The last layout built, for the very same (unmodified) tensors: DPO/KTO score one batch with the reference model
# and then the policy. ``((versions...), (weak refs...), layout)``; a tensor's ``_version`` changes on every in-place
# write, and the weak references must still point at the same objects.
_LAST: list[Any] = [None]


def _cache_key(
    hidden_size: int, *tensors: torch.Tensor | None
) -> tuple[tuple[Any, ...], tuple[torch.Tensor, ...]] | None:
    """(hidden size, each tensor's version and shape; the tensors), or None for tensors without a version counter
    (made under ``torch.inference_mode``): those are never cached."""
    try:
        versions = tuple(None if t is None else (t._version, tuple(t.shape)) for t in tensors)
    except RuntimeError:
        return None
    return (hidden_size, *versions), tuple(t for t in tensors if t is not None)


def _materialize(
    input_ids: torch.Tensor,
    rows: torch.Tensor,
    position_ids: torch.Tensor | None,
    segments: list[_Segment],
    chunk: int,
) -> PaddingFreeLayout:
    device = input_ids.device
    batch, width = input_ids.shape
    starts, offset = [], 0
    for seg in segments:
        starts.append(offset)
        offset += seg.length
    total = offset
    # (B, T) flat index of every real token: a segment's own tokens, its shared prefix at its source's
    index = torch.zeros((batch, width), dtype=torch.long)
    row_start = {}
    for seg, start in zip(segments, starts):
        if seg.source < 0:
            row_start[seg.row] = start
        index[seg.row, seg.skip : seg.skip + seg.length] = torch.arange(start, start + seg.length)
        if seg.source >= 0:
            index[seg.row, : seg.skip] = torch.arange(row_start[seg.source], row_start[seg.source] + seg.skip)
    index = index.to(device)
    own = torch.zeros((batch, width), dtype=torch.bool)
    for seg in segments:
        own[seg.row, seg.skip : seg.skip + seg.length] = True
    own = own.to(device) & rows
    flat_ids = torch.empty(total, dtype=torch.long, device=device)
    flat_ids[index[own]] = input_ids[own]
    if position_ids is None:
        positions = torch.arange(width, device=device).expand(batch, width)
    else:
        positions = position_ids
    flat_pos = torch.empty(total, dtype=torch.long, device=device)
    flat_pos[index[own]] = positions[own].to(torch.long)
    first = torch.zeros(total, dtype=torch.bool, device=device)
    first[torch.tensor(starts, device=device)] = True
    dense = _dense_mask(segments, starts, row_start, total, device).view(1, 1, total, total)
    blocks = _blocks(segments, starts, chunk)
    buckets, _ = bucket_blocks([(len(q), len(k)) for _, q, k in blocks])
    index_buckets = tuple(BlockIndex.from_mask(dense, [blocks[i] for i in bucket]) for bucket in buckets)
    return PaddingFreeLayout(
        rows=rows,
        index=index,
        input_ids=flat_ids.unsqueeze(0),
        position_ids=flat_pos.unsqueeze(0),
        attention_mask=TreeAttentionMask.wrap(dense, index_buckets),
        first=first.unsqueeze(0),
        shared=any(seg.source >= 0 for seg in segments),
    )


def _dense_mask(
    segments: list[_Segment], starts: list[int], row_start: dict[int, int], total: int, device: torch.device
) -> torch.Tensor:
    """The flat row's ``(N, N)`` bool mask: causal inside each segment, plus each sharing segment's view of its
    source's first ``skip`` tokens.

    Written block by block (a causal triangle per segment, a full rectangle per shared prefix) into a zero mask,
    so the work is the allowed pairs (about ``Σ n_i² / 2``), not ``N²`` comparisons per condition.
    """
    dense = torch.zeros((total, total), dtype=torch.bool, device=device)
    longest = max(seg.length for seg in segments)
    causal = torch.ones((longest, longest), dtype=torch.bool, device=device).tril_()
    for seg, start in zip(segments, starts):
        end = start + seg.length
        dense[start:end, start:end] = causal[: seg.length, : seg.length]
        if seg.source >= 0:
            lo = row_start[seg.source]
            dense[start:end, lo : lo + seg.skip] = True
    return dense
