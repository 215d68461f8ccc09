"""The loss of the experimental distillation trainers that read teacher log-probs token by token: IW-OPD (the
sampled-token objective) and TRL's sparse top-k supports, with a local teacher or a teacher server.

A loss strategy (:class:`~posttrain.trainers.distillation.DistillationLoss`) of
:class:`~posttrain.trainers.distillation.DistillationTrainer`: the round (student samples / dataset / teacher
completions), batching, normalisation (Σ over tokens / completion tokens of the optimizer step) and metrics
(``distillation_loss``, ``entropy``) are the distillation trainer's; this swaps the per-token term. The teacher is
local (``trainer.teacher_model``) or served (``trainer._uses_teacher_server(args)``: its client is
``trainer.served_teacher``, made on first use by the strategy's ``make_teacher``).

Like the distillation loss, every term is computed from the last hidden states ``chunk`` loss tokens at a time
(``core.distill.chunked_token_map``, recomputed in backward): no ``(N, V)`` logits of the micro-batch are built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.core.distill import chunked_token_map, iw_opd_loss
from posttrain.distributed import gather_rows
from posttrain.experimental._distill_support import (
    ServedTeacher,
    local_sparse_divergence,
    server_sparse_divergence,
    to_rows,
)
from posttrain.models.distillation_scoring import score_distillation_completions
from posttrain.trainers.distillation import FullVocabularyDivergence


def check_sparse_options(args: Any, uses_server: bool) -> None:
    """TRL's rules for ``loss_top_k`` / ``reverse_kl_top_1_mode`` with a local or a served teacher."""
    if args.reverse_kl_top_1_mode not in ("sampled", "argmax"):
        raise ValueError("reverse_kl_top_1_mode must be one of: 'sampled', 'argmax'")
    if args.loss_top_k < 0:
        raise ValueError(f"loss_top_k must be >= 0, got {args.loss_top_k}.")
    if not uses_server:
        return
    if not (args.teacher_model_server_url or "").strip():
        raise ValueError("teacher_model_server_url must be set to use a teacher server.")
    if args.seq_kd:
        raise ValueError("seq_kd=True needs a local teacher to sample from; a teacher server only scores.")
    if args.beta == 0 and args.loss_top_k < 1:
        raise ValueError(
            f"loss_top_k must be positive with beta=0 (got loss_top_k={args.loss_top_k}). The pure forward server "
            "path only has access to the teacher's top-k logprobs, so it cannot compute the exact full-vocabulary "
            "loss when loss_top_k=0."
        )
    if args.reverse_kl_top_1_mode == "argmax":
        raise ValueError(
            "reverse_kl_top_1_mode='argmax' is not supported with a teacher server, which cannot provide teacher "
            "logprobs for arbitrary student-selected tokens."
        )
    if args.beta > 0 and args.loss_top_k != 1:
        raise ValueError(
            f"loss_top_k must be 1 with beta>0 (got loss_top_k={args.loss_top_k}). Mixed forward/reverse "
            "distillation with an external teacher is only implemented for top-1 support."
        )


def _served_teacher_client(trainer: Any) -> ServedTeacher:
    """The ``POST /get_sequence_logprobs/`` client of ``args.teacher_model_server_url``."""
    timeout = float(getattr(trainer.args, "vllm_server_timeout", 240.0) or 240.0)
    return ServedTeacher(trainer.args.teacher_model_server_url, trainer.vocab_rows, timeout, "vllm_server_timeout")


def _behaviour_logprobs(inputs: Any) -> torch.Tensor | None:
    """``(N,)`` the sampler's log-probs of the loss tokens (TRL's ``rollout_logprobs``), or None."""
    sampled = inputs.get("sampling_per_token_logps") if hasattr(inputs, "get") else None
    if sampled is None:
        return None
    mask = inputs["completion_mask"].bool()
    return sampled[:, : mask.shape[1]].to(mask.device)[mask].float()


