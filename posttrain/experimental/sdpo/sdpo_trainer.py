"""``SDPOTrainer``: Self-Distillation Policy Optimization ("Reinforcement Learning via Self-Distillation", Hübotter et
al. 2026, https://huggingface.co/papers/2601.20802) as GRPO plus one rollout stage and one loss term.

The rollout is GRPO's shared pipeline (generation, rewards, group-relative advantages), then the stage
``teacher_context`` (timed as ``timing/teacher_context``): :class:`SuccessfulRolloutTeacherContextBuilder` picks, for
each completion, a successful completion of the same group (and optionally the row's ``privileged_context``
feedback) and re-prompts the teacher with it; the batch gains ``teacher_prompt_ids`` / ``teacher_prompt_mask`` (left
padded, at most ``max_reprompt_len`` tokens) and ``self_distillation_mask`` ``(B,)``.

The loss, per micro-batch::

    loss = (1 - w) · GRPO(π_θ)  +  w · mean_rows( mean_{t ∈ loss tokens} ρ_t · ℓ_t ) / GA

with ``w = distillation_weight``, loss tokens = completion tokens of rows with a teacher, ``ρ_t`` the clipped ratio
``min(π_θ/π_old, distillation_is_clip)`` (when π_old exists: the batch outlives one optimizer step), and ``ℓ_t``
the ``distillation_mode`` term of ``core.self_distillation`` between the student on ``[prompt | completion]`` and the
teacher on ``[re-prompt | completion]`` (no gradient): ``sampled_token`` (reverse KL at the sampled token, from the
chunked log-probs: no full-vocabulary logits), ``full_logits`` (divergence with ``distillation_alpha`` over the
vocabulary, chunked) / ``topk_logits`` (over the student's top-k ids, from the loss tokens' logits). The loss is
the strategy :class:`SDPOLoss` behind ``GRPOTrainer._compute_loss`` (``loss_strategy``); the per-token loss of the
logit modes, the served teacher, the callback dispatch and the EMA checkpoint state are the trainer's
``experimental._self_distillation.SelfDistillation`` component's (``self.self_distillation``), shared with SDFT. One
student forward serves both terms. The teacher (``teacher_model_kind``: ``base`` / ``live`` / ``ema``, updated
every ``teacher_sync_steps`` by ``teacher_update_rate``) is ``models.teacher_sync``'s; only rows with a teacher are
forwarded through it.

Callbacks may define TRL's self-distillation events ``on_generation_prompts_selected``, ``on_teacher_context_built``,
``on_self_distillation_batch_prepared`` and ``on_generation_batch_built`` (called with TRL's payloads).

Metrics: GRPO's, plus TRL's ``self_distillation/*`` (teacher-context fractions, reward diagnostics, policy and
distillation losses) and ``sdpo/distillation_loss``. TRL's diagnostics warnings (flat rewards, inactive
self-distillation, no successful rollouts) are logged on the first and every ``diagnostics_warning_interval``-th
consecutive degenerate generation batch.

Deliberate differences from TRL: the policy term is posttrain's GRPO loss, so every GRPO ``loss_type`` and option
applies and ``dapo`` normalises by the tokens of the whole generation batch (TRL's SDPO: the local micro-batch), and
``beta > 0`` adds GRPO's KL to the policy term (TRL's SDPO accepts ``beta`` but never uses it). The teacher forward
skips rows without a teacher (their loss is 0 either way). ``use_teacher_server`` (TRL's conditions: live teacher, a
vLLM/``posttrain serve`` generation server, ``distillation_weight=1``) reads the teacher's log-probs from the server
as SDFT does, and logs ``self_distillation/server_logprob_abs_diff``. An EMA teacher's weights are saved in
checkpoints (``posttrain_state_*.pt``, as SDFT's), so a resumed run continues the same average (TRL rebuilds the
teacher from the model path and restarts it).
"""

from __future__ import annotations

import logging
import textwrap
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch

