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
mode stays chunked, ``rollout.distillation.token_divergence``); sampler, buffer (``steps_per_generation`` ×
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

Differences from TRL: the ``base`` / ``ema`` teacher copy is a deep copy of the student (TRL reloads it from the
model path); an EMA teacher's weights are saved in checkpoints (``posttrain_state_*.pt``), so a resumed run continues
the same average (TRL restarts it); vLLM generation and the posttrain generation backends are the shared online ones;
no VLMs.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core.distill import sparse_support_divergence
from posttrain.core.logprobs import chunked_logprobs_from_hidden, selective_log_softmax
from posttrain.core.self_distillation import (
    apply_importance_sampling_clipping,
    compute_topk_self_distillation_loss,
    sampled_token_self_distillation_loss_from_logps,
    self_distillation_loss,
)
from posttrain.experimental._distill_support import ServedTeacher, loss_token_log_probs, to_rows
from posttrain.experimental.sdft.sdft_config import SDFTConfig
from posttrain.models.completion_scoring import choose_shared_prompt_layout, completion_inputs
from posttrain.models.distillation_scoring import DistillationScores, score_distillation_completions
from posttrain.models.reference import ReferencePolicy
from posttrain.models.teacher_sync import SyncTeacherModelCallback, create_teacher
from posttrain.reliability.validation import check_datasets
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.distillation import DistillationRollout, model_vocab_size, token_divergence
from posttrain.rollout.pipeline import render_prompts
from posttrain.trainers.online import OnlineTrainerBase

__all__ = [
    "SDFTTrainer",
    "SelfDistillationRollout",
    "check_self_distillation_columns",
    "compose_teacher_prompt",
]

REQUIRED_COLUMNS = ("prompt", "privileged_context")


# ----------------------------------------------------------------------------------------------------------------
# The teacher prompt
# ----------------------------------------------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
    return str(content)


def stringify_privileged_context(privileged_context: Any, index: int | None = None) -> str:
    """``privileged_context`` as text: a string as is, a list of messages as their contents joined by newlines."""
    if privileged_context is None:
        where = f" (row {index})" if index is not None else ""
        raise ValueError(
            f"`privileged_context` must not be None for self-distillation teacher prompt construction{where}: give "
            "every row the teacher-only information (e.g. a demonstration) as a string."
        )
    if isinstance(privileged_context, str):
        return privileged_context
    if isinstance(privileged_context, list) and privileged_context and isinstance(privileged_context[0], dict):
        return "\n".join(t for t in (_text_of(m.get("content", "")) for m in privileged_context) if t)
    return str(privileged_context)


def compose_teacher_prompt(prompt: Any, privileged_context: Any, template: str, index: int | None = None) -> Any:
    """The teacher's prompt: ``template.format(prompt=..., privileged_context=...)``.

    A conversational prompt keeps its earlier messages and gets its last (user) turn replaced by the filled
    template over that turn's text; prompts ending with another role are refused (TRL).
    """
    privileged = stringify_privileged_context(privileged_context, index)
    if isinstance(prompt, list):
        if not prompt or prompt[-1].get("role") != "user":
            role = prompt[-1].get("role") if prompt else None
            raise ValueError(
                "Self-distillation teacher prompt construction expects the conversation to end with a user turn, "
                f"but the last message has role '{role}'. Prompts ending with assistant prefills or tool turns are "
                "not supported."
            )
        text = template.format(prompt=_text_of(prompt[-1].get("content", "")), privileged_context=privileged)
        return [*prompt[:-1], {"role": "user", "content": text}]
    return template.format(prompt=prompt, privileged_context=privileged)


def check_self_distillation_columns(dataset: Any, name: str) -> None:
    """Fail at init when ``dataset`` lacks ``prompt`` or ``privileged_context`` (naming the column and the fix)."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for key, split in dataset.items():
            check_self_distillation_columns(split, f"{name}[{key!r}]")
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return  # a stream without declared features: checked row by row
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise ValueError(
            f"{name} is missing the column(s) {missing} (columns: {sorted(columns)}). SDFT needs a 'prompt' column "
            "(what the student sees) and a 'privileged_context' column (the teacher-only information, e.g. a "
            "demonstration, combined with the prompt by `teacher_prompt_template`); add it, e.g. "
            "dataset.add_column('privileged_context', [...]) or dataset.rename_column('<your column>', "
            "'privileged_context')."
        )


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
        """Each row with its ``prompt`` replaced by the teacher prompt (:func:`compose_teacher_prompt`)."""
        out = []
        for i, row in enumerate(rows):
            if "privileged_context" not in row:
                raise ValueError(
                    f"Row {i} has no 'privileged_context' (columns: {sorted(row)}); SDFT builds the teacher prompt "
                    "from 'prompt' + 'privileged_context'. Add the column to the dataset."
                )
            teacher = compose_teacher_prompt(row["prompt"], row["privileged_context"], self.teacher_prompt_template, i)
            out.append({**row, "prompt": teacher})
        return out

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


def _trim_left(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading columns that are padding in every row (a micro-batch of a left-padded round)."""
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if used.numel() else max(mask.shape[1] - 1, 0)
    return ids[:, start:], mask[:, start:]


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
    _trainer_name = "SDFT"
    _tag_names = ["posttrain", "sdft"]
    # Tokens per chunk of the full-logit divergence (None: chosen from the vocabulary, as DistillationTrainer).
    loss_chunk_size: int | None = None
    served_teacher: ServedTeacher | None = None  # the teacher-server client (use_teacher_server), made on first use

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
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        check_datasets(train_dataset, eval_dataset)
        check_self_distillation_columns(train_dataset, "train_dataset")
        check_self_distillation_columns(eval_dataset, "eval_dataset")
        model, processing_class = self._setup_policy(model, args, processing_class, peft_config)
        # Before the Trainer wraps the model (and before the optimizer exists): the copy / the "teacher" adapter.
        self.teacher = create_teacher(
            model,
            args.teacher_model_kind,
            teacher_update_rate=args.teacher_update_rate,
            teacher_sync_steps=args.teacher_sync_steps,
        )
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

    @property
    def teacher_model(self) -> torch.nn.Module:
        """TRL's attribute: the separate teacher module, or the student itself (``live``, or PEFT adapters)."""
        return self.teacher.model if self.teacher.model is not None else self.model

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
        self._dispatch_self_distillation_callback(
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
        self._dispatch_self_distillation_callback(
            "on_self_distillation_batch_prepared",
            old_per_token_logps=batch.get("old_per_token_logps"),
            prompt_ids=batch["prompt_ids"],
            completion_ids=batch["completion_ids"],
            teacher_input_ids=torch.cat([batch["teacher_prompt_ids"], batch["completion_ids"]], dim=1),
            teacher_attention_mask=torch.cat([batch["teacher_prompt_mask"], batch["completion_mask"]], dim=1),
        )
        if mode == "train":
            self._dispatch_self_distillation_callback(
                "on_generation_batch_built",
                generate_every=self.args.steps_per_generation * self.args.num_iterations,
                steps_per_generation=self.args.steps_per_generation,
            )
        return batch

    def _dispatch_self_distillation_callback(self, event_name: str, **payload: Any) -> None:
        """TRL's self-distillation callback events: each callback that defines ``event_name`` is called with
        ``args``, ``state``, ``control``, ``model``, ``processing_class`` and the payload (``on_generation_prompts_selected``,
        ``on_self_distillation_batch_prepared``, ``on_generation_batch_built``)."""
        for callback in self.callback_handler.callbacks:
            handler = getattr(callback, event_name, None)
            if handler is not None:
                handler(
                    args=self.args, state=self.state, control=self.control, model=self.model,
                    processing_class=self.processing_class, **payload,
                )  # fmt: skip

    # -- loss --------------------------------------------------------------------------------------------------
    def _scoring_inputs(self, model: torch.nn.Module, inputs: RolloutBatch) -> tuple:
        """``score_distillation_completions`` arguments (the shared-prompt layout when it saves work)."""
        targets = (inputs["completion_ids"], inputs["completion_mask"])
        layout = choose_shared_prompt_layout(model, inputs) if self.args.shared_prompt_forward else None
        if layout is not None:
            predictors = layout.predictor_index(inputs["completion_mask"])
            return layout.input_ids, layout.attention_mask, layout.position_ids, *targets, predictors
        input_ids, attention_mask, position_ids, _ = completion_inputs(inputs)
        return input_ids, attention_mask, position_ids, *targets

    def _loss_mask(self, inputs: RolloutBatch) -> torch.Tensor:
        mask = inputs["completion_mask"]
        skip = self.args.num_loss_tokens_to_skip
        if skip > 0:  # SDFT skips the first completion tokens to suppress teacher-prompt artifacts
            positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
            mask = mask * (positions >= skip).to(mask.dtype)
        return mask

    def _token_logps(self, scores: DistillationScores) -> torch.Tensor:
        """``(N,)`` log-probs of the loss tokens (temperature applied), differentiable, without ``N × V`` logits."""
        rows, temperature = self.vocab_rows, self.args.temperature
        if scores.hidden is not None:
            weight, bias = scores.head(rows)
            logps, _ = chunked_logprobs_from_hidden(
                scores.hidden, weight, scores.tokens, bias=bias, temperature=temperature,
                chunk_size=self._loss_chunk_size(),
            )  # fmt: skip
            return logps
        return selective_log_softmax(scores.logits[:, :rows].float() / temperature, scores.tokens)

    def _per_token_loss(self, student: DistillationScores, teacher: DistillationScores) -> tuple[torch.Tensor, Any]:
        """``(N,)`` per-token loss of ``distillation_mode`` and a thunk giving the student's token log-probs."""
        args = self.args
        mode = args.distillation_mode
        if mode == "topk_logits":
            student_lp = loss_token_log_probs(student, self.vocab_rows, args.temperature)  # (N, V)
            with torch.no_grad():
                teacher_lp = loss_token_log_probs(teacher, self.vocab_rows, args.temperature)
            # log-softmax values are valid logits: the top-k support and the gathered log-probs are unchanged.
            per_token = compute_topk_self_distillation_loss(
                student_lp, teacher_lp, distillation_topk=args.distillation_topk,
                distillation_alpha=args.distillation_alpha, distillation_add_tail=args.distillation_add_tail,
            )  # fmt: skip
            return per_token, lambda: student_lp.gather(-1, student.tokens[:, None]).squeeze(-1)
        if mode == "full_logits":
            per_token, _ = token_divergence(
                student, teacher, vocab_rows=self.vocab_rows, beta=args.distillation_alpha,
                temperature=args.temperature, chunk_size=self._loss_chunk_size(),
            )  # fmt: skip
            return per_token, lambda: self._token_logps(student)
        student_logps = self._token_logps(student)
        with torch.no_grad():
            teacher_logps = self._token_logps(teacher)
        per_token = sampled_token_self_distillation_loss_from_logps(
            student_logps, teacher_logps, distillation_alpha=args.distillation_alpha
        )
        return per_token, lambda: student_logps

    def _teacher_server(self) -> ServedTeacher:
        if self.served_teacher is None:
            base_url = getattr(self.backend, "base_url", None)
            if base_url is None:
                args = self.args
                base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
            self.served_teacher = ServedTeacher(base_url, self.vocab_rows, float(self.args.vllm_server_timeout))
        return self.served_teacher

    def _served_per_token_loss(
        self, student: DistillationScores, teacher_inputs: RolloutBatch, mode: str
    ) -> tuple[torch.Tensor, Any]:
        """The live teacher's log-probs from the generation server (``use_teacher_server``): the sampled token's for
        ``sampled_token``, the teacher's own top-k support for ``topk_logits`` (renormalised or with the tail)."""
        args = self.args
        if self.state.global_step != self._last_synced_step:  # a reused rollout: the server must hold θ now
            self.backend.sync_weights(self.accelerator.unwrap_model(self.model))
            self._last_synced_step = self.state.global_step
        top_k = args.distillation_topk if args.distillation_mode == "topk_logits" else 1
        served = self._teacher_server().score(teacher_inputs, top_k, args.temperature)  # (N,), (N, K)
        actual = served["actual_logprobs"]
        if args.distillation_mode == "sampled_token":
            student_logps = self._token_logps(student)
            per_token = sampled_token_self_distillation_loss_from_logps(
                student_logps, actual, distillation_alpha=args.distillation_alpha
            )
        else:
            student_lp = loss_token_log_probs(student, self.vocab_rows, args.temperature)  # (N, V)
            ids, teacher_lp = served["topk_token_ids"], served["topk_logprobs"]
            per_token = sparse_support_divergence(
                student_lp.gather(-1, ids), teacher_lp, torch.isfinite(teacher_lp), beta=args.distillation_alpha,
                add_tail=args.distillation_add_tail,
            )  # fmt: skip
            student_logps = student_lp.gather(-1, student.tokens[:, None]).squeeze(-1)
        # Disagreement of the local student and the served teacher on the realized tokens (stale weights, drift).
        diff = (student_logps.detach() - actual).abs()
        self.record_metric(
            "self_distillation/server_logprob_abs_diff",
            self._gather_mean(diff.mean() if diff.numel() else diff.new_zeros(())),
            mode=mode,
        )
        return per_token, lambda: student_logps

    def _compute_loss(self, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        """mean over completions of (Σ_t loss_t / loss tokens), divided by the gradient-accumulation steps."""
        args = self.args
        mode = self._mode()
        loss_mask = self._loss_mask(inputs)
        student_inputs = {**inputs, "completion_mask": loss_mask}
        teacher_ids, teacher_mask = _trim_left(inputs["teacher_prompt_ids"], inputs["teacher_prompt_mask"])
        teacher_inputs = {**student_inputs, "prompt_ids": teacher_ids, "prompt_mask": teacher_mask}
        student = score_distillation_completions(model, *self._scoring_inputs(model, student_inputs))
        if args.use_teacher_server:
            per_token, student_token_logps = self._served_per_token_loss(student, teacher_inputs, mode)
        else:
            with torch.no_grad(), self.teacher.activate(model) as teacher_module:
                teacher = score_distillation_completions(
                    teacher_module, *self._scoring_inputs(teacher_module, teacher_inputs)
                )
            per_token, student_token_logps = self._per_token_loss(student, teacher)  # (N,)
        old = inputs.get("old_per_token_logps")
        if args.distillation_is_clip is not None and old is not None and per_token.numel():
            per_token = apply_importance_sampling_clipping(
                per_token, student_token_logps(), old[loss_mask.bool()], args.distillation_is_clip
            )
        if per_token.numel() == 0:
            # No loss token anywhere: a zero that still reaches every parameter (backward and DDP hooks run).
            loss = 0.0 * sum(p.sum() for p in model.parameters() if p.requires_grad)
            mean = per_token.new_zeros(())
        else:
            loss = self_distillation_loss(to_rows(per_token, loss_mask), loss_mask)
            mean = per_token.detach().mean()
        loss = self._finish_loss(loss, student.aux_loss)
        value = self._gather_mean(mean)
        self.record_metric("self_distillation/distillation_loss", value, mode=mode)
        self.record_metric(f"{self._trainer_name.lower()}/distillation_loss", value, mode=mode)
        return loss

    def _loss_chunk_size(self) -> int:
        """Tokens per chunk: about 2**24 logits per chunk, between 16 and 1024 tokens (as DistillationTrainer)."""
        if self.loss_chunk_size is not None:
            return int(self.loss_chunk_size)
        return min(1024, max(16, 2**24 // self.vocab_rows))

    # -- checkpoints -------------------------------------------------------------------------------------------
    def resume_state_dict(self) -> dict[str, Any]:
        """Adds the rollout's RNG and an EMA teacher's weights (so a resumed run continues the same average)."""
        state = {**super().resume_state_dict(), "distillation_rollout": self.rollout.state_dict()}
        teacher = self.teacher.state_dict(self.model)
        if teacher:
            state["ema_teacher"] = teacher
        return state

    def load_resume_state_dict(self, state: dict[str, Any]) -> None:
        super().load_resume_state_dict(state)
        if "distillation_rollout" in state:
            self.rollout.load_state_dict(state["distillation_rollout"])
        if "ema_teacher" in state:
            self.teacher.load_state_dict(state["ema_teacher"], self.model)
