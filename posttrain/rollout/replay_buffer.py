"""A replay buffer of high-reward-variance groups, and the rollout step that swaps zero-variance groups for them.

Used by ``experimental.grpo_with_replay_buffer`` (TRL's ``GRPOWithReplayBufferTrainer``): after each generation
round, every local group whose rewards vary (group std > 0) is stored with score Σ_i |A_i| · std (a min-heap of at
most ``max_size`` groups keeps the highest scores), and every group whose rewards are all equal (zero advantages, so
no gradient) is replaced by a group drawn from the buffer with probability proportional to its score (with
replacement only when more groups are needed than the buffer holds). A replaced group keeps its stored advantages
and log-probs (π_old, π_ref of when it was generated), so the loss treats it as off-policy data.

Deliberate differences from TRL: prompts are trimmed to the group's longest prompt from the *left* (they are
left-padded), equal scores do not compare the stored dictionaries (a counter breaks ties), sampling uses a seeded
generator, and an empty buffer leaves the batch unchanged.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import torch

from posttrain.rollout.buffer import COMPLETION_KEYS, PROMPT_KEYS, RolloutBatch, batch_size_of

__all__ = ["ReplayBuffer", "replace_zero_std_groups", "slice_group"]


class ReplayBuffer:
    """The ``max_size`` highest-scoring groups seen so far; :meth:`sample` draws them proportionally to score."""

    def __init__(self, max_size: int, seed: int = 0):
        self.max_size = int(max_size)
        self.heap: list[tuple[float, int, RolloutBatch]] = []  # min-heap of (score, insertion order, group)
        self._counter = itertools.count()
        self.generator = torch.Generator().manual_seed(int(seed))

    def __len__(self) -> int:
        return len(self.heap)

    def add(self, scores: list[float], groups: list[RolloutBatch]) -> None:
        for score, group in zip(scores, groups, strict=True):
            item = (float(score), next(self._counter), group)
            if len(self.heap) < self.max_size:
                heapq.heappush(self.heap, item)
            elif item[0] > self.heap[0][0]:
                heapq.heapreplace(self.heap, item)

    def sample(self, num_samples: int) -> list[RolloutBatch]:
        """``num_samples`` groups, P(group) ∝ score (uniform if every score is 0); [] when the buffer is empty."""
        if not self.heap or num_samples <= 0:
            return []
        scores = torch.tensor([item[0] for item in self.heap], dtype=torch.float64).clamp(min=0.0)
        probabilities = scores / scores.sum() if scores.sum() > 0 else torch.full_like(scores, 1.0 / len(scores))
        replacement = num_samples > len(self.heap) or int((probabilities > 0).sum()) < num_samples
        index = torch.multinomial(probabilities, num_samples, replacement=replacement, generator=self.generator)
        return [self.heap[i][2] for i in index.tolist()]


def _row_keys(batch: RolloutBatch) -> list[str]:
    n = batch_size_of(batch)
    return [
        k for k, v in batch.items()
        if (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n) or (isinstance(v, list) and len(v) == n)
    ]  # fmt: skip


def _is_token_aligned(key: str, value: Any, width: int) -> bool:
    return key in COMPLETION_KEYS and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width


def slice_group(batch: RolloutBatch, group: int, num_generations: int) -> RolloutBatch:
    """Rows ``group·G … (group+1)·G − 1`` of every row-aligned value, padding columns trimmed (prompts from the left,
    completion-aligned tensors from the right), cloned onto the CPU."""
    rows = slice(group * num_generations, (group + 1) * num_generations)
    prompt_len = int(batch["prompt_mask"][rows].sum(dim=1).max())
    completion_width = batch["completion_ids"].shape[1]
    completion_len = max(int(batch["completion_lengths"][rows].max()), 1)
    out: RolloutBatch = {}
    for key in _row_keys(batch):
        value = batch[key][rows]
        if isinstance(value, torch.Tensor):
            if key in PROMPT_KEYS:
                value = value[:, value.shape[1] - prompt_len :]
            elif _is_token_aligned(key, value, completion_width):
                value = value[:, :completion_len]
            value = value.detach().cpu().clone()
        out[key] = value
    return out


# padding of the sampling mask (keep_sampling_mask): no ids, threshold −inf — the unknown support (full softmax)
_SAMPLING_MASK_FILL = {"sampling_mask_ids": -1, "sampling_mask_threshold": float("-inf")}


def _pad_to(value: torch.Tensor, width: int, fill: float, left: bool) -> torch.Tensor:
    missing = width - value.shape[1]
    if missing <= 0:
        return value
    pad = torch.full((value.shape[0], missing, *value.shape[2:]), fill, dtype=value.dtype, device=value.device)
    return torch.cat([pad, value] if left else [value, pad], dim=1)


def replace_zero_std_groups(
    batch: RolloutBatch,
    group_std: torch.Tensor,
    buffer: ReplayBuffer,
    *,
    num_generations: int,
    pad_token_id: int,
) -> tuple[RolloutBatch, int]:
    """Store this batch's varying groups in ``buffer``, then replace its zero-std groups with buffered ones.

    Args:
        batch: This process's rollout batch (whole groups of ``num_generations`` consecutive rows, unshuffled).
        group_std: ``(num_groups,)`` reward std of each local group (TRL: the unbiased std of the group's rewards).
        buffer: The :class:`ReplayBuffer`.
        num_generations: G.
        pad_token_id: Fill for widened ``prompt_ids`` / ``completion_ids``.

    Returns:
        The batch (a new dict; widened when a stored group is longer) and the number of groups replaced.
    """
    advantages = batch["advantages"].reshape(-1, num_generations)  # (groups, G)
    varying = group_std > 0
    if varying.any():
        scores = (advantages.abs().sum(dim=1) * group_std)[varying]
        groups = [slice_group(batch, int(g), num_generations) for g in varying.nonzero().flatten().tolist()]
        buffer.add(scores.tolist(), groups)
    targets = (~varying).nonzero().flatten().tolist()
    samples = buffer.sample(len(targets))
    if not samples:
        return batch, 0
    out = dict(batch)
    width_p = max([out["prompt_ids"].shape[1], *(s["prompt_ids"].shape[1] for s in samples)])
    width_c = max([out["completion_ids"].shape[1], *(s["completion_ids"].shape[1] for s in samples)])
    completion_width = batch["completion_ids"].shape[1]
    for key in _row_keys(batch):
        value = out[key]
        if not isinstance(value, torch.Tensor):
            value = list(value)
            for group, sample in zip(targets, samples):
                value[group * num_generations : (group + 1) * num_generations] = sample[key]
            out[key] = value
            continue
        left = key in PROMPT_KEYS
        token_aligned = left or _is_token_aligned(key, value, completion_width)
        fill = pad_token_id if key in ("prompt_ids", "completion_ids") else _SAMPLING_MASK_FILL.get(key, 0)
        if token_aligned:
            value = _pad_to(value, width_p if left else width_c, fill, left)
        value = value.clone()
        for group, sample in zip(targets, samples):
            stored = sample[key].to(value.device, value.dtype)
            if token_aligned:
                stored = _pad_to(stored, value.shape[1], fill, left)
            value[group * num_generations : (group + 1) * num_generations] = stored
        out[key] = value
    return out, len(samples)
