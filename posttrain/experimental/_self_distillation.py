"""What the self-distillation trainers (SDFT, and SDPO on GRPO) share: the teacher prompt built from a row's
``prompt`` and ``privileged_context``, and the self-distillation term scored at the loss tokens.

:class:`SelfDistillation` is a component the trainer owns and delegates to (``self.self_distillation =
SelfDistillation(self)``; SDFT's loss is its per-token term, SDPO's loss strategy mixes it with GRPO's). It reads the
trainer's ``args`` (TRL's ``distillation_mode`` / ``distillation_alpha`` / ``distillation_topk`` /
``distillation_add_tail`` / ``distillation_is_clip`` / ``num_loss_tokens_to_skip`` / ``temperature`` /
``use_teacher_server`` fields), ``teacher`` (a :class:`~posttrain.models.teacher_sync.SelfDistillationTeacher`),
``vocab_rows``, ``loss_chunk_size`` and, with ``use_teacher_server``, ``backend`` / ``_last_synced_step`` (the online
base's); a micro-batch holds the online-RL layout (``prompt_ids`` / ``prompt_mask`` / ``completion_ids`` /
``completion_mask`` / ``completion_lengths``) plus ``teacher_prompt_ids`` / ``teacher_prompt_mask`` (left-padded)
and, when the rollout outlives an optimizer step, ``old_per_token_logps``. :meth:`SelfDistillation.per_token` returns
the per-token loss at the ``N`` loss tokens; aggregation is the trainer's. It also dispatches TRL's
self-distillation callback events and holds the EMA teacher's checkpoint state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from posttrain.core.distill import chunked_token_map, sparse_support_divergence
from posttrain.core.logprobs import chunked_logprobs_from_hidden, selective_log_softmax
from posttrain.core.self_distillation import (
    apply_importance_sampling_clipping,
    compute_topk_self_distillation_loss,
    sampled_token_self_distillation_loss_from_logps,
)
from posttrain.experimental._distill_support import ServedTeacher
from posttrain.models.distillation_scoring import DistillationScores, score_distillation_completions, token_divergence
from posttrain.rollout.buffer import RolloutBatch
from posttrain.trainers.distillation import distillation_scoring_inputs, loss_chunk_size_for

__all__ = [
    "REQUIRED_COLUMNS",
    "SelfDistillation",
    "check_self_distillation_columns",
    "compose_teacher_prompt",
    "fill_teacher_prompt",
    "last_user_text",
    "stringify_privileged_context",
    "teacher_prompt_rows",
    "trim_left_padding",
]

REQUIRED_COLUMNS = ("prompt", "privileged_context")


# ----------------------------------------------------------------------------------------------------------------
# The teacher prompt
# ----------------------------------------------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
    return str(content)


def last_user_text(messages: list[dict[str, Any]]) -> str:
    """The text of a conversational prompt's final user turn (text parts of a list content joined by spaces); a
    conversation ending with another role (an assistant prefill, a tool turn) is refused, as TRL does."""
    if not messages or messages[-1].get("role") != "user":
        role = messages[-1].get("role") if messages else None
        raise ValueError(
            "Self-distillation teacher prompt construction expects the conversation to end with a user turn, "
            f"but the last message has role '{role}'. Prompts ending with assistant prefills or tool turns are "
            "not supported."
        )
    return _text_of(messages[-1].get("content", ""))


def fill_teacher_prompt(prompt: Any, template: str, **fields: Any) -> Any:
    """The teacher-prompt builder of SDFT and SDPO: ``template.format(prompt=..., **fields)``.

    A text prompt is formatted as is; a conversational prompt keeps its earlier messages and gets its last (user)
    turn replaced by the filled template over that turn's text (:func:`last_user_text`). SDFT's fields are
    ``privileged_context`` (:func:`compose_teacher_prompt`), SDPO's re-prompt ``solution`` and ``feedback``
    (``sdpo.teacher_context``).
    """
    if isinstance(prompt, list):
        text = template.format(prompt=last_user_text(prompt), **fields)
        return [*prompt[:-1], {"role": "user", "content": text}]
    return template.format(prompt=prompt, **fields)


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
    """SDFT's teacher prompt: ``template.format(prompt=..., privileged_context=...)`` (:func:`fill_teacher_prompt`;
    ``privileged_context`` as text, :func:`stringify_privileged_context`)."""
    privileged = stringify_privileged_context(privileged_context, index)
    return fill_teacher_prompt(prompt, template, privileged_context=privileged)


def teacher_prompt_rows(rows: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """Each row with its ``prompt`` replaced by its teacher prompt (:func:`compose_teacher_prompt` of its
    ``prompt`` and ``privileged_context``); a row without ``privileged_context`` is an error naming it."""
    out = []
    for i, row in enumerate(rows):
        if "privileged_context" not in row:
            raise ValueError(
                f"Row {i} has no 'privileged_context' (columns: {sorted(row)}); the teacher prompt is built from "
                "'prompt' + 'privileged_context'. Add the column to the dataset."
            )
        out.append({**row, "prompt": compose_teacher_prompt(row["prompt"], row["privileged_context"], template, i)})
    return out


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
            f"{name} is missing the column(s) {missing} (columns: {sorted(columns)}). Self-distillation needs a "
            "'prompt' column (what the student sees) and a 'privileged_context' column (the teacher-only information, e.g. a "
            "demonstration, combined with the prompt by `teacher_prompt_template`); add it, e.g. "
            "dataset.add_column('privileged_context', [...]) or dataset.rename_column('<your column>', "
            "'privileged_context')."
        )


def trim_left_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading columns that are padding in every row (a micro-batch of a left-padded round)."""
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if used.numel() else max(mask.shape[1] - 1, 0)
    return ids[:, start:], mask[:, start:]


