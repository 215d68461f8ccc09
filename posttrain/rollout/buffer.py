"""The generation buffer: one generated batch, shuffled and split into micro-batches, replayed over iterations.

A rollout batch is a ``dict`` whose tensor values share the batch dimension (``(N, ...)``), whose list values have
length ``N`` (e.g. decoded texts), and whose 0-d tensors / plain scalars apply to the whole batch (e.g.
``num_items_in_batch``). The trainer generates one batch every ``steps_per_generation × num_iterations``
micro-steps, shuffles it, splits it into ``steps_per_generation`` micro-batches and serves micro-batch
``step % steps_per_generation`` at each micro-step (TRL's scheme), so that every completion is seen once per
iteration. The trainers that shuffle (those whose TRL counterpart does: GRPO, RLOO, distillation) draw it from the
global torch RNG, as TRL's ``shuffle_sequence_dict`` does: which rows share a micro-batch then matches TRL's (it
enters the per-micro-batch means: ``kl``, ``clip_ratio/*``, bnpo's loss), and so does every later draw from that
RNG (``model.generate``'s sampling). A resumed run replays it from the RNG state every checkpoint holds
(``rng_state.pth``).

A short round (an epoch's last, with fewer rows than a full one: GKD keeps it, as TRL's plain Trainer dataloader
does) is split into micro-batches of ``micro_batch_size`` rows, the last one shorter, and served over that many
micro-steps only; the next round then starts at the next round boundary of the step counter.

Micro-batches are re-trimmed after the split: prompt columns that are padding in every row (left padding) and
completion columns past the longest completion of the micro-batch are dropped, so a micro-batch of short
completions does not pay for the generation batch's longest one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

RolloutBatch = dict[str, Any]

# Keys aligned with the prompt tokens (left-padded) and with the completion tokens (right-padded).
PROMPT_KEYS = ("prompt_ids", "prompt_mask", "prompt_routing")
COMPLETION_KEYS = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "sampling_log_kept_mass",
    "sampling_mask_ids",  # (B, C, K): the sampler's kept ids per token (keep_sampling_mask)
    "sampling_mask_threshold",
    "tool_mask",
    "importance_sampling_ratio",
    "completion_routing",  # keep_routing: (N, C, L, k)
)


def batch_size_of(batch: RolloutBatch) -> int:
    """Number of rows ``N`` (the leading dimension of ``completion_ids``)."""
    return int(batch["completion_ids"].shape[0])


def _is_row_aligned(value: Any, n: int) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and value.shape[0] == n
    return isinstance(value, list) and len(value) == n


def _index_rows(value: Any, index: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value[index.to(value.device)]
    return [value[i] for i in index.tolist()]


def select_rows(batch: RolloutBatch, index: torch.Tensor) -> RolloutBatch:
    """The rows ``index`` of every row-aligned value of ``batch`` (scalars, e.g. ``num_items_in_batch``, copied)."""
    n = batch_size_of(batch)
    return {k: (_index_rows(v, index) if _is_row_aligned(v, n) else v) for k, v in batch.items()}


def token_budget_packs(lengths: list[int], budget: int) -> tuple[list[list[int]], list[int]]:
    """Rows in order, cut into consecutive packs of at most ``budget`` tokens each (TRL's token-budget planner on
    one process); returns ``(packs of row indices, rows longer than budget, which fit in none)``."""
    packs: list[list[int]] = []
    oversize: list[int] = []
    current: list[int] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if n > budget:
            oversize.append(i)
            continue
        if current and tokens + n > budget:
            packs.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        packs.append(current)
    return packs, oversize


def shuffle_sequence_dict(batch: RolloutBatch, generator: torch.Generator | None = None) -> RolloutBatch:
    """Permute every row-aligned value of ``batch`` with the same random permutation (scalars untouched)."""
    return select_rows(batch, torch.randperm(batch_size_of(batch), generator=generator))


def split_tensor_dict(batch: RolloutBatch, num_chunks: int) -> list[RolloutBatch]:
    """Split ``batch`` into ``num_chunks`` equal micro-batches along the rows; scalars are copied to each.

    Raises a ``ValueError`` when the rows do not divide evenly (the batch arithmetic guarantees they do).
    """
    n = batch_size_of(batch)
    if n % num_chunks != 0:
        raise ValueError(f"Cannot split a rollout batch of {n} rows into {num_chunks} equal micro-batches.")
    size = n // num_chunks
    return [select_rows(batch, torch.arange(i * size, (i + 1) * size)) for i in range(num_chunks)]


def split_short_round(batch: RolloutBatch, micro_batch_size: int) -> list[RolloutBatch]:
    """Split ``batch`` into consecutive micro-batches of ``micro_batch_size`` rows, the last one shorter when the rows
    do not divide evenly (TRL's dataloader batches of an epoch's short end); scalars are copied to each."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}.")
    n = batch_size_of(batch)
    return [select_rows(batch, torch.arange(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]


def trim_padding(batch: RolloutBatch) -> RolloutBatch:
    """Drop prompt columns that are padding in every row and completion columns past the longest completion."""
    out = dict(batch)
    prompt_mask = batch.get("prompt_mask")
    if prompt_mask is not None and prompt_mask.numel():
        used = prompt_mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else prompt_mask.shape[1]
        for key in PROMPT_KEYS:
            if key in out and out[key] is not None:
                out[key] = out[key][:, start:]
    completion_mask = batch.get("completion_mask")
    if completion_mask is not None and completion_mask.numel():
        # Keep columns up to the longest *generated* completion (the loss mask may be all zero for masked rows).
        lengths = batch.get("completion_lengths")
        if lengths is not None and lengths.numel():
            end = int(lengths.max())
        else:
            used = completion_mask.any(dim=0).nonzero()
            end = int(used[-1]) + 1 if used.numel() else 0
        end = max(end, 1)
        for key in COMPLETION_KEYS:
            value = out.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] > 1:
                out[key] = value[:, :end]
    return out


class RolloutBuffer:
    """Holds the micro-batches of the current generation round and says when to generate the next one.

    Args:
        steps_per_generation: Micro-batches per generated batch.
        num_iterations: Optimisation passes over each generated batch (TRL's μ).
        seed: Seed of a dedicated generator for the shuffle applied before splitting (saved in ``state_dict``);
            ``None`` draws it from the global torch RNG (TRL's behaviour, what the trainers use).
    """

    def __init__(self, steps_per_generation: int, num_iterations: int = 1, seed: int | None = 0):
        self.steps_per_generation = int(steps_per_generation)
        self.num_iterations = int(num_iterations)
        self.generator = None if seed is None else torch.Generator().manual_seed(int(seed))
        self.micro_batches: list[RolloutBatch] | None = None
        # micro-steps served so far (TRL's ``_step``), rounded up to a round boundary after a short round
        self.step = 0

    @property
    def generate_every(self) -> int:
        """Micro-steps served by one generated batch."""
        return self.steps_per_generation * self.num_iterations

    def needs_generation(self) -> bool:
        """True at the first micro-step of each round, once a short round's fewer micro-steps are served, and
        whenever the buffer is empty (e.g. after resume)."""
        if self.micro_batches is None:
            return True
        into_round = self.step % self.generate_every
        return into_round == 0 or into_round >= len(self.micro_batches) * self.num_iterations

    def fill(self, batch: RolloutBatch, shuffle: bool = True, micro_batch_size: int | None = None) -> None:
        """Shuffle ``batch`` (optionally) and split it into ``steps_per_generation`` trimmed micro-batches.

        With ``micro_batch_size``, a batch of fewer than ``micro_batch_size × steps_per_generation`` rows is a short
        round: it is split into ``ceil(rows / micro_batch_size)`` micro-batches of ``micro_batch_size`` rows, the
        last one shorter (``split_short_round``). A round filled after a short one starts at the next round boundary.
        """
        if shuffle:
            batch = shuffle_sequence_dict(batch, self.generator)
        if micro_batch_size is not None and batch_size_of(batch) < micro_batch_size * self.steps_per_generation:
            if self.num_iterations != 1:
                raise ValueError(
                    f"A short round ({batch_size_of(batch)} rows) needs num_iterations=1, got {self.num_iterations}: "
                    "its replays would straddle the optimizer steps."
                )
            parts = split_short_round(batch, micro_batch_size)
        else:
            parts = split_tensor_dict(batch, self.steps_per_generation)
        self.step = -(-self.step // self.generate_every) * self.generate_every  # after a short round: next boundary
        self.micro_batches = [trim_padding(mb) for mb in parts]

    def next(self) -> RolloutBatch:
        """The micro-batch of the current micro-step; advances the step counter."""
        if self.micro_batches is None:
            raise RuntimeError("The rollout buffer is empty: call fill() with a generated batch first.")
        batch = self.micro_batches[self.step % self.steps_per_generation]
        self.step += 1
        return batch

    # -- checkpointing -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue after a resume (tensors moved to CPU).

        The micro-batches are kept only mid-round; at a round boundary (or after a short round's last micro-step)
        the next micro-step generates anyway, so only the step and the shuffle RNG (a dedicated generator's state;
        None with the global RNG) are stored.
        """

        def to_cpu(value):
            return value.detach().cpu() if isinstance(value, torch.Tensor) else value

        batches = None
        if not self.needs_generation():
            batches = [{k: to_cpu(v) for k, v in mb.items()} for mb in self.micro_batches]
        generator = None if self.generator is None else self.generator.get_state()
        return {"step": self.step, "micro_batches": batches, "generator": generator}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str | None = None) -> None:
        """Restore ``state_dict()``; micro-batch tensors are moved to ``device`` when given."""
        self.step = int(state["step"])
        batches = state["micro_batches"]
        if device is not None and batches is not None:
            batches = [
                {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()} for mb in batches
            ]
        self.micro_batches = batches
        # a global-RNG buffer ignores a saved generator (the checkpoint's RNG state is restored by the Trainer)
        if self.generator is not None and state.get("generator") is not None:
            self.generator.set_state(state["generator"])

    def save(self, path: str | os.PathLike) -> None:
        torch.save(self.state_dict(), path)

    def load(self, path: str | os.PathLike, device: torch.device | str | None = None) -> None:
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), device=device)