class SparseDistillationLoss:
    """Per-token teacher log-probs (local forward or ``POST /get_sequence_logprobs/``) → IW-OPD or sparse JSD.

    ``args.distillation_objective`` (default "jsd") picks IW-OPD's sampled-token objective or the generalized JSD on
    the top-``loss_top_k`` support; ``"jsd"`` with a local teacher and ``loss_top_k=0`` is the exact
    full-vocabulary divergence (:class:`~posttrain.trainers.distillation.FullVocabularyDivergence`).

    Args:
        make_teacher: ``make_teacher(trainer)`` → the served teacher's client (anything with
            ``score(inputs, top_k, temperature)`` → ``{"actual_logprobs", "topk_logprobs", "topk_token_ids"}`` per
            loss token and ``close()``), kept in ``trainer.served_teacher``; default: a ``ServedTeacher`` of
            ``args.teacher_model_server_url``.
    """

    def __init__(self, make_teacher: Callable[[Any], Any] | None = None):
        self.make_teacher = make_teacher if make_teacher is not None else _served_teacher_client
        self.full_vocabulary = FullVocabularyDivergence()

    def teacher(self, trainer: Any) -> Any:
        """The trainer's served-teacher client, made on first use."""
        if trainer.served_teacher is None:
            trainer.served_teacher = self.make_teacher(trainer)
        return trainer.served_teacher

    def __call__(self, trainer: Any, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        args = trainer.args
        server = trainer._uses_teacher_server(args)
        objective = getattr(args, "distillation_objective", "jsd")
        if objective == "jsd" and not server and args.loss_top_k == 0:
            return self.full_vocabulary(trainer, model, inputs)  # the exact full-vocabulary generalized JSD
        mode = trainer._mode()
        student = score_distillation_completions(model, *trainer._scoring_inputs(model, inputs))
        tokens = student.tokens
        teacher: dict[str, torch.Tensor] | None = None
        teacher_logits_fn = None
        if server:
            teacher = self.teacher(trainer).score(inputs, args.loss_top_k, args.temperature)
        else:
            with torch.no_grad():
                scores = score_distillation_completions(
                    trainer.teacher_model, *trainer._scoring_inputs(trainer.teacher_model, inputs)
                )
            teacher_logits_fn = scores.logits_fn(trainer.vocab_rows)
        temperature = args.temperature

        def teacher_log_probs(rows: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return F.log_softmax(teacher_logits_fn(rows).float() / temperature, dim=-1)

        def per_chunk(student_lp: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
            """(c, V) student log-probs of the chunk's loss tokens → (per-token term(s), detached entropy)."""
            with torch.no_grad():
                entropy = -(student_lp.exp() * student_lp).sum(-1)
            chunk_tokens = tokens[rows]
            if objective == "iw_opd":
                student_actual = student_lp.gather(-1, chunk_tokens[:, None]).squeeze(-1)
                if teacher is not None:
                    teacher_actual = teacher["actual_logprobs"][rows]
                else:
                    teacher_actual = teacher_log_probs(rows).gather(-1, chunk_tokens[:, None]).squeeze(-1)
                return student_actual, teacher_actual.to(student_actual.dtype), entropy
            if teacher is not None:
                chunk_teacher = {key: value[rows] for key, value in teacher.items()}
                per_token = server_sparse_divergence(
                    student_lp, chunk_tokens, chunk_teacher, beta=args.beta, add_tail=args.loss_add_tail
                )
            else:
                per_token = local_sparse_divergence(
                    student_lp, teacher_log_probs(rows), chunk_tokens, beta=args.beta, top_k=args.loss_top_k,
                    add_tail=args.loss_add_tail, reverse_top_1_mode=args.reverse_kl_top_1_mode,
                )  # fmt: skip
            return per_token, entropy

        # Chunks of loss tokens, recomputed in backward: no (N, V) logits for the micro-batch (design §3.1).
        outputs = chunked_token_map(
            student.logits_fn(trainer.vocab_rows),
            tokens.shape[0],
            per_chunk,
            temperature=temperature,
            chunk_size=trainer._loss_chunk_size(),
            device=tokens.device,
        )
        entropy = outputs[-1]
        if objective == "iw_opd":
            student_actual, teacher_actual = outputs[0], outputs[1]
            mask = inputs["completion_mask"].bool()
            behaviour = _behaviour_logprobs(inputs)
            rows_loss, advantages, weights = iw_opd_loss(
                to_rows(student_actual, mask),
                to_rows(teacher_actual, mask),
                mask,
                gamma=args.iw_opd_gamma,
                epsilon=args.iw_opd_epsilon,
                rollout_logprobs=None if behaviour is None else to_rows(behaviour.to(student_actual.dtype), mask),
            )
            per_token = rows_loss[mask]
            # Every process joins these collectives, with or without loss tokens (no hang on an empty batch).
            adv, w = advantages[mask].detach(), weights[mask].detach()
            reference = student_actual if behaviour is None else behaviour.to(student_actual.dtype)
            abs_adv = (teacher_actual - reference).detach().abs()
            trainer._record_token_means(
                mode,
                **{"iw_opd/mean_advantage": adv, "iw_opd/mean_abs_advantage": abs_adv, "iw_opd/mean_weight": w},
            )
            empty = w.new_full((1,), float("nan"))
            lows = gather_rows(trainer.accelerator, (w.min() if w.numel() else empty).float().reshape(1))
            highs = gather_rows(trainer.accelerator, (w.max() if w.numel() else empty).float().reshape(1))
            if not torch.isnan(lows).all():
                trainer.record_metric("iw_opd/min_weight", float(lows[~torch.isnan(lows)].min()), mode=mode)
                trainer.record_metric("iw_opd/max_weight", float(highs[~torch.isnan(highs)].max()), mode=mode)
        else:
            per_token = outputs[0]
        loss = per_token.sum() / trainer._token_normaliser(inputs, per_token, mode).clamp(min=1.0)
        if per_token.numel() == 0:
            loss = loss + 0.0 * sum(p.sum() for p in model.parameters() if p.requires_grad)
        loss = trainer._finish_loss(loss, student.aux_loss, divide_by_grad_accum=False)
        trainer._record_token_means(mode, distillation_loss=per_token, entropy=entropy)
        return loss