class SelfDistillation:
    """The self-distillation term of a trainer whose student is its own teacher: a component the trainer owns
    (``trainer.self_distillation = SelfDistillation(trainer)``) and delegates to (see the module docstring).

    It keeps the served-teacher client (made on first use) and reads the rest from its trainer, as
    :class:`~posttrain.rollout.async_worker.AsyncRollout` does.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.served_teacher: ServedTeacher | None = None  # the teacher-server client (use_teacher_server)

    @property
    def args(self) -> Any:
        return self.trainer.args

    @property
    def teacher_model(self) -> torch.nn.Module:
        """TRL's attribute: the separate teacher module, or the student itself (``live``, or PEFT adapters)."""
        trainer = self.trainer
        return trainer.teacher.model if trainer.teacher.model is not None else trainer.model

    # -- helpers shared with the distillation trainers ----------------------------------------------------------
    def scoring_inputs(self, model: torch.nn.Module, inputs: RolloutBatch) -> tuple:
        """``score_distillation_completions`` arguments for ``model`` (the shared-prompt layout when it saves
        work)."""
        return distillation_scoring_inputs(model, inputs, self.args.shared_prompt_forward)

    def loss_chunk_size(self) -> int:
        """Tokens per chunk of the chunked divergence / log-probs: the trainer's ``loss_chunk_size`` when set, else
        about 2**24 logits per chunk."""
        return loss_chunk_size_for(self.trainer.vocab_rows, self.trainer.loss_chunk_size)

    # -- TRL's callback events ------------------------------------------------------------------------------------
    def dispatch(self, event_name: str, **payload: Any) -> None:
        """TRL's self-distillation callback events: each callback that defines ``event_name`` is called with
        ``args``, ``state``, ``control``, ``model``, ``processing_class`` and the payload
        (``on_generation_prompts_selected``, ``on_self_distillation_batch_prepared``, ``on_generation_batch_built``,
        SDPO's ``on_teacher_context_built``)."""
        trainer = self.trainer
        for callback in trainer.callback_handler.callbacks:
            handler = getattr(callback, event_name, None)
            if handler is not None:
                handler(
                    args=trainer.args, state=trainer.state, control=trainer.control, model=trainer.model,
                    processing_class=trainer.processing_class, **payload,
                )  # fmt: skip

    def announce_batch(self, batch: RolloutBatch, mode: str, **teacher: torch.Tensor) -> None:
        """TRL's ``on_self_distillation_batch_prepared`` (the student/teacher inputs) and, in training,
        ``on_generation_batch_built`` events for a finished rollout batch."""
        self.dispatch(
            "on_self_distillation_batch_prepared",
            old_per_token_logps=batch.get("old_per_token_logps"),
            prompt_ids=batch["prompt_ids"],
            completion_ids=batch["completion_ids"],
            **teacher,
        )
        if mode == "train":
            self.dispatch(
                "on_generation_batch_built",
                generate_every=self.args.steps_per_generation * self.args.num_iterations,
                steps_per_generation=self.args.steps_per_generation,
            )

    # -- the self-distillation term -------------------------------------------------------------------------
    def loss_mask(self, inputs: RolloutBatch) -> torch.Tensor:
        """``completion_mask`` minus the first ``num_loss_tokens_to_skip`` tokens of each completion."""
        mask = inputs["completion_mask"]
        skip = self.args.num_loss_tokens_to_skip
        if skip > 0:  # SDFT skips the first completion tokens to suppress teacher-prompt artifacts
            positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
            mask = mask * (positions >= skip).to(mask.dtype)
        return mask

    def token_logps(self, scores: DistillationScores) -> torch.Tensor:
        """``(N,)`` log-probs of the loss tokens (temperature applied), differentiable, without ``N × V`` logits."""
        rows, temperature = self.trainer.vocab_rows, self.args.temperature
        if scores.hidden is not None:
            weight, bias = scores.head(rows)
            logps, _ = chunked_logprobs_from_hidden(
                scores.hidden, weight, scores.tokens, bias=bias, temperature=temperature,
                chunk_size=self.loss_chunk_size(),
            )  # fmt: skip
            return logps
        return selective_log_softmax(scores.logits[:, :rows].float() / temperature, scores.tokens)

    def _chunked(self, student: DistillationScores, per_chunk: Any) -> tuple[torch.Tensor, ...]:
        """``per_chunk(student log-probs (c, V), rows)`` over the loss tokens a chunk at a time (never ``N × V``)."""
        return chunked_token_map(
            student.logits_fn(self.trainer.vocab_rows), student.tokens.shape[0], per_chunk,
            temperature=self.args.temperature, chunk_size=self.loss_chunk_size(), device=student.tokens.device,
        )  # fmt: skip

    def per_token_loss(self, student: DistillationScores, teacher: DistillationScores) -> tuple[torch.Tensor, Any]:
        """``(N,)`` per-token loss of ``distillation_mode`` and a thunk giving the student's token log-probs."""
        args = self.args
        mode = args.distillation_mode
        vocab_rows = self.trainer.vocab_rows
        if mode == "topk_logits":
            tokens, temperature = student.tokens, args.temperature
            teacher_logits_fn = teacher.logits_fn(vocab_rows)

            def per_chunk(student_lp: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                """(c, V) student log-probs of a chunk of loss tokens → (per-token loss, token log-probs)."""
                with torch.no_grad():
                    teacher_lp = F.log_softmax(teacher_logits_fn(rows).float() / temperature, dim=-1)
                # log-softmax values are valid logits: the top-k support and the gathered log-probs are unchanged.
                per_token = compute_topk_self_distillation_loss(
                    student_lp, teacher_lp, distillation_topk=args.distillation_topk,
                    distillation_alpha=args.distillation_alpha, distillation_add_tail=args.distillation_add_tail,
                )  # fmt: skip
                return per_token, student_lp.gather(-1, tokens[rows, None]).squeeze(-1)

            per_token, student_logps = self._chunked(student, per_chunk)
            return per_token, lambda: student_logps
        if mode == "full_logits":
            per_token, _ = token_divergence(
                student, teacher, vocab_rows=vocab_rows, beta=args.distillation_alpha,
                temperature=args.temperature, chunk_size=self.loss_chunk_size(),
            )  # fmt: skip
            return per_token, lambda: self.token_logps(student)
        student_logps = self.token_logps(student)
        with torch.no_grad():
            teacher_logps = self.token_logps(teacher)
        per_token = sampled_token_self_distillation_loss_from_logps(
            student_logps, teacher_logps, distillation_alpha=args.distillation_alpha
        )
        return per_token, lambda: student_logps

    def teacher_server(self) -> ServedTeacher:
        """The ``POST /get_sequence_logprobs/`` client of the generation server (made on first use)."""
        if self.served_teacher is None:
            args = self.args
            base_url = getattr(self.trainer.backend, "base_url", None)
            if base_url is None:
                base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
            self.served_teacher = ServedTeacher(
                base_url, self.trainer.vocab_rows, float(args.vllm_server_timeout), "vllm_server_timeout"
            )
        return self.served_teacher

    def served_per_token_loss(
        self, student: DistillationScores, teacher_inputs: RolloutBatch, mode: str
    ) -> tuple[torch.Tensor, Any]:
        """The live teacher's log-probs from the generation server (``use_teacher_server``): the sampled token's for
        ``sampled_token``, the teacher's own top-k support for ``topk_logits`` (renormalised or with the tail)."""
        args, trainer = self.args, self.trainer
        if trainer.state.global_step != trainer._last_synced_step:  # a reused rollout: the server must hold θ now
            trainer.backend.sync_weights(trainer.accelerator.unwrap_model(trainer.model))
            trainer._last_synced_step = trainer.state.global_step
        top_k = args.distillation_topk if args.distillation_mode == "topk_logits" else 1
        served = self.teacher_server().score(teacher_inputs, top_k, args.temperature)  # (N,), (N, K)
        actual = served["actual_logprobs"]
        if args.distillation_mode == "sampled_token":
            student_logps = self.token_logps(student)
            per_token = sampled_token_self_distillation_loss_from_logps(
                student_logps, actual, distillation_alpha=args.distillation_alpha
            )
        else:
            ids, teacher_lp = served["topk_token_ids"], served["topk_logprobs"]
            tokens = student.tokens

            def per_chunk(student_lp: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                """(c, V) student log-probs → the divergence on the served top-k support and the token log-probs."""
                chunk_lp = teacher_lp[rows]
                per_token = sparse_support_divergence(
                    student_lp.gather(-1, ids[rows]), chunk_lp, torch.isfinite(chunk_lp),
                    beta=args.distillation_alpha, add_tail=args.distillation_add_tail,
                )  # fmt: skip
                return per_token, student_lp.gather(-1, tokens[rows, None]).squeeze(-1)

            per_token, student_logps = self._chunked(student, per_chunk)
        # Disagreement of the local student and the served teacher on the realized tokens (stale weights, drift).
        diff = (student_logps.detach() - actual).abs()
        trainer.record_metric(
            "self_distillation/server_logprob_abs_diff",
            trainer._gather_mean(diff.mean() if diff.numel() else diff.new_zeros(())),
            mode=mode,
        )
        return per_token, lambda: student_logps

    def per_token(
        self, model: torch.nn.Module, inputs: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor, DistillationScores]:
        """The student scored on ``[prompt | completion]``, the teacher on ``[teacher prompt | completion]`` (local,
        under ``no_grad``, or served), the per-token loss of ``distillation_mode`` and, with ``old_per_token_logps``
        and ``distillation_is_clip``, TRL's clipped importance ratio.

        Returns:
            ``(per_token (N,), loss_mask (B, C), student scores)``: the loss at the loss tokens in row-major order of
            ``loss_mask`` (``completion_mask`` minus the first ``num_loss_tokens_to_skip`` tokens).
        """
        args = self.args
        loss_mask = self.loss_mask(inputs)
        student_inputs = {**inputs, "completion_mask": loss_mask}
        teacher_ids, teacher_mask = trim_left_padding(inputs["teacher_prompt_ids"], inputs["teacher_prompt_mask"])
        teacher_inputs = {**student_inputs, "prompt_ids": teacher_ids, "prompt_mask": teacher_mask}
        student = score_distillation_completions(model, *self.scoring_inputs(model, student_inputs))
        if args.use_teacher_server:
            per_token, student_token_logps = self.served_per_token_loss(student, teacher_inputs, self.trainer._mode())
        else:
            with torch.no_grad(), self.trainer.teacher.activate(model) as teacher_module:
                teacher = score_distillation_completions(
                    teacher_module, *self.scoring_inputs(teacher_module, teacher_inputs)
                )
            per_token, student_token_logps = self.per_token_loss(student, teacher)  # (N,)
        old = inputs.get("old_per_token_logps")
        if args.distillation_is_clip is not None and old is not None and per_token.numel():
            per_token = apply_importance_sampling_clipping(
                per_token, student_token_logps(), old[loss_mask.bool()], args.distillation_is_clip
            )
        return per_token, loss_mask, student

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"ema_teacher": ...}`` for an EMA teacher (so a resumed run continues the same average), else ``{}``:
        the trainer adds it to its ``resume_state_dict``."""
        trainer = self.trainer
        teacher = trainer.teacher.state_dict(trainer.model)
        return {"ema_teacher": teacher} if teacher else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved (``state`` is the trainer's whole resume state)."""
        if "ema_teacher" in state:
            self.trainer.teacher.load_state_dict(state["ema_teacher"], self.trainer.model)
