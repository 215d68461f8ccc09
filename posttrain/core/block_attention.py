"""Attention over packed sequences restricted to blocks of queries, each with its own list of keys.

A tree-packed micro-batch (a shared prompt, then each completion as a branch; :mod:`posttrain.models.prefix_sharing`)
lets a completion token attend only to its ancestors and to its own segment, yet a dense masked attention computes
every ``L × L`` score of the pack and throws most away (for 8 completions of 33 tokens behind a 25-token prompt, 87 %
of them). :func:`block_attention` computes the same softmax attention from blocks instead: each block is a run of
query positions of one pack and the key positions they may see (the ancestors' tokens and the segment's own
prefix), gathered into ``(blocks, Q, keys)`` tiles for one attention call and scattered back. Masked keys get no
weight in either form, so the two agree up to float summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["BlockIndex", "block_attention", "bucket_blocks"]


@dataclass
class BlockIndex:
    """Where each block's queries and keys sit in the packs, and which (query, key) pairs it allows.

    Attributes:
        pack: ``(nb, 1)`` long, the pack (batch row) of each block.
        query_pos: ``(nb, Q)`` long, the blocks' query positions (padded slots repeat a valid one).
        key_pos: ``(nb, K)`` long, the blocks' key positions (padded slots repeat a valid one).
        allowed: ``(nb, 1, Q, K)`` bool, True where the query slot attends to the key slot; every row has one True
            (padded query slots see one real key, so no softmax row is empty).
        valid_block, valid_slot: ``(n,)`` long, the (block, slot) of every real query ...
        out_pack, out_pos: ``(n,)`` long, ... and the pack position its output goes to.
    """

    pack: torch.Tensor
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    allowed: torch.Tensor
    valid_block: torch.Tensor
    valid_slot: torch.Tensor
    out_pack: torch.Tensor
    out_pos: torch.Tensor

    @classmethod
    def from_mask(cls, mask: torch.Tensor, blocks: list[tuple[int, list[int], list[int]]]) -> BlockIndex:
        """The index of ``blocks`` — per block ``(pack, query positions, key positions)``, host lists — with the
        allowed pairs read from the dense ``mask`` ``(N, 1, L, L)`` bool (True: the query attends to the key).

        A block's keys must include every key its queries attend to in ``mask`` for :func:`block_attention` to
        equal the dense attention; every query must attend to one of its block's keys.
        """
        if not blocks:
            raise ValueError("block_attention needs at least one block.")
        width_q = max(len(q) for _, q, _ in blocks)
        width_k = max(len(k) for _, _, k in blocks)
        for b, (_, queries, keys) in enumerate(blocks):
            if not queries or not keys:
                raise ValueError(f"block {b} has no queries or no keys.")
        # padded slots repeat the block's first position; one host-to-tensor conversion per index
        query_pos = torch.tensor([[*q, *[q[0]] * (width_q - len(q))] for _, q, _ in blocks], dtype=torch.long)
        key_pos = torch.tensor([[*k, *[k[0]] * (width_k - len(k))] for _, _, k in blocks], dtype=torch.long)
        real_q = torch.arange(width_q) < torch.tensor([len(q) for _, q, _ in blocks]).unsqueeze(1)  # (nb, Q)
        real_k = torch.arange(width_k) < torch.tensor([len(k) for _, _, k in blocks]).unsqueeze(1)  # (nb, K)
        device = mask.device
        pack = torch.tensor([p for p, _, _ in blocks], dtype=torch.long).unsqueeze(1)
        query_pos, key_pos, real_q, real_k, pack = (t.to(device) for t in (query_pos, key_pos, real_q, real_k, pack))
        # (nb, Q, K): the dense mask at each block's (query, key) pairs, padded key slots closed
        allowed = mask[pack.unsqueeze(2), 0, query_pos.unsqueeze(2), key_pos.unsqueeze(1)] & real_k.unsqueeze(1)
        if not bool(allowed[real_q].any(dim=-1).all()):
            raise ValueError("every query of a block must attend to one of the block's keys.")
        allowed[~real_q] = False
        allowed[..., 0] |= ~real_q  # padded query slots see one real key (no empty softmax row); output discarded
        valid_block, valid_slot = real_q.nonzero(as_tuple=True)
        return cls(
            pack=pack,
            query_pos=query_pos,
            key_pos=key_pos,
            allowed=allowed.unsqueeze(1),
            valid_block=valid_block,
            valid_slot=valid_slot,
            out_pack=pack[valid_block, 0],
            out_pos=query_pos[valid_block, valid_slot],
        )

    @property
    def area(self) -> int:
        """Scores computed per head: ``blocks × Q × K`` (padded slots included)."""
        return int(self.allowed.shape[0] * self.allowed.shape[2] * self.allowed.shape[3])


def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    blocks: BlockIndex | Sequence[BlockIndex],
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Softmax attention of ``query`` ``(N, H, L, D)`` over ``key``/``value`` ``(N, Hk, L, D)`` with each query
    seeing only its block's allowed keys; ``(N, H, L, D)``, zero at positions no block queries.

    ``blocks`` is one :class:`BlockIndex` or several (buckets of differently shaped blocks, one attention call each,
    so short blocks are not padded to the longest). Equals ``scaled_dot_product_attention(query, key, value,
    attn_mask=M)`` at every queried position, where ``M[n, 0, i, j]`` is True exactly for the (query ``i``, key
    ``j``) pairs of pack ``n`` that a block allows. Differentiable in ``query``, ``key`` and ``value``.
    """
    buckets = [blocks] if isinstance(blocks, BlockIndex) else list(blocks)
    length = query.shape[2]  # keys and values are the same packs' positions: (N, Hk, L, D)
    # token-major (N·L, H, D) copies: each gathered position is then one contiguous H x D run
    query_t, key_t, value_t = (
        x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], x.shape[3]) for x in (query, key, value)
    )
    values, packs, positions = [], [], []
    for bucket in buckets:
        q = _gather_positions(query_t, bucket.pack * length + bucket.query_pos).transpose(1, 2)  # (nb, H, Q, D)
        k = _gather_positions(key_t, bucket.pack * length + bucket.key_pos).transpose(1, 2)  # (nb, Hk, K, D)
        v = _gather_positions(value_t, bucket.pack * length + bucket.key_pos).transpose(1, 2)
        tiles = F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.allowed, scale=scale, enable_gqa=enable_gqa)
        tiles = tiles.transpose(1, 2).reshape(-1, *tiles.shape[1:2], tiles.shape[-1])  # (nb·Q, H, D)
        values.append(tiles.index_select(0, bucket.valid_block * q.shape[2] + bucket.valid_slot))  # (n, H, D)
        packs.append(bucket.out_pack)
        positions.append(bucket.out_pos)
    if len(buckets) > 1:
        values, packs, positions = [torch.cat(values)], [torch.cat(packs)], [torch.cat(positions)]
    batch, heads, length, dim = query.shape[0], query.shape[1], query.shape[2], value.shape[-1]
    out = values[0].new_zeros((batch, length, heads, dim))
    out = out.index_put((packs[0], positions[0]), values[0])
    return out.transpose(1, 2)  # (N, H, L, D), a view of the (N, L, H, D) buffer


