"""``PPOTrainer`` (Schulman et al. 2017; the RLHF recipe of Ouyang et al. 2022 / book chapter 004) on the shared
online-RL rollout, with a value head on the policy.

What PPO adds to the shared pipeline:

- a value head (:class:`ValueHead`, or the one of an :class:`AutoModelForCausalLMWithValueHead` passed as ``model``),
  attached to the policy as ``v_head`` so the optimizer trains it and checkpoints hold it (``v_head.*`` weights);
  V_t is computed from the policy trunk's last hidden state before completion token t;
- an estimator, ``rollout.estimators.GAEEstimator``: the score (reward functions / reward model, minus
  ``missing_eos_penalty``) on the last token, a per-token KL penalty −kl_coef·KL (k1 or k3), GAE(γ, λ) with the old
  values, whitened advantages;
- a loss: the clipped policy objective (``core.policy_objectives.clip_objective`` with per-token advantages, ε =
  ``cliprange``), token mean over the micro-batch, plus ``vf_coef`` × the clipped value loss (``core.gae``), divided by
  the gradient-accumulation steps. Each rollout is replayed ``num_ppo_epochs`` times in ``num_mini_batches`` ×
  ``gradient_accumulation_steps`` micro-batches (the shared buffer).

Metrics: TRL's ``objective/kl``, ``objective/entropy``, ``objective/non_score_reward``, ``objective/rlhf_reward``,
``objective/scores``, ``val/num_eos_tokens`` (per rollout), ``policy/approxkl_avg``, ``policy/clipfrac_avg``,
``loss/policy_avg``, ``loss/value_avg``, ``val/clipfrac_avg``, ``policy/entropy_avg``, ``val/ratio`` (per step).

Deliberate differences from TRL's PPO: the value function shares the policy's trunk (TRL trains a separate value
model; ``value_model`` is therefore not accepted); rewards may also be reward functions (``reward_funcs``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from posttrain.core.gae import clipped_value_loss
from posttrain.core.masking import masked_mean
from posttrain.core.policy_objectives import clip_objective
from posttrain.distributed import sum_over_processes
from posttrain.experimental._online import reward_sources
from posttrain.models.completion_scoring import completion_inputs
from posttrain.models.unwrap import unwrap_base_model
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.estimators import GAEEstimator
from posttrain.trainers.online import OnlineTrainerBase

from .modeling_value_head import AutoModelForCausalLMWithValueHead, ValueHead, _hidden_size
from .ppo_config import PPOConfig


class PPOTrainer(OnlineTrainerBase):
    """Trainer for PPO with a value head; TRL's constructor (keyword use recommended).

    Args:
        args: :class:`PPOConfig`.
        processing_class: Tokenizer (left padding is set); None → loaded from the model.
        model: The policy: hub id / path, causal LM, or :class:`AutoModelForCausalLMWithValueHead` (its head is
            used).
        ref_model: The reference policy; None = a frozen copy (or adapters disabled under PEFT).
        reward_model: A reward model (sequence classifier module, or id / path); ``args.reward_model_path`` too.
        train_dataset / eval_dataset: Prompt-only datasets (``"prompt"``).
        value_model: Not supported (the value head shares the policy trunk); must be None.
        data_collator: Accepted for TRL compatibility and unused (the rollout batches prompts itself).
        optimizers / callbacks / peft_config: As ``GRPOTrainer``.
        reward_funcs: posttrain: reward functions (TRL's keyword contract) besides / instead of a reward model.
    """

    config_class = PPOConfig
    _trainer_name = "PPO"
    _tag_names = ["posttrain", "ppo"]

    def __init__(
        self,
        args: PPOConfig | None = None,
        processing_class: Any = None,
        model: Any = None,
        ref_model: Any = None,
        reward_model: Any = None,
        train_dataset: Any = None,
        value_model: Any = None,
        data_collator: Any = None,
        eval_dataset: Any = None,
        optimizers: tuple = (None, None),
        callbacks: list | None = None,
        peft_config: Any = None,
        reward_funcs: Any = None,
    ):
        if model is None:
            raise ValueError("PPOTrainer needs a policy `model`.")
        if value_model is not None:
            raise ValueError(
                "posttrain's PPOTrainer trains a value head on the policy (shared trunk), not a separate value_model: "
                "pass value_model=None, or pass an AutoModelForCausalLMWithValueHead as `model` to bring a head."
            )
        self._given_v_head = None
        if isinstance(model, AutoModelForCausalLMWithValueHead):
            self._given_v_head, model = model.v_head, model.pretrained_model
        self._ref_model_arg = ref_model
        funcs = reward_sources(reward_funcs, first=(getattr(args, "reward_model_path", None), reward_model))
        super().__init__(
            model,
            funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )

    # -- construction hooks ------------------------------------------------------------------------------------
    def _prepare_model(self, model: torch.nn.Module, args: PPOConfig) -> None:
        """Attach the value head to the policy (before the optimizer and the reference copy are made)."""
        base = unwrap_base_model(model)
        head = self._given_v_head
        if head is None:
            # Initialised from ``args.seed`` (this runs before the Trainer seeds the RNGs): the same seed gives the
            # same head whatever ran before in the process, e.g. under 1 or several processes.
            with torch.random.fork_rng():
                torch.manual_seed(args.seed)
                head = ValueHead(_hidden_size(base), summary_dropout_prob=0.0 if args.disable_dropout else 0.1)
        elif args.disable_dropout and isinstance(head.dropout, torch.nn.Dropout):
            head.dropout.p = 0.0
        parameter = next(base.parameters())
        base.v_head = head.to(parameter.device)

    def _make_estimator(self) -> GAEEstimator:
        args = self.args
        return GAEEstimator(
            values_fn=self._values_no_grad,
            kl_coef=args.kl_coef,
            kl_estimator=args.kl_estimator,
            gamma=args.gamma,
            lam=args.lam,
            whiten_rewards=args.whiten_rewards,
            missing_eos_penalty=args.missing_eos_penalty,
            process_index=self.accelerator.process_index,
            reduce_sum=functools.partial(sum_over_processes, self.accelerator),
        )

    @property
    def value_head(self) -> ValueHead:
        return unwrap_base_model(self.model).v_head

    # -- values ------------------------------------------------------------------------------------------------
    def _values(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """V_t ``(B, C)``: the value head on the trunk's last hidden state at the position predicting token t."""
        base = unwrap_base_model(model)
        trunk = base.base_model
        input_ids, attention_mask, position_ids, _ = completion_inputs(batch)
        hidden = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        prompt_width, width = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
        hidden = hidden[:, prompt_width - 1 : prompt_width + width - 1]  # (B, C, H)
        return base.v_head(hidden).squeeze(-1).float()

    def _values_no_grad(self, batch: RolloutBatch) -> torch.Tensor:
        """Old values in no-grad passes of ``per_device_train_batch_size`` rows (the pipeline's chunking)."""
        values = self.pipeline.logps_in_chunks(
            lambda chunk: self._values(self.model, chunk), batch, self.accelerator.device
        )
        return values.cpu()

    # -- loss --------------------------------------------------------------------------------------------------
    def _global_token_share(self, mask: torch.Tensor) -> torch.Tensor:
        """n_local · P / n_global (1 on one process): turns a local token mean into this process's share of the
        token mean over every process's micro-batch."""
        if self.accelerator.num_processes == 1:
            return mask.new_ones(())
        local = mask.sum().detach()
        total = sum_over_processes(self.accelerator, local.reshape(1)).reshape(())
        return local * self.accelerator.num_processes / total.clamp(min=1.0)

    def _compute_loss(self, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        args, mode = self.args, self._mode()
        stats = self._token_stats(model, inputs, compute_entropy=True)
        logps = stats.logps  # (B, C)
        width = logps.shape[1]
        mask = inputs["completion_mask"].to(logps.dtype)
        old_logps = inputs["old_per_token_logps"][:, :width].to(logps.dtype)
        advantages = inputs["token_advantages"][:, :width].to(logps.dtype)
        returns = inputs["returns"][:, :width].to(logps.dtype)
        old_values = inputs["old_values"][:, :width].to(logps.dtype)
        values = self._values(model, inputs)
        pg_losses, clip_stats = clip_objective(
            logps, old_logps, advantages, mask, epsilon_low=args.cliprange, epsilon_high=args.cliprange
        )
        # Token means over the micro-batch of every process: each local mean × n_local · P / n_global, which DDP's
        # gradient average (and the metrics' mean over processes) turns into Σ over all tokens / n_global.
        scale = self._global_token_share(mask)
        pg_loss = masked_mean(pg_losses, mask) * scale
        vf_loss, vf_clipfrac = clipped_value_loss(values, old_values, returns, mask, args.cliprange_value)
        vf_loss = vf_loss * scale
        loss = pg_loss + args.vf_coef * vf_loss
        with torch.no_grad():
            log_ratio = logps.detach() - old_logps
            for name, value in (
                ("policy/approxkl_avg", 0.5 * masked_mean(log_ratio**2, mask) * scale),
                ("policy/clipfrac_avg", masked_mean(clip_stats["is_region_clipped"], mask) * scale),
                ("loss/policy_avg", pg_loss.detach()),
                ("loss/value_avg", vf_loss.detach()),
                ("val/clipfrac_avg", vf_clipfrac * scale),
                ("policy/entropy_avg", masked_mean(stats.entropy.detach(), mask) * scale),
                ("val/ratio", masked_mean(torch.exp(log_ratio), mask) * scale),
            ):
                self.record_metric(name, self._gather_mean(value), mode=mode)
        return self._finish_loss(loss, stats.aux_loss)
