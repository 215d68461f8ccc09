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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100

__all__ = ["SharedPromptLayout", "build_shared_prompt_layout"]


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

    def cost_ratio(self, hidden_size: int) -> float:
        """Estimated cost of the packed forward over the plain one: Σ tokens × (12·d + 2·span) per layer.

        ``12·d`` stands for a token's projections and MLP (per unit of ``d``), ``2·span`` for its attention scores
        and weighted sum over the keys it is computed against (the whole pack or plain row: dense kernels compute
        masked entries too).
        """
        packed = self.input_ids.shape[0] * self.input_ids.shape[1] * (12 * hidden_size + 2 * self.input_ids.shape[1])
        row = self.plain_tokens // max(self.batch_size, 1)
        plain = self.plain_tokens * (12 * hidden_size + 2 * row)
        return packed / max(plain, 1)

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
    batch, width = completion_ids.shape
    lengths = completion_lengths.tolist()
    prompt_rows = [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
    if any(len(p) == 0 for p in prompt_rows):
        return None
    completions = completion_ids.cpu().tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(prompt_rows):
        groups.setdefault(prompt, []).append(row)

    # Greedy packing of whole groups (a group's cost: its prompt once plus each completion with its predictor copy).
    packs: list[list[tuple[int, ...]]] = [[]]
    used = 0
    for prompt, rows in groups.items():
        cost = len(prompt) + sum(lengths[r] + 1 for r in rows)
        if packs[-1] and used + cost > max_pack_tokens:
            packs.append([])
            used = 0
        packs[-1].append(prompt)
        used += cost

    builders: list[_PackBuilder] = []
    where: list[tuple[int, int, int, int]] = []  # (pack, pack position, row, column) of each scored token
    for k, prompts in enumerate(packs):
        builder = _PackBuilder()
        shared = _common_prefix_length(prompts) if len(prompts) > 1 else len(prompts[0]) - 1
        # The last prompt token is copied into every completion segment, so the shared part never includes it.
        shared = min(shared, min(len(p) for p in prompts) - 1)
        root = builder.add_segment(list(prompts[0][:shared]), 0, -1) if shared > 0 else None
        root_seg = 0 if root is not None else -1
        for prompt in prompts:
            parent = root_seg
            middle = list(prompt[shared:-1])
            if middle:
                builder.add_segment(middle, shared, root_seg)
                parent = len(builder.parents) - 1
            last = prompt[-1]
            for row in groups[prompt]:
                n = lengths[row]
                tokens = completions[row][:n]
                offset = builder.add_segment([last, *tokens], len(prompt) - 1, parent, [IGNORE_INDEX, *tokens])
                where.extend((k, offset + 1 + j, row, j) for j in range(n))
        builders.append(builder)

    length = max(len(b.tokens) for b in builders)
    input_ids = torch.full((len(builders), length), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(builders), length), dtype=torch.long)
    labels = torch.full((len(builders), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(builders), 1, length, length), dtype=torch.bool)
    for k, b in enumerate(builders):
        n = len(b.tokens)
        input_ids[k, :n] = torch.tensor(b.tokens, dtype=torch.long)
        position_ids[k, :n] = torch.tensor(b.positions, dtype=torch.long)
        labels[k, :n] = torch.tensor(b.labels, dtype=torch.long)
        b.mask(length, out=attention_mask[k, 0])
    index = torch.tensor(where, dtype=torch.long).reshape(-1, 4)
    device = completion_ids.device
    return SharedPromptLayout(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=attention_mask.to(device),
        labels=labels.to(device),
        pack_index=index[:, 0].to(device),
        pack_pos=index[:, 1].to(device),
        row_index=index[:, 2].to(device),
        col_index=index[:, 3].to(device),
        num_tokens=sum(len(b.tokens) for b in builders),
        plain_tokens=batch * (prompt_ids.shape[1] + width),
        batch_size=batch,
    )