def _gather_positions(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` ``(nb, S)`` of ``flat`` ``(N·L, H, D)`` as ``(nb, S, H, D)``.

    ``index_select``, not ``flat[index]`` (every gather here uses it): a key position is gathered by several blocks
    (a shared prompt's keys by every completion behind it), and the backward of advanced indexing on CPU adds those
    rows' gradients with parallel atomic adds, in an order that changes from run to run (more so when other work
    takes the cores), so a seeded GRPO run would not repeat bit for bit. ``index_select``'s backward
    (``index_add_``) adds them in index order on CPU, on any thread count.
    """
    return flat.index_select(0, index.reshape(-1)).view(*index.shape, *flat.shape[1:])


def bucket_blocks(
    shapes: Sequence[tuple[int, int]], *, max_buckets: int = 4, call_area: int = 4096
) -> tuple[list[list[int]], int]:
    """Group blocks of ``(queries, keys)`` sizes into at most ``max_buckets`` attention calls, each padded to its
    largest block: returns the buckets (block indices) and their cost, Σ padded scores + ``call_area`` per call.

    Blocks are ordered by key count and each bucket is a run of that order; starting from one bucket, the split
    that lowers the cost most is applied until none does (greedy, O(blocks) per split).
    """
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i][1], shapes[i][0]))

    def cost(lo: int, hi: int) -> int:  # blocks order[lo:hi] as one call
        widest_q = max(shapes[i][0] for i in order[lo:hi])
        return (hi - lo) * widest_q * shapes[order[hi - 1]][1] + call_area

    runs = [(0, len(order))]
    while len(runs) < max_buckets:
        best = None  # (saving, run index, split point)
        for r, (lo, hi) in enumerate(runs):
            whole = cost(lo, hi)
            prefix_q = []  # widest queries of order[lo:m] for every m
            widest = 0
            for m in range(lo, hi):
                widest = max(widest, shapes[order[m]][0])
                prefix_q.append(widest)
            suffix_widest = 0
            for m in range(hi - 1, lo, -1):  # split into order[lo:m] and order[m:hi]
                suffix_widest = max(suffix_widest, shapes[order[m]][0])
                left = (m - lo) * prefix_q[m - 1 - lo] * shapes[order[m - 1]][1] + call_area
                right = (hi - m) * suffix_widest * shapes[order[hi - 1]][1] + call_area
                saving = whole - left - right
                if saving > 0 and (best is None or saving > best[0]):
                    best = (saving, r, m)
        if best is None:
            break
        _, r, m = best
        lo, hi = runs[r]
        runs[r : r + 1] = [(lo, m), (m, hi)]
    return [order[lo:hi] for lo, hi in runs], sum(cost(lo, hi) for lo, hi in runs)
