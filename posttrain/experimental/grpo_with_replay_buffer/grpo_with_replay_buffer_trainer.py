"""``GRPOWithReplayBufferTrainer``: GRPO plus one rollout step, ``rollout.replay_buffer.replace_zero_std_groups``.

After the shared pipeline produced a training batch, groups with reward variance go into the replay buffer (score
Σ|A|·std) and groups without it (all-equal rewards, zero advantages) are replaced by buffered groups, with their
stored advantages and log-probs. π_old is therefore always computed (a replayed group is off-policy, as in TRL), and
``num_items_in_batch`` is recounted from the final masks. Evaluation batches are left alone. The loss is GRPO's.
The number of replaced groups is logged as ``replay_buffer/replaced_groups`` (posttrain), the buffer's size as
``replay_buffer/size``, both summed over processes (each holds its own buffer).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.distributed import sum_over_processes
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.replay_buffer import ReplayBuffer, replace_zero_std_groups
from posttrain.trainers.grpo import GRPOTrainer

from .grpo_with_replay_buffer_config import GRPOWithReplayBufferConfig


class GRPOWithReplayBufferTrainer(GRPOTrainer):
    """GRPO whose zero-variance groups are replaced from a replay buffer; constructor as :class:`GRPOTrainer`."""

    config_class = GRPOWithReplayBufferConfig
    _tag_names = ["posttrain", "grpo", "replay-buffer"]
    supports_vision = False  # its rollout path does not carry the per-row vision inputs yet

    def _setup_loss(self) -> None:
        super()._setup_loss()
        size = self.args.replay_buffer_size
        seed = self.args.seed + self.accelerator.process_index
        self.replay_buffer = ReplayBuffer(size, seed=seed) if size > 0 else None

    def _needs_old_logps(self) -> bool:
        return self.args.replay_buffer_size > 0 or super()._needs_old_logps()

    def _generate_and_score(self, rows: list[dict[str, Any]], mode: str) -> RolloutBatch:
        batch = super()._generate_and_score(rows, mode)
        if mode != "train" or self.replay_buffer is None:
            return batch
        g = self.num_generations
        n_local = batch["completion_ids"].shape[0]
        if n_local % g:  # a group split across processes: nothing to swap whole
            return batch
        first = self.accelerator.process_index * (n_local // g)
        grouped = self.pipeline.last_result.rewards.reshape(-1, g)  # the whole generation batch, gathered
        group_std = torch.nan_to_num(grouped.std(dim=1), nan=0.0)  # (groups,), TRL's unbiased std
        group_std = group_std[first : first + n_local // g].cpu()
        batch, replaced = replace_zero_std_groups(
            batch, group_std, self.replay_buffer, num_generations=g, pad_token_id=self.pipeline.pad_token_id
        )
        mask = batch["completion_mask"]
        batch["num_items_in_batch"] = self.pipeline.gather(mask.sum().reshape(1)).sum().to(mask.device)
        # Each process holds its own buffer and replaces its own groups: the counts of the run are their sums.
        counts = sum_over_processes(self.accelerator, torch.tensor([float(replaced), float(len(self.replay_buffer))]))
        self.record_metric("replay_buffer/replaced_groups", float(counts[0]), mode=mode)
        self.record_metric("replay_buffer/size", float(counts[1]), mode=mode)
        return batch
