"""``A2POTrainer``: A*-PO (arXiv 2505.20686) on the shared online-RL rollout.

Stage 1 (before training, and before an evaluation that precedes it): for every train (and eval) prompt,
each process taking its shard of the prompts and every process then holding all estimates,
``num_value_samples`` completions are sampled with the rollout pipeline's own stages (render, generate, decode,
calculate_rewards) and V*(x) = β₁ log mean exp(r/β₁) is cached per prompt (``core.optimal_value``); with
``filter_all_incorrect`` the train prompts whose samples all scored 0 are dropped. Stage 2: each micro-step the
pipeline samples one completion per prompt, the estimator (``rollout.estimators.OptimalAdvantageEstimator``) turns
its reward into r − V*, and the loss is mean (β₂ log π/π_ref − (r − V*))², divided by the gradient-accumulation
steps. Metrics (TRL's): ``reward``, ``v_star``, ``implicit_reward``, ``advantage``.

Deliberate difference from TRL: stage 1 samples with the policy's generation backend before the first update, when
the policy still equals the frozen reference (TRL samples from ``ref_model``, the same weights).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from posttrain.core.advantages import combine_rewards
from posttrain.core.masking import masked_sum
from posttrain.core.optimal_value import optimal_advantage_regression_loss, optimal_value
from posttrain.distributed import gather_objects
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.estimators import OptimalAdvantageEstimator
from posttrain.rollout.pipeline import RolloutSettings, render_prompts
from posttrain.trainers.online import OnlineTrainerBase

from .a2po_config import A2POConfig


def _prompt_key(prompt: Any) -> str:
    return json.dumps(prompt, sort_keys=True, default=str)


def _shard(rows: list, rank: int, num_processes: int) -> list:
    """Rows ``[rank·k, (rank+1)·k)`` with k = ⌈n / processes⌉, padded to k rows by repeating a row (a repeat
    re-estimates that prompt's V*), so every process runs the same number of same-size chunks."""
    if num_processes == 1 or not rows:
        return rows
    k = -(-len(rows) // num_processes)
    shard = rows[rank * k : (rank + 1) * k]
    return shard + [shard[-1] if shard else rows[-1]] * (k - len(shard))


class A2POTrainer(OnlineTrainerBase):
    """Trainer for A*-PO; TRL's constructor ``(model, reward_funcs, args, train_dataset, eval_dataset,
    processing_class, callbacks, optimizers)`` (plus the shared ``reward_processing_classes`` / ``peft_config``)."""

    config_class = A2POConfig
    keeps_short_last_round = True  # TRL's plain Trainer dataloader keeps an epoch's short last batch
    shuffles_generation_batch = False  # TRL's A2PO trains its dataloader's batches in order
    _trainer_name = "A2PO"
    _tag_names = ["posttrain", "a2po"]
    scores_at_sampling_temperature = False  # TRL: log-probs of the raw logits, not logits / temperature

    def _setup_loss(self) -> None:
        self._optimal_values: dict[str, float] | None = None

    def _make_estimator(self) -> OptimalAdvantageEstimator:
        return OptimalAdvantageEstimator()

    def _rollout_settings(self) -> RolloutSettings:
        settings = super()._rollout_settings()
        settings.max_prompt_length = self.args.max_prompt_length
        return settings

    # -- stage 1 -----------------------------------------------------------------------------------------------
    def _estimate_optimal_values(self) -> None:
        """V*(x) for every train and eval prompt; optionally drop train prompts whose samples all scored 0."""
        args, pipeline = self.args, self.pipeline
        n = args.num_value_samples
        weights = torch.as_tensor(self.scorer.weights, dtype=torch.float32)
        values: dict[str, float] = {}
        all_incorrect: set[str] = set()
        self.backend.sync_weights(self.accelerator.unwrap_model(self.model))
        datasets = [d for d in (self.train_dataset, self.eval_dataset) if d is not None]
        acc = self.accelerator
        for dataset in datasets:
            for dataset_part in dataset.values() if isinstance(dataset, dict) else [dataset]:
                # This process's shard; every process gets as many rows (the reward gather is a collective)
                rows = _shard(list(dataset_part), acc.process_index, acc.num_processes)
                size = max(1, args.per_device_train_batch_size)
                for start in range(0, len(rows), size):
                    chunk = rows[start : start + size]
                    repeated = [row for row in chunk for _ in range(n)]
                    prompts = [row["prompt"] for row in repeated]
                    _, prompt_ids = render_prompts(repeated, self.processing_class, args.chat_template_kwargs)
                    if args.max_prompt_length:
                        prompt_ids = [ids[-args.max_prompt_length :] for ids in prompt_ids]
                    completions = pipeline.generate(prompts, prompt_ids, n)
                    _, completion_objs = pipeline.decode(prompts, completions)
                    rewards_per_func, _ = pipeline.calculate_rewards(
                        repeated, prompts, completions, completion_objs, self.state, lambda *_: None, None
                    )
                    local = slice(
                        self.accelerator.process_index * len(repeated),
                        (self.accelerator.process_index + 1) * len(repeated),
                    )
                    rewards = combine_rewards(rewards_per_func[local].cpu(), weights)
                    rewards = torch.nan_to_num(rewards, nan=0.0).reshape(len(chunk), n)
                    v_star = optimal_value(rewards, args.beta1)
                    for row, value, row_rewards in zip(chunk, v_star.tolist(), rewards):
                        values[_prompt_key(row["prompt"])] = value
                        if row_rewards.sum() == 0:
                            all_incorrect.add(_prompt_key(row["prompt"]))
        # every process holds every prompt's V* (stage 2 may draw any prompt on any process)
        self._optimal_values = dict(gather_objects(acc, sorted(values.items())))
        all_incorrect = set(gather_objects(acc, sorted(all_incorrect)))
        if args.filter_all_incorrect and all_incorrect:
            kept = self.train_dataset.filter(lambda row: _prompt_key(row["prompt"]) not in all_incorrect)
            if len(kept) < self._prompts_per_round():
                raise ValueError(
                    f"filter_all_incorrect dropped {len(self.train_dataset) - len(kept)} of {len(self.train_dataset)} "
                    f"train prompts (every reference sample scored 0); {len(kept)} remain, fewer than one batch "
                    f"({self._prompts_per_round()}). Set filter_all_incorrect=False or use easier prompts."
                )
            self.train_dataset = kept

    def train(self, *args, **kwargs):
        if self._optimal_values is None:
            self._estimate_optimal_values()
        return super().train(*args, **kwargs)

    # -- stage 2 -----------------------------------------------------------------------------------------------
    def _generate_and_score(self, rows: list[dict[str, Any]], mode: str) -> RolloutBatch:
        if self._optimal_values is None:
            self._estimate_optimal_values()
        missing = [row["prompt"] for row in rows if _prompt_key(row["prompt"]) not in self._optimal_values]
        if missing:
            raise KeyError(f"No V* estimate for prompt {missing[0]!r}: stage 1 covers the train and eval datasets.")
        self.pipeline.estimator.v_star = torch.tensor(
            [self._optimal_values[_prompt_key(row["prompt"])] for row in rows], dtype=torch.float32
        )
        return super()._generate_and_score(rows, mode)

    def _compute_loss(self, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        mode = self._mode()
        stats = self._token_stats(model, inputs)
        mask = inputs["completion_mask"].to(stats.logps.dtype)
        logps = masked_sum(stats.logps, mask, dim=-1)  # (B,)
        ref_logps = masked_sum(inputs["ref_per_token_logps"].to(logps.dtype), mask, dim=-1)
        advantages = inputs["advantages"]
        loss, implicit_reward = optimal_advantage_regression_loss(logps, ref_logps, advantages, self.args.beta2)
        self.record_metric("implicit_reward", self._gather_mean(implicit_reward.detach().mean()), mode=mode)
        self.record_metric("advantage", self._gather_mean(advantages.float().mean()), mode=mode)
        return self._finish_loss(loss, stats.aux_loss)
