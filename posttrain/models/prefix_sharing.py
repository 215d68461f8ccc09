"""Shared-prompt layout for the training forward (design §3.2): each prompt's tokens are encoded once per micro-batch.

GRPO/RLOO score G completions of the same prompt. The plain forward runs ``B = groups × G`` rows of
``[prompt | completion]``, so a long prompt is encoded G times (and a system prompt common to all groups
``B`` times). This module packs a micro-batch into a few sequences shaped as a tree instead::

    [ common prefix | prompt A rest | a1 | a2 | ... | prompt B rest | b1 | b2 | ... ]

with a boolean 4-D attention mask in which every token sees its ancestors' tokens and the earlier tokens of its own
segment, and ``position_ids`` that continue from the parent's end. Each completion segment starts with a copy of
its prompt's last token (at that token's position), so inside the pack the token before every completion token is
its predictor, exactly as in a plain row: the usual shifted next-token scoring applies unchanged, and each
completion token sees the very same keys, values and positions as in the plain forward. Loss and gradients are
therefore the plain forward's (up to float summation order), while the prompt tokens are processed once.

Works with attention implementations that take arbitrary 4-D masks (sdpa, eager); flash attention reads only
``position_ids`` and cannot express a tree, so callers keep the plain forward there.
With ``block_attention`` (sdpa) the mask is a :class:`~posttrain.models.tree_attention.TreeAttentionMask`, whose
attention calls compute each segment's queries against its ancestors' and its own keys only
(:meth:`SharedPromptPlan.attention_blocks`) rather than all ``L²`` scores of the pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from posttrain.core.block_attention import BlockIndex, bucket_blocks
from posttrain.models.tree_attention import TreeAttentionMask

IGNORE_INDEX = -100

__all__ = [
    "MicroBatchRows",
    "SharedPromptLayout",
    "SharedPromptPlan",
    "build_shared_prompt_layout",
    "plan_shared_prompt_layout",
]


@dataclass
class SharedPromptLayout:
    """Packed inputs for one micro-batch of ``B`` rows with completions of width ``C`` (see the module docstring).

    Attributes:
        input_ids: ``(K, L)`` long, ``K`` packs of length ``L`` (right-padded with the pad id).
        position_ids: ``(K, L)`` long, each token's position in its own plain row.
        attention_mask: ``(K, 1, L, L)`` bool, True where a query token (dim 2) may attend to a key token (dim 3).
        labels: ``(K, L)`` long, the completion tokens at their pack positions, ``-100`` elsewhere.
        pack_index, pack_pos: ``(N,)`` where each scored completion token sits in the packs ...
        row_index, col_index: ``(N,)`` ... and where it goes in the ``(B, C)`` output.
        num_tokens: real (non-padding) tokens in the packs.
        plain_tokens: tokens the plain padded forward would process (``B × (P + C)``).
        batch_size: ``B``.
        token_row: ``(K, L)`` long, a plain row each pack token belongs to (for a prompt segment shared by several
            rows, one of them; ``-1`` on padding): with ``position_ids`` it locates the token in the plain
            ``[prompt | completion]`` rows (routing replay reads each token's recorded MoE routing there).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    pack_index: torch.Tensor
    pack_pos: torch.Tensor
    row_index: torch.Tensor
    col_index: torch.Tensor
    num_tokens: int
    plain_tokens: int
    batch_size: int
    token_row: torch.Tensor | None = None

    def cost_ratio(self, hidden_size: int) -> float:
        """Estimated cost of the packed forward over the plain one: Σ tokens × (12·d + 2·span) per layer.

        ``12·d`` stands for a token's projections and MLP (per unit of ``d``), ``2·span`` for its attention scores
        and weighted sum over the keys it is computed against: the whole pack (dense kernels compute masked
        entries too) or, with a :class:`~posttrain.models.tree_attention.TreeAttentionMask`, its block's keys.
        """
        packs, length = self.input_ids.shape
        mask = self.attention_mask
        area = sum(b.area for b in mask.blocks) if isinstance(mask, TreeAttentionMask) else packs * length * length
        return _cost_ratio(packs * length, area, self.plain_tokens, self.batch_size, hidden_size)

    def predictor_index(self, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pack, position)`` of the hidden state predicting each token where ``loss_mask`` ``(B, C)`` is set, in
        row-major order of ``loss_mask`` (the order of ``completion_ids[loss_mask.bool()]``)."""
        keep = loss_mask.bool()[self.row_index, self.col_index]  # (N_all,)
        order = (self.row_index * loss_mask.shape[1] + self.col_index)[keep].argsort()
        return self.pack_index[keep][order], (self.pack_pos[keep] - 1)[order]

    def to_rows(self, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """Gather ``(K, L)`` per-pack values back to the ``(B, C)`` row layout (0 elsewhere); differentiable."""
        out = values.new_zeros(shape)
        out[self.row_index, self.col_index] = values[self.pack_index, self.pack_pos]
        return out


def _cost_ratio(tokens: int, area: int, plain_tokens: int, batch_size: int, hidden_size: int) -> float:
    """``tokens`` packed tokens with ``area`` attention scores against ``plain_tokens`` in ``batch_size`` rows
    (see ``cost_ratio``)."""
    packed = tokens * 12 * hidden_size + 2 * area
    row = plain_tokens // max(batch_size, 1)
    plain = plain_tokens * (12 * hidden_size + 2 * row)
    return packed / max(plain, 1)


# Block attention replaces the dense one when its (padded) score area is below this fraction of the packs' L².
BLOCK_ATTENTION_MAX_AREA = 0.5
# ... and when its gathered key/value copies are at most this many times the packs' own keys (a long prompt shared by
# many blocks is copied once per block: behind a 330-token system prompt with 16 completions, 14x, +70 MiB peak).
BLOCK_ATTENTION_MAX_GATHER = 4
# Query-run lengths tried for block attention besides the longest completion segment (sdpa's CPU kernel tiles
# queries by 32 below 192 rows).
BLOCK_QUERY_CHUNKS = (32, 64, 128)


def _common_prefix_length(sequences: list[tuple[int, ...]]) -> int:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        token = first[i]
        if any(s[i] != token for s in sequences[1:]):
            return i
    return n


class _PackBuilder:
    """Accumulates the segments of one pack: tokens, positions, labels and each token's segment id."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.labels: list[int] = []
        self.segment_of: list[int] = []
        self.parents: list[int] = []  # parent segment id of each segment (-1: root)
        self.spans: list[tuple[int, int]] = []  # [start, end) of each segment in the pack

    def add_segment(self, tokens: list[int], start_position: int, parent: int, labels: list[int] | None = None) -> int:
        seg = len(self.parents)
        self.parents.append(parent)
        offset = len(self.tokens)
        self.spans.append((offset, offset + len(tokens)))
        self.tokens.extend(tokens)
        self.positions.extend(range(start_position, start_position + len(tokens)))
        self.labels.extend(labels if labels is not None else [IGNORE_INDEX] * len(tokens))
        self.segment_of.extend([seg] * len(tokens))
        return offset

    def mask(self, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``(length, length)`` bool (written into ``out`` when given, which must be all False): token i attends to token j ≤ i when j's segment is i's segment or an ancestor.

        Built block by block: each segment's rows get its ancestors' column ranges (all earlier in the pack, so
        wholly visible) and a lower triangle over its own range; nothing of size ``length²`` besides the mask itself.
        Padding positions (beyond the real tokens) attend only to themselves, so no softmax row is empty.
        """
        allowed = torch.zeros(length, length, dtype=torch.bool) if out is None else out
        widest = max((end - start for start, end in self.spans), default=0)
        triangle = torch.ones(widest, widest, dtype=torch.bool).tril_()
        for seg, (start, end) in enumerate(self.spans):
            rows = allowed[start:end]
            ancestor = self.parents[seg]
            while ancestor >= 0:  # parents precede children: every ancestor's range lies before this segment
                a_start, a_end = self.spans[ancestor]
                rows[:, a_start:a_end] = True
                ancestor = self.parents[ancestor]
            rows[:, start:end] = triangle[: end - start, : end - start]
        pad = torch.arange(len(self.tokens), length)
        allowed[pad, pad] = True  # padding rows see themselves only
        return allowed


@dataclass
class _Segment:
    """One segment of a planned pack: ``tokens`` at positions from ``start_position``, under segment ``parent``;
    ``row`` is the completion row it scores (``None`` for prompt segments)."""

    tokens: list[int]
    start_position: int
    parent: int
    row: int | None = None


@dataclass
class SharedPromptPlan:
    """The packs of a shared-prompt layout as host lists, before any tensor is built (see
    :func:`plan_shared_prompt_layout`): cheap enough to plan several candidates and materialise only the cheapest."""

    packs: list[list[_Segment]]
    pack_lengths: list[int]
    plain_tokens: int
    batch_size: int
    num_groups: int

    @property
    def num_packs(self) -> int:
        return len(self.packs)

    @property
    def length(self) -> int:
        return max(self.pack_lengths)

    def cost_ratio(self, hidden_size: int, *, block_attention: bool = False) -> float:
        """:meth:`SharedPromptLayout.cost_ratio` of the layout :meth:`materialize` builds with ``block_attention``."""
        dense = self.num_packs * self.length * self.length
        area = self._block_area() if block_attention else None
        return _cost_ratio(
            self.num_packs * self.length,
            dense if area is None else area,
            self.plain_tokens,
            self.batch_size,
            hidden_size,
        )

    @cached_property
    def attention_blocks(self) -> tuple[list[list[tuple[int, list[int], list[int]]]], int]:
        """The blocks of block attention in buckets (one attention call each), and their padded cost (see
        :func:`~posttrain.core.block_attention.bucket_blocks`).

        A block is ``(pack, query positions, key positions)``: a run of one segment's tokens with its ancestors'
        tokens and its own up to the run's end as keys — every key the tree mask lets those queries see. Runs are
        at most ``chunk`` tokens, ``chunk`` the cheapest of :data:`BLOCK_QUERY_CHUNKS` and the longest completion
        segment (varied completion lengths pad less in short runs; equal ones fit one run each).
        """
        segments_of: list[tuple[int, int, int, list[int]]] = []  # (pack, start, end, ancestor key positions)
        for k, segments in enumerate(self.packs):
            spans, offset = [], 0
            for seg in segments:
                spans.append((offset, offset + len(seg.tokens)))
                offset += len(seg.tokens)
            for seg, (start, end) in zip(segments, spans):
                ancestors: list[int] = []
                parent = seg.parent
                while parent >= 0:  # parents precede children, so ancestors' keys come first, in pack order
                    ancestors = [*range(*spans[parent]), *ancestors]
                    parent = segments[parent].parent
                segments_of.append((k, start, end, ancestors))
        longest = max(len(seg.tokens) for segments in self.packs for seg in segments if seg.row is not None)
        best = None
        for chunk in sorted({c for c in BLOCK_QUERY_CHUNKS if c < longest} | {longest}):
            runs = [
                (s, first, min(first + chunk, end))
                for s, (_, start, end, _) in enumerate(segments_of)
                for first in range(start, end, chunk)
            ]
            shapes = [(last - first, len(segments_of[s][3]) + last - segments_of[s][1]) for s, first, last in runs]
            buckets, cost = bucket_blocks(shapes)
            if best is None or cost < best[0]:
                best = (cost, runs, buckets)
        cost, runs, buckets = best

        def block(i: int) -> tuple[int, list[int], list[int]]:
            s, first, last = runs[i]
            pack, start, _, ancestors = segments_of[s]
            return pack, list(range(first, last)), [*ancestors, *range(start, last)]

        return [[block(i) for i in bucket] for bucket in buckets], cost

    def _block_area(self) -> int | None:
        """Padded cost of :meth:`attention_blocks`, or None when it is not clearly below the dense ``L²`` or its
        gathered keys (each block's copy of its ancestors' keys and values, held for the backward) would exceed
        :data:`BLOCK_ATTENTION_MAX_GATHER` × the pack's own."""
        buckets, cost = self.attention_blocks
        dense = self.num_packs * self.length * self.length
        gathered = sum(len(bucket) * max(len(keys) for _, _, keys in bucket) for bucket in buckets)
        if gathered > BLOCK_ATTENTION_MAX_GATHER * self.num_packs * self.length:
            return None
        return cost if cost < BLOCK_ATTENTION_MAX_AREA * dense else None

    def materialize(
        self, *, pad_token_id: int = 0, device: torch.device | str = "cpu", block_attention: bool = False
    ) -> SharedPromptLayout:
        """The tensors: ``(K, L)`` ids, positions and labels, the ``(K, 1, L, L)`` tree mask, and the scatter index.

        ``block_attention`` (for sdpa models) makes the mask a
        :class:`~posttrain.models.tree_attention.TreeAttentionMask` when its blocks clearly beat the dense ``L²``.
        """
        length = self.length
        count = self.num_packs
        input_ids = torch.full((count, length), pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((count, length), dtype=torch.long)
        labels = torch.full((count, length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((count, 1, length, length), dtype=torch.bool)
        where: list[tuple[int, int, int, int]] = []  # (pack, pack position, row, column) of each scored token
        token_row = torch.full((count, length), -1, dtype=torch.long)
        for k, segments in enumerate(self.packs):
            # a row under each segment: its own for a completion, a descendant's for a prompt segment
            rows: list[int | None] = [seg.row for seg in segments]
            for i in range(len(segments) - 1, -1, -1):  # children come after their parents
                parent = segments[i].parent
                if rows[i] is not None and parent >= 0 and rows[parent] is None:
                    rows[parent] = rows[i]
            offset = 0
            for seg, row in zip(segments, rows):
                token_row[k, offset : offset + len(seg.tokens)] = -1 if row is None else row
                offset += len(seg.tokens)
            builder = _PackBuilder()
            for seg in segments:
                if seg.row is None:
                    builder.add_segment(seg.tokens, seg.start_position, seg.parent)
                    continue
                scored = seg.tokens[1:]  # the first token is the prompt's last one, the predictor copy
                offset = builder.add_segment(seg.tokens, seg.start_position, seg.parent, [IGNORE_INDEX, *scored])
                where.extend((k, offset + 1 + j, seg.row, j) for j in range(len(scored)))
            n = len(builder.tokens)
            input_ids[k, :n] = torch.tensor(builder.tokens, dtype=torch.long)
            position_ids[k, :n] = torch.tensor(builder.positions, dtype=torch.long)
            labels[k, :n] = torch.tensor(builder.labels, dtype=torch.long)
            builder.mask(length, out=attention_mask[k, 0])
        index = torch.tensor(where, dtype=torch.long).reshape(-1, 4)
        attention_mask = attention_mask.to(device)
        if block_attention and self._block_area() is not None:
            buckets, _ = self.attention_blocks
            blocks = tuple(BlockIndex.from_mask(attention_mask, bucket) for bucket in buckets)
            attention_mask = TreeAttentionMask.wrap(attention_mask, blocks)
        return SharedPromptLayout(
            input_ids=input_ids.to(device),
            position_ids=position_ids.to(device),
            attention_mask=attention_mask,
            labels=labels.to(device),
            pack_index=index[:, 0].to(device),
            pack_pos=index[:, 1].to(device),
            row_index=index[:, 2].to(device),
            col_index=index[:, 3].to(device),
            num_tokens=sum(self.pack_lengths),
            plain_tokens=self.plain_tokens,
            batch_size=self.batch_size,
            token_row=token_row.to(device),
        )


@dataclass
class MicroBatchRows:
    """A micro-batch's rows as host lists (one device-to-host copy), shared by every plan of it."""

    prompts: list[tuple[int, ...]]
    completions: list[list[int]]
    plain_tokens: int
    # What else besides the prompt tokens makes rows one group (a vision-language row's images: equal tokens,
    # other images, other prompt); None = the tokens alone.
    group_keys: list[Any] | None = None

    @classmethod
    def from_tensors(
        cls,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_lengths: torch.Tensor,
    ) -> MicroBatchRows:
        """``prompt_ids``/``prompt_mask`` ``(B, P)`` left-padded; ``completion_ids`` ``(B, C)``, the first
        ``completion_lengths[b]`` of row ``b`` real."""
        ids, mask = prompt_ids.cpu().tolist(), prompt_mask.cpu().tolist()
        prompts = [tuple(t for t, m in zip(row, keep) if m) for row, keep in zip(ids, mask)]
        lengths = completion_lengths.cpu().tolist()
        completions = [row[:n] for row, n in zip(completion_ids.cpu().tolist(), lengths)]
        batch, width = completion_ids.shape
        return cls(prompts, completions, batch * (prompt_ids.shape[1] + width))


def plan_shared_prompt_layout(rows: MicroBatchRows, *, max_pack_tokens: int = 4096) -> SharedPromptPlan | None:
    """Plan the packs of ``rows``: which groups share a pack, each pack's common prefix, and every segment.

    Rows with the same prompt form a group; whole groups are packed greedily (a group costs its prompt once plus
    each completion with its predictor copy) and a new pack starts when the next group would exceed
    ``max_pack_tokens`` (a single larger group gets a pack of its own). None when a row has an empty prompt.
    """
    if any(len(p) == 0 for p in rows.prompts):
        return None
    groups: dict[Any, list[int]] = {}
    for row, prompt in enumerate(rows.prompts):
        key = prompt if rows.group_keys is None else (prompt, rows.group_keys[row])
        groups.setdefault(key, []).append(row)

    grouped: list[list[Any]] = [[]]
    used = 0
    for key, members in groups.items():
        prompt = rows.prompts[members[0]]
        cost = len(prompt) + sum(len(rows.completions[r]) + 1 for r in members)
        if grouped[-1] and used + cost > max_pack_tokens:
            grouped.append([])
            used = 0
        grouped[-1].append(key)
        used += cost

    packs: list[list[_Segment]] = []
    for keys in grouped:
        prompts = [rows.prompts[groups[key][0]] for key in keys]
        segments: list[_Segment] = []
        shared = _common_prefix_length(prompts) if len(prompts) > 1 else len(prompts[0]) - 1
        # The last prompt token is copied into every completion segment, so the shared part never includes it.
        shared = min(shared, min(len(p) for p in prompts) - 1)
        root = -1
        if shared > 0:
            segments.append(_Segment(list(prompts[0][:shared]), 0, -1))
            root = 0
        for key, prompt in zip(keys, prompts):
            parent = root
            middle = list(prompt[shared:-1])
            if middle:
                segments.append(_Segment(middle, shared, root))
                parent = len(segments) - 1
            for row in groups[key]:
                segments.append(_Segment([prompt[-1], *rows.completions[row]], len(prompt) - 1, parent, row))
        packs.append(segments)
    lengths = [sum(len(seg.tokens) for seg in segments) for segments in packs]
    return SharedPromptPlan(packs, lengths, rows.plain_tokens, len(rows.prompts), len(groups))


def build_shared_prompt_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_lengths: torch.Tensor,
    *,
    pad_token_id: int = 0,
    max_pack_tokens: int = 4096,
) -> SharedPromptLayout | None:
    """Pack a micro-batch so that rows with the same prompt (and prompts with a common prefix) share those tokens.

    Args:
        prompt_ids: ``(B, P)`` left-padded prompt token ids; ``prompt_mask`` ``(B, P)`` marks the real ones.
        completion_ids: ``(B, C)`` completion token ids; the first ``completion_lengths[b]`` of row ``b`` are real
            (generated and tool-result tokens alike: all are context, and all are scored, as in the plain forward).
        pad_token_id: id written at padding positions of the packs.
        max_pack_tokens: a new pack starts when adding the next prompt's group would exceed this many tokens (the
            attention mask is ``L × L`` per pack). A single group larger than this gets a pack of its own.

    Returns:
        The layout, or None when a row has an empty prompt (nothing can predict its first completion token).
    """
    rows = MicroBatchRows.from_tensors(prompt_ids, prompt_mask, completion_ids, completion_lengths)
    plan = plan_shared_prompt_layout(rows, max_pack_tokens=max_pack_tokens)
    if plan is None:
        return None
    return plan.materialize(pad_token_id=pad_token_id, device=completion_ids.device)