from posttrain.core.logprobs import chunked_logprobs_from_hidden, entropy_from_logits
from posttrain.core.self_distillation import (
    apply_importance_sampling_clipping,
    sampled_token_self_distillation_loss_from_logps,
    self_distillation_loss,
)
from posttrain.distributed import gather_objects
from posttrain.experimental._distill_support import to_rows
from posttrain.experimental._self_distillation import SelfDistillation, trim_left_padding
from posttrain.models.completion_scoring import completion_inputs
from posttrain.models.distillation_scoring import DistillationScores, score_distillation_completions
from posttrain.models.forward import TokenStats
from posttrain.models.teacher_sync import SyncTeacherModelCallback, create_teacher
from posttrain.models.vocabulary import model_vocab_size
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.pipeline import RolloutSettings, StageTimer, pad_rows, render_prompts
from posttrain.trainers.grpo import GRPOTrainer

from .sdpo_config import SDPOConfig
from .teacher_context import SuccessfulRolloutTeacherContextBuilder

__all__ = ["SDPOTrainer"]


logger = logging.getLogger(__name__)


class SDPOLoss:
    """SDPO's loss strategy (``SDPOTrainer.loss_strategy``, called by ``GRPOTrainer._compute_loss``):
    ``(1 − w)·GRPO + w·self-distillation`` on one micro-batch (see the module docstring).

    One student forward serves both terms: the policy term is ``trainer._grpo_loss`` given those statistics, the
    distillation term scores the teacher through the trainer's :class:`SelfDistillation` component
    (``trainer.self_distillation``). Stateless: it reads everything from the trainer.
    """

    def __call__(self, trainer: SDPOTrainer, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        weight = trainer.args.distillation_weight
        mode = trainer._mode()
        if weight == 0.0:
            loss = trainer._grpo_loss(model, inputs)
            self._record_policy_loss(trainer, loss, mode)
            return loss
        student, scores = self._student_stats(trainer, model, inputs, with_policy=weight < 1.0)
        distillation = trainer._finish_loss(
            self._self_distillation_loss(trainer, model, inputs, student, scores), None
        )
        if weight == 1.0:
            return trainer._finish_loss(distillation, student.aux_loss, divide_by_grad_accum=False)
        policy = trainer._grpo_loss(model, inputs, stats=replace(student, aux_loss=None))
        self._record_policy_loss(trainer, policy, mode)
        loss = (1.0 - weight) * policy + weight * distillation
        return trainer._finish_loss(loss, student.aux_loss, divide_by_grad_accum=False)

    @staticmethod
    def _record_policy_loss(trainer: SDPOTrainer, policy: torch.Tensor, mode: str) -> None:
        scale = trainer._grad_accum_divisor() if trainer.divide_by_grad_accum else 1
        trainer.record_metric(
            "self_distillation/policy_loss", trainer._gather_mean(policy.detach() * scale), mode=mode
        )

    @staticmethod
    def _student_stats(
        trainer: SDPOTrainer, model: torch.nn.Module, inputs: RolloutBatch, *, with_policy: bool
    ) -> tuple[TokenStats, DistillationScores | None]:
        """The student's token statistics over ``inputs`` (one forward serves both terms) and, for the logit modes,
        its ``DistillationScores`` at every generated token (row-major; log-probs and entropies chunked from them)."""
        args, component = trainer.args, trainer.self_distillation
        entropy_grad = with_policy and trainer.entropy_ctrl.enabled
        if args.distillation_mode == "sampled_token" and not args.use_teacher_server:
            stats = trainer._token_stats(
                model, inputs, compute_entropy=with_policy, entropy_requires_grad=entropy_grad
            )
            return stats, None
        generated = completion_inputs(inputs)[3]
        scores = score_distillation_completions(
            model, *component.scoring_inputs(model, {**inputs, "completion_mask": generated.long()})
        )
        if scores.hidden is not None:
            weight, bias = scores.head(trainer.vocab_rows)
            logps, entropy = chunked_logprobs_from_hidden(
                scores.hidden, weight, scores.tokens, bias=bias, temperature=args.temperature,
                chunk_size=component.loss_chunk_size(), compute_entropy=with_policy,
                entropy_requires_grad=entropy_grad,
            )  # fmt: skip
        else:
            logits = scores.logits[:, : trainer.vocab_rows].float() / args.temperature
            logps = torch.log_softmax(logits, -1).gather(-1, scores.tokens.unsqueeze(-1)).squeeze(-1)
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach()) if with_policy else None
        stats = TokenStats(
            logps=to_rows(logps, generated),
            mask=generated,
            entropy=None if entropy is None else to_rows(entropy, generated),
            aux_loss=scores.aux_loss,
        )
        return stats, scores

    @staticmethod
    def _teacher_inputs(inputs: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
        """The teacher's micro-batch: ``[re-prompt | completion]`` of the selected rows (padding columns trimmed)."""
        prompt_ids, prompt_mask = trim_left_padding(
            inputs["teacher_prompt_ids"][rows], inputs["teacher_prompt_mask"][rows]
        )
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": inputs["completion_ids"][rows],
            "completion_mask": inputs["completion_mask"][rows],
            "completion_lengths": inputs["completion_lengths"][rows],
        }

    def _self_distillation_loss(
        self,
        trainer: SDPOTrainer,
        model: torch.nn.Module,
        inputs: RolloutBatch,
        student: TokenStats,
        scores: DistillationScores | None,
    ) -> torch.Tensor:
        """The distillation term before the gradient-accumulation divisor: per-row mean over the loss tokens, mean
        over rows (rows without a teacher count as 0), with the IS clipping; logs TRL's distillation-loss metrics."""
        args = trainer.args
        mode = trainer._mode()
        loss_mask = inputs["completion_mask"].to(student.logps.dtype) * inputs["self_distillation_mask"].to(
            student.logps.dtype
        ).unsqueeze(1)  # (B, C)
        if loss_mask.sum() == 0:
            self._log_distillation_metric(trainer, mode, loss_mask, loss_mask)  # joins the reduction with nothing
            return student.logps.sum() * 0.0  # attached to the graph: backward gives zero gradients
        rows = inputs["self_distillation_mask"].bool().nonzero().squeeze(-1)
        teacher_batch = self._teacher_inputs(inputs, rows)
        if args.distillation_mode == "sampled_token" and not args.use_teacher_server:
            with torch.no_grad(), trainer.teacher.activate(model) as teacher:
                teacher_rows = trainer._token_stats(teacher, teacher_batch).logps  # (B_sd, C)
            teacher_logps = torch.zeros_like(student.logps).index_copy(0, rows, teacher_rows.to(student.logps.dtype))
            per_token = sampled_token_self_distillation_loss_from_logps(
                student.logps, teacher_logps, distillation_alpha=args.distillation_alpha
            )
        else:
            per_token = self._logit_distillation(trainer, model, inputs, teacher_batch, rows, loss_mask, scores)
        old_logps = inputs.get("old_per_token_logps")
        if args.distillation_is_clip is not None and old_logps is not None:
            clip = args.distillation_is_clip
            per_token = apply_importance_sampling_clipping(per_token, student.logps, old_logps, clip)
        per_token = per_token * loss_mask  # rows without a teacher hold arbitrary values before this
        self._log_distillation_metric(trainer, mode, per_token.detach(), loss_mask)
        return self_distillation_loss(per_token, loss_mask)

    @staticmethod
    def _logit_distillation(
        trainer: SDPOTrainer,
        model: torch.nn.Module,
        inputs: RolloutBatch,
        teacher_batch: RolloutBatch,
        rows: torch.Tensor,
        loss_mask: torch.Tensor,
        scores: DistillationScores,
    ) -> torch.Tensor:
        """Per-token loss ``(B, C)`` (0 outside the loss tokens) from the student's scores at the loss tokens, by the
        self-distillation component's per-token loss (shared with SDFT): ``full_logits`` (chunked over the
        vocabulary) / ``topk_logits`` against the local teacher's scores, or, with ``use_teacher_server``, against
        the served live teacher's log-probs."""
        component = trainer.self_distillation
        at_loss = loss_mask.bool()[completion_inputs(inputs)[3]]  # which of the student's scored tokens count
        student_scores = DistillationScores(
            tokens=scores.tokens[at_loss],
            hidden=None if scores.hidden is None else scores.hidden[at_loss],
            weight=scores.weight,
            bias=scores.bias,
            logits=None if scores.logits is None else scores.logits[at_loss],
        )
        if trainer.args.use_teacher_server:
            served_inputs = {**teacher_batch, "completion_mask": loss_mask[rows]}
            per_token, _ = component.served_per_token_loss(student_scores, served_inputs, trainer._mode())
            return to_rows(per_token, loss_mask)
        teacher_batch = {**teacher_batch, "completion_mask": loss_mask[rows]}
        with torch.no_grad(), trainer.teacher.activate(model) as teacher:
            teacher_scores = score_distillation_completions(teacher, *component.scoring_inputs(teacher, teacher_batch))
        per_token, _ = component.per_token_loss(student_scores, teacher_scores)  # (N_loss,)
        return to_rows(per_token, loss_mask)

    @staticmethod
    def _log_distillation_metric(
        trainer: SDPOTrainer, mode: str, per_token: torch.Tensor, loss_mask: torch.Tensor
    ) -> None:
        """The distillation loss's mean over the loss tokens of every process (0 when there are none)."""
        mean = trainer._global_masked_mean(per_token, loss_mask)
        trainer.record_metric("self_distillation/distillation_loss", mean, mode=mode)
        trainer.record_metric(f"{trainer._name.lower()}/distillation_loss", mean, mode=mode)


