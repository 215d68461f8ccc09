"""``SDFTTrainer``: Self-Distilled Fine-Tuning (Shenfeld et al., "Self-Distillation Enables Continual Learning",
https://huggingface.co/papers/2601.19897) with TRL's ``trl.experimental.sdft`` API.

On-policy self-distillation: the student samples completions from each row's ``prompt``; the *teacher* — the same
network (``teacher_model_kind``: its initial weights, its live weights, or an EMA of them;
:mod:`posttrain.models.teacher_sync`) — scores those same completions conditioned on a teacher prompt built from
``prompt`` and the row's ``privileged_context`` (``teacher_prompt_template``); the student is distilled toward the
teacher's next-token distributions on the completion tokens (:mod:`posttrain.core.self_distillation`: top-k,
full-vocabulary or sampled-token loss, with TRL's clipped importance ratio when a rollout outlives an optimizer
step).

Built from posttrain's distillation parts: the round is :class:`~posttrain.rollout.distillation.DistillationRollout`
(fully on-policy) plus the teacher prompts (:class:`SelfDistillationRollout`); both models are scored at the loss
tokens by ``models.distillation_scoring.score_distillation_completions`` (no ``(B, T, V)`` logits; the full-logit
mode stays chunked, ``models.distillation_scoring.token_divergence``); sampler, buffer (``steps_per_generation`` ×
``num_iterations``), generation backends and checkpoints are the online-RL base's.

Loss: per completion, the mean per-token loss over its loss tokens (``completion_mask`` minus the first
``num_loss_tokens_to_skip``), then the mean over completions, divided by the gradient-accumulation steps (TRL).

Callbacks may define TRL's self-distillation events ``on_generation_prompts_selected``,
``on_self_distillation_batch_prepared`` and ``on_generation_batch_built`` (called with TRL's payloads).

Metrics (TRL's names): ``loss``, ``self_distillation/distillation_loss`` and ``sdft/distillation_loss`` (mean
per-token loss of the micro-batch), ``completions/mean_length``, ``/min_length``, ``/max_length``,
``/clipped_ratio``, ``/mean_terminated_length``, ``/min_terminated_length``, ``/max_terminated_length``; plus
posttrain's ``num_tokens``, ``step_time``, ``timing/*``.

``use_teacher_server`` (live teacher only) reads the teacher's log-probs from the generation server
(``_distill_support.ServedTeacher``: ``POST /get_sequence_logprobs/`` on ``[teacher prompt | completion]``) and
logs ``self_distillation/server_logprob_abs_diff``.

The teacher prompt, the scoring of both sides and the per-token term live in
:mod:`posttrain.experimental._self_distillation` (the ``SelfDistillation`` component the trainer delegates to,
``self.self_distillation``, shared with SDPO); this module adds the round, the config and SDFT's aggregation.

Differences from TRL: a student given as a module gets a deep copy as its ``base`` / ``ema`` teacher (one given by
path is loaded again from it, as TRL does); an EMA teacher's weights are saved in checkpoints
(``posttrain_state_*.pt``), so a resumed run continues the same average (TRL restarts it); vLLM generation and the
posttrain generation backends are the shared online ones; no VLMs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from posttrain.core.self_distillation import self_distillation_loss
from posttrain.experimental._distill_support import to_rows
from posttrain.experimental._self_distillation import (
    SelfDistillation,
    check_self_distillation_columns,
    compose_teacher_prompt,
    teacher_prompt_rows,
)
from posttrain.experimental.sdft.sdft_config import SDFTConfig
from posttrain.models.loading import disable_dropout_in_model
from posttrain.models.peft_utils import is_peft_model
from posttrain.models.reference import ReferencePolicy
from posttrain.models.teacher_sync import SyncTeacherModelCallback, create_teacher
from posttrain.models.vocabulary import model_vocab_size
from posttrain.reliability.validation import check_datasets
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.distillation import DistillationRollout
from posttrain.rollout.pipeline import render_prompts
from posttrain.trainers.online import OnlineTrainerBase

__all__ = ["SDFTTrainer", "SelfDistillationRollout", "check_self_distillation_columns", "compose_teacher_prompt"]


def _left_pad(rows: list[list[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0) or 1
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids, mask


class SelfDistillationRollout(DistillationRollout):
    """A fully on-policy :class:`DistillationRollout` whose batch also holds each row's teacher prompt.

    Adds ``teacher_prompt_ids`` / ``teacher_prompt_mask`` ``(B, P_T)`` (left-padded, cut to
    ``max_prompt_length`` like the student's). With ``generate_from_teacher`` the completions are sampled from the
    teacher prompts and the batch's ``prompt_ids`` are the student's.
    """

    def __init__(self, *, teacher_prompt_template: str, generate_from_teacher: bool = False, **kwargs: Any):
        super().__init__(lmbda=1.0, seq_kd=False, **kwargs)
        self.teacher_prompt_template = teacher_prompt_template
        self.generate_from_teacher = generate_from_teacher

    def teacher_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each row with its ``prompt`` replaced by the teacher prompt (:func:`teacher_prompt_rows`)."""
        return teacher_prompt_rows(rows, self.teacher_prompt_template)

    def _prompt_tensors(self, rows: list[dict[str, Any]], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        _, rendered = render_prompts(rows, self.tokenizer, self.chat_template_kwargs)
        ids, mask = _left_pad([self._truncate_prompt(r) for r in rendered], self.pad_token_id)
        return ids.to(device), mask.to(device)

    def run(self, rows: list[dict[str, Any]], **kwargs: Any) -> RolloutBatch:
        """The distillation round (student samples) plus ``teacher_prompt_ids`` / ``teacher_prompt_mask``."""
        device = kwargs.get("device", "cpu")
        teacher_rows = self.teacher_rows(rows)
        if self.generate_from_teacher:
            batch = super().run(teacher_rows, **kwargs)
            batch["teacher_prompt_ids"], batch["teacher_prompt_mask"] = batch["prompt_ids"], batch["prompt_mask"]
            batch["prompt_ids"], batch["prompt_mask"] = self._prompt_tensors(rows, device)
        else:
            batch = super().run(rows, **kwargs)
            batch["teacher_prompt_ids"], batch["teacher_prompt_mask"] = self._prompt_tensors(teacher_rows, device)
        return batch


# ----------------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------------


class SDFTTrainer(OnlineTrainerBase):
    """Self-Distilled Fine-Tuning with TRL's ``SDFTTrainer(model, args, train_dataset, ...)`` signature.

    Args:
        model: The student: hub id / local path (loaded with ``args.model_init_kwargs``), a causal LM, or a
            ``PeftModel``. It is also the teacher (``args.teacher_model_kind``).
        args: :class:`SDFTConfig`; None → defaults with ``output_dir=f"{model_name}-SDFT"``.
        train_dataset: Rows with ``prompt`` (text or messages) and ``privileged_context`` (text, or messages whose
            contents are joined); iterable datasets are accepted.
        eval_dataset: Same format (or a dict of them).
        processing_class: The student's tokenizer (left padding and truncation are set); None → loaded from it.
        callbacks / optimizers: As ``transformers.Trainer``.
        peft_config: Wraps the student (LoRA). ``base`` is then the model with adapters disabled; ``ema`` needs a
            pure-LoRA student (a zero-initialised ``"teacher"`` adapter tracks the student's).
    """

    config_class = SDFTConfig
    shuffles_generation_batch = False  # TRL's SDFT splits its generation batch unshuffled
    _trainer_name = "SDFT"
    _tag_names = ["posttrain", "sdft"]
    # Tokens per chunk of the chunked divergence / log-probs (None: about 2**24 logits per chunk).
    loss_chunk_size: int | None = None

    def __init__(
        self,
        model: str | torch.nn.Module,
        args: SDFTConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
    ):
        args = self.resolve_args(args, model, self.config_class, self._trainer_name)
        self.self_distillation = SelfDistillation(self)  # the teacher term, its callback events and EMA state
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        check_datasets(train_dataset, eval_dataset)
        check_self_distillation_columns(train_dataset, "train_dataset")
        check_self_distillation_columns(eval_dataset, "eval_dataset")
        model_id = model if isinstance(model, str) else None
        model, processing_class = self._setup_policy(model, args, processing_class, peft_config)
        if peft_config is None and is_peft_model(model) and args.teacher_model_kind == "base":
            warnings.warn(
                "The provided self-distillation student model already contains a PEFT adapter. With "
                "teacher_model_kind='base' the teacher is its base weights (adapters disabled), not the initially "
                "loaded student including its adapter. For an unambiguous teacher, start from a merged/non-adapter "
                "model.",
                UserWarning,
                stacklevel=2,
            )
        # Before the Trainer wraps the model (and before the optimizer exists): the copy / the "teacher" adapter. A
        # student given by path gets its copy loaded again from it (TRL; a deep copy of ZeRO-3 shards would be empty).
        self.teacher = create_teacher(
            model,
            args.teacher_model_kind,
            teacher_update_rate=args.teacher_update_rate,
            teacher_sync_steps=args.teacher_sync_steps,
            reload_from=model_id,
            model_init_kwargs=dict(args.model_init_kwargs or {}),
        )
        if self.teacher.model is not None and args.disable_dropout:
            disable_dropout_in_model(self.teacher.model)
        self.vocab_rows = model_vocab_size(model)
        n_rows = self._configure_train_dataset(train_dataset, args)
        prompts_per_round = args.generation_batch_size // args.num_generations
        if n_rows is not None and n_rows < prompts_per_round:
            raise ValueError(
                f"train_dataset has {n_rows} prompts but one generation round needs generation_batch_size / "
                f"num_generations = {args.generation_batch_size} / {args.num_generations} = {prompts_per_round}; "
                "add prompts or lower per_device_train_batch_size / steps_per_generation."
            )
        self.agent = None
        self.reward_funcs = []
        self.reference = ReferencePolicy("none")
        self._init_trainer(model, args, train_dataset, eval_dataset, processing_class, callbacks, optimizers)
        self.teacher.prepare(self.accelerator)
        if self.teacher.kind == "ema":
            self.add_callback(SyncTeacherModelCallback(self.teacher, self.accelerator))
        self._setup_rollout(None)

    def _make_rollout(self) -> None:
        args = self.args
        self.rollout = SelfDistillationRollout(
            teacher_prompt_template=args.teacher_prompt_template,
            generate_from_teacher=args.generate_from_teacher,
            tokenizer=self.processing_class,
            student_backend=self.backend,
            sampling=self.sampling,
            num_generations=args.num_generations,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            pad_to_multiple_of=args.pad_to_multiple_of,
            mask_truncated_completions=args.mask_truncated_completions,
            chat_template_kwargs=args.chat_template_kwargs,
            keep_completions=args.log_completions,
            seed=args.seed,
            accelerator=self.accelerator,
        )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "privileged_context", "chat_template_kwargs"]

    # -- the round ---------------------------------------------------------------------------------------------
    def _generate_and_score(self, rows: list[dict[str, Any]], mode: str) -> RolloutBatch:
        """Student samples and teacher prompts; π_old's log-probs when the batch outlives one optimizer step."""
        if self.state.global_step != self._last_synced_step:
            self.backend.sync_weights(self.accelerator.unwrap_model(self.model))
            self._last_synced_step = self.state.global_step
        generating = self.rollout.teacher_rows(rows) if self.args.generate_from_teacher else rows
        self.self_distillation.dispatch(
            "on_generation_prompts_selected",
            generation_prompts=[row["prompt"] for row in generating],
            generation_prompt_text=None,
        )
        batch = self.rollout.run(
            rows, num_slices=1, mode=mode, device=self.accelerator.device, record=self._record(mode)
        )
        if self.rollout.last_completions is not None:
            self._pending_completions = self.rollout.last_completions
        # TRL: π_old only when it can differ from π_θ, and not for teacher-prompted samples (another policy).
        if mode == "train" and self._needs_old_logps() and not self.args.generate_from_teacher:
            with torch.no_grad():
                batch["old_per_token_logps"] = self._token_stats(self.model, batch).logps
        self.self_distillation.announce_batch(
            batch,
            mode,
            teacher_input_ids=torch.cat([batch["teacher_prompt_ids"], batch["completion_ids"]], dim=1),
            teacher_attention_mask=torch.cat([batch["teacher_prompt_mask"], batch["completion_mask"]], dim=1),
        )
        return batch

    # -- loss --------------------------------------------------------------------------------------------------
    def _compute_loss(self, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        """mean over completions of (Σ_t loss_t / loss tokens), divided by the gradient-accumulation steps."""
        mode = self._mode()
        per_token, loss_mask, student = self.self_distillation.per_token(model, inputs)  # (N,), (B, C)
        if per_token.numel() == 0:
            # No loss token anywhere: a zero that still reaches every parameter (backward and DDP hooks run).
            loss = 0.0 * sum(p.sum() for p in model.parameters() if p.requires_grad)
        else:
            loss = self_distillation_loss(to_rows(per_token, loss_mask), loss_mask)
        loss = self._finish_loss(loss, student.aux_loss)
        # the mean over the loss tokens of every process (0 when there are none anywhere)
        value = self._global_masked_mean(per_token.detach(), torch.ones_like(per_token))
        self.record_metric("self_distillation/distillation_loss", value, mode=mode)
        self.record_metric(f"{self._trainer_name.lower()}/distillation_loss", value, mode=mode)
        return loss

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
        """Adds an EMA teacher's weights (so a resumed run continues the same average) and the rollout's RNG."""
        state = {**super().resume_state_dict(), **self.self_distillation.state_dict()}
        return {**state, "distillation_rollout": self.rollout.state_dict()}

    def load_resume_state_dict(self, state: dict[str, Any]) -> None:
        super().load_resume_state_dict(state)
        self.self_distillation.load_state_dict(state)
        if "distillation_rollout" in state:
            self.rollout.load_state_dict(state["distillation_rollout"])