class SDPOTrainer(GRPOTrainer):
    """Trainer for Self-Distillation Policy Optimization; constructor as :class:`~posttrain.GRPOTrainer` (TRL's
    ``SDPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config)``).

    The dataset needs ``prompt`` and may have ``privileged_context`` (environment feedback for the teacher, used with
    ``include_environment_feedback=True``); reward functions score the completions as in GRPO, and a completion is
    a successful demonstration when its reward is ``>= success_reward_threshold``.
    """

    config_class = SDPOConfig
    shuffles_generation_batch = False  # TRL's SDPO splits its generation batch unshuffled
    _trainer_name = "SDPO"
    _tag_names = ["posttrain", "sdpo"]
    loss_strategy = SDPOLoss()  # (1 − w)·GRPO + w·self-distillation, behind GRPOTrainer._compute_loss
    # Tokens per chunk of the chunked divergence / log-probs (None: about 2**24 logits per chunk).
    loss_chunk_size: int | None = None
    _name = "SDPO"
    _paper = {
        "title": "Reinforcement Learning via Self-Distillation",
        "id": "2601.20802",
        "citation": textwrap.dedent("""\
            @article{hubotter2026sdpo,
                title        = {{Reinforcement Learning via Self-Distillation}},
                author       = {Jonas H\\"ubotter and Frederike L\\"ubeck and Lejs Behric and Anton Baumann and Marco Bagatella and Daniel Marta and Ido Hakimi and Idan Shenfeld and Thomas Kleine Buening and Carlos Guestrin and Andreas Krause},
                year         = 2026,
                eprint       = {arXiv:2601.20802}
            }"""),
    }

    def __init__(
        self,
        model: str | torch.nn.Module,
        reward_funcs: Any = None,
        args: SDPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ):
        if environment_factory is None:
            if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and len(reward_funcs) == 0):
                raise ValueError("`reward_funcs` is required for SDPOTrainer because SDPO must score rollouts.")
            if train_dataset is None:
                raise ValueError("`train_dataset` is required")
        self._model_id = model if isinstance(model, str) else None
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            reward_processing_classes,
            callbacks,
            optimizers,
            quantization_config,
            peft_config,
            tools,
            rollout_func,
            environment_factory,
        )

    # -- construction ------------------------------------------------------------------------------------------
    def _setup_loss(self) -> None:
        super()._setup_loss()
        args = self.args
        self.self_distillation = SelfDistillation(self)  # the teacher term, its callback events and EMA state
        self.teacher_context_builder = SuccessfulRolloutTeacherContextBuilder(args)
        self._diagnostic_counters = {"train": defaultdict(int), "eval": defaultdict(int)}
        student = self.accelerator.unwrap_model(self.model)
        init_kwargs = {k: v for k, v in (args.model_init_kwargs or {}).items() if k != "quantization_config"}
        self.teacher = create_teacher(
            student,
            args.teacher_model_kind,
            teacher_update_rate=args.teacher_update_rate,
            teacher_sync_steps=args.teacher_sync_steps,
            reload_from=self._model_id,
            model_init_kwargs=init_kwargs,
        )
        self.teacher.prepare(self.accelerator)
        self.add_callback(SyncTeacherModelCallback(self.teacher, self.accelerator))
        self.vocab_rows = model_vocab_size(student)

    def _rollout_settings(self) -> RolloutSettings:
        settings = super()._rollout_settings()
        settings.max_prompt_length = self.args.max_prompt_length
        return settings

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "privileged_context", "image", "images"]

    # -- the teacher-context rollout stage ---------------------------------------------------------------------
    def _generate_and_score(self, rows: list[dict[str, Any]], mode: str) -> RolloutBatch:
        self.self_distillation.dispatch(
            "on_generation_prompts_selected",
            generation_prompts=[row["prompt"] for row in rows],
            generation_prompt_text=None,
        )
        batch = super()._generate_and_score(rows, mode)
        with StageTimer(self._record(mode))("teacher_context"):
            batch.update(self._teacher_context_stage(rows, batch, mode))
        # TRL's events, with its payloads (teacher inputs as [re-prompt | completion])
        teacher = {
            "teacher_input_ids": torch.cat([batch["teacher_prompt_ids"], batch["completion_ids"]], dim=1),
            "teacher_attention_mask": torch.cat([batch["teacher_prompt_mask"], batch["completion_mask"]], dim=1),
            "self_distillation_mask": batch["self_distillation_mask"],
        }
        self.self_distillation.dispatch(
            "on_teacher_context_built", completion_mask=batch["completion_mask"], **teacher
        )
        self.self_distillation.announce_batch(batch, mode, **teacher)
        return batch

    def _teacher_context_stage(self, rows: list[dict[str, Any]], batch: RolloutBatch, mode: str) -> RolloutBatch:
        """``teacher_prompt_ids`` / ``teacher_prompt_mask`` / ``self_distillation_mask`` for this process's rows,
        from the whole generation batch (gathered), plus the ``self_distillation/*`` metrics and diagnostics."""
        args = self.args
        device = batch["completion_ids"].device
        g = self.num_generations if mode == "train" else self.num_generations_eval
        result = self.pipeline.last_result  # the rollout just gathered: rewards over all processes
        rewards = result.rewards.detach().float().cpu()  # (N,)
        n_local = batch["completion_ids"].shape[0]
        start = self.accelerator.process_index * n_local
        lengths = batch["completion_lengths"].tolist()
        texts = self.processing_class.batch_decode(
            [ids[:n] for ids, n in zip(batch["completion_ids"].tolist(), lengths)], skip_special_tokens=True
        )
        prompts = [row["prompt"] for row in rows]
        feedbacks = [row.get("privileged_context") for row in rows]
        contexts = self.teacher_context_builder.build(
            gather_objects(self.accelerator, prompts),
            rewards,
            gather_objects(self.accelerator, texts),
            g,
            feedbacks=gather_objects(self.accelerator, feedbacks),
            local=slice(start, start + n_local),
        )
        teacher_rows = [{**row, "prompt": prompt} for row, prompt in zip(rows, contexts.teacher_prompts)]
        _, teacher_ids = render_prompts(teacher_rows, self.processing_class, args.chat_template_kwargs)
        teacher_ids = [ids[-args.max_reprompt_len :] for ids in teacher_ids]
        pad_id = self.pipeline.pad_token_id
        for name, value in contexts.metrics.items():
            self.record_metric(name, value, mode=mode)
        self._record_reward_diagnostics(mode, rewards, result.rewards_per_func, g)
        self._warn_on_inactive_self_distillation(mode, contexts.metrics)
        return {
            "teacher_prompt_ids": pad_rows(teacher_ids, pad_id, torch.long, "left").to(device),
            "teacher_prompt_mask": pad_rows([[1] * len(i) for i in teacher_ids], 0, torch.long, "left").to(device),
            "self_distillation_mask": contexts.self_distillation_mask.to(device),
        }

    # -- diagnostics (TRL's metrics and warnings) --------------------------------------------------------------
    def _record_reward_diagnostics(
        self, mode: str, rewards: torch.Tensor, rewards_per_func: torch.Tensor, num_generations: int
    ) -> None:
        tolerance = self.args.diagnostics_flat_tolerance
        rewards = torch.nan_to_num(rewards, nan=0.0)  # TRL sums the weighted rewards with nansum
        group_std = rewards.view(-1, num_generations).std(dim=1)
        std = rewards.std() if rewards.numel() > 1 else torch.tensor(0.0)
        flat_fraction = float((group_std <= tolerance).float().mean()) if group_std.numel() else 1.0
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(std),
            "reward_min": float(rewards.min()),
            "reward_max": float(rewards.max()),
            "group_reward_std_mean": float(group_std.mean()) if group_std.numel() else float(std),
            "flat_group_fraction": flat_fraction,
        }
        for name, value in metrics.items():
            self.record_metric(f"self_distillation/{name}", value, mode=mode)
        per_func = torch.nanmean(rewards_per_func.float().cpu(), dim=0)
        for name, value in zip(self.reward_func_names, per_func.tolist()):
            self.record_metric(f"self_distillation/rewards/{name}", value, mode=mode)
        if float(std) <= tolerance and flat_fraction >= 1.0 - tolerance:
            self._warn_on_degenerate_diagnostics(
                mode,
                "flat_rewards",
                "Observed flat SDPO rewards across all sampled generations. Policy advantages will collapse to zero, "
                "and SDPO will not learn. Check reward density, reward shaping, or `success_reward_threshold`.",
            )
        else:
            self._diagnostic_counters[mode]["flat_rewards"] = 0

    def _warn_on_inactive_self_distillation(self, mode: str, metrics: dict[str, float]) -> None:
        tolerance = self.args.diagnostics_flat_tolerance
        if metrics.get("self_distillation/reprompt_sample_fraction", 0.0) <= tolerance:
            self._warn_on_degenerate_diagnostics(
                mode,
                "inactive_self_distillation",
                "SDPO self-distillation is inactive because no reprompted samples were constructed. This usually "
                "means no rollout exceeded `success_reward_threshold` and no usable privileged feedback was "
                "available.",
            )
        else:
            self._diagnostic_counters[mode]["inactive_self_distillation"] = 0
        if metrics.get("self_distillation/success_group_fraction", 0.0) <= tolerance:
            self._warn_on_degenerate_diagnostics(
                mode,
                "no_successful_rollouts",
                "SDPO did not find any successful rollouts in the current generation groups. If this persists, "
                "reduce task difficulty, adjust reward shaping, or lower `success_reward_threshold`.",
            )
        else:
            self._diagnostic_counters[mode]["no_successful_rollouts"] = 0

    def _warn_on_degenerate_diagnostics(self, mode: str, counter_key: str, message: str) -> None:
        interval = self.args.diagnostics_warning_interval
        if interval == 0:
            return
        self._diagnostic_counters[mode][counter_key] += 1
        count = self._diagnostic_counters[mode][counter_key]
        if count == 1 or count % interval == 0:
            logger.warning("%s Consecutive degenerate steps: %s.", message, count)

    # -- the self-distillation component's attributes (TRL's names) ---------------------------------------------
    @property
    def teacher_model(self) -> torch.nn.Module:
        """TRL's attribute: the separate teacher module, or the student itself (``live``, or PEFT adapters)."""
        return self.self_distillation.teacher_model

    @property
    def served_teacher(self) -> Any:
        """The teacher-server client (``use_teacher_server``; None until the first loss)."""
        return self.self_distillation.served_teacher

    # -- checkpoints -------------------------------------------------------------------------------------------
    def resume_state_dict(self) -> dict[str, Any]:
        """Adds an EMA teacher's weights (so a resumed run continues the same average)."""
        return {**super().resume_state_dict(), **self.self_distillation.state_dict()}

    def load_resume_state_dict(self, state: dict[str, Any]) -> None:
        super().load_resume_state_dict(state)
        self.self_distillation.load_state_dict(state)
