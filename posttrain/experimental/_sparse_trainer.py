"""The loss of the experimental distillation trainers that read teacher log-probs token by token: IW-OPD (the
sampled-token objective) and TRL's sparse top-k supports, with a local teacher or a teacher server.

A mixin over :class:`~posttrain.trainers.distillation.DistillationTrainer`: the round (student samples / dataset /
teacher completions), batching, normalisation (Σ over tokens / completion tokens of the optimizer step) and metrics
(``distillation_loss``, ``entropy``) are the distillation trainer's; this swaps the per-token term.

Like the distillation loss, every term is computed from the last hidden states ``chunk`` loss tokens at a time
(``core.distill.chunked_token_map``, recomputed in backward): no ``(N, V)`` logits of the micro-batch are built.
"""

from __future__ import annotations

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


class SparseDistillationMixin:
    """Per-token teacher log-probs (local forward or ``POST /get_sequence_logprobs/``) → IW-OPD or sparse JSD."""

    served_teacher: ServedTeacher | None = None

    def _uses_teacher_server(self, args: Any) -> bool:
        """Whether the teacher is served (``use_teacher_server``); ``ServerDistillationTrainer`` always is."""
        return bool(getattr(args, "use_teacher_server", False))

    def _objective(self) -> str:
        return getattr(self.args, "distillation_objective", "jsd")

    def _load_teacher(self, teacher_model: Any, args: Any) -> tuple[Any, Any]:
        if not self._uses_teacher_server(args):
            return super()._load_teacher(teacher_model, args)
        if teacher_model is not None:
            raise ValueError(
                "teacher_model was passed but the teacher is served at teacher_model_server_url; pass one or the other."
            )
        return None, None

    def _teacher_server(self) -> ServedTeacher:
        if self.served_teacher is None:
            timeout = float(getattr(self.args, "vllm_server_timeout", 240.0) or 240.0)
            self.served_teacher = ServedTeacher(self.args.teacher_model_server_url, self.vocab_rows, timeout,
                                               "vllm_server_timeout")
        return self.served_teacher

    def _behaviour_logprobs(self, inputs: Any) -> torch.Tensor | None:
        """``(N,)`` the sampler's log-probs of the loss tokens (TRL's ``rollout_logprobs``), or None."""
        sampled = inputs.get("sampling_per_token_logps") if hasattr(inputs, "get") else None
        if sampled is None:
            return None
        mask = inputs["completion_mask"].bool()
        return sampled[:, : mask.shape[1]].to(mask.device)[mask].float()

    def _compute_loss(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        args = self.args
        server = self._uses_teacher_server(args)
        objective = self._objective()
        if objective == "jsd" and not server and args.loss_top_k == 0:
            return super()._compute_loss(model, inputs)  # the exact full-vocabulary generalized JSD
        mode = self._mode()
        student = score_distillation_completions(model, *self._scoring_inputs(model, inputs))
        tokens = student.tokens
        teacher: dict[str, torch.Tensor] | None = None
        teacher_logits_fn = None
        if server:
            teacher = self._teacher_server().score(inputs, args.loss_top_k, args.temperature)
        else:
            with torch.no_grad():
                scores = score_distillation_completions(
                    self.teacher_model, *self._scoring_inputs(self.teacher_model, inputs)
                )
            teacher_logits_fn = scores.logits_fn(self.vocab_rows)
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
            student.logits_fn(self.vocab_rows),
            tokens.shape[0],
            per_chunk,
            temperature=temperature,
            chunk_size=self._loss_chunk_size(),
            device=tokens.device,
        )
        entropy = outputs[-1]
        if objective == "iw_opd":
            student_actual, teacher_actual = outputs[0], outputs[1]
            mask = inputs["completion_mask"].bool()
            behaviour = self._behaviour_logprobs(inputs)
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
            self._record_token_means(
                mode,
                **{"iw_opd/mean_advantage": adv, "iw_opd/mean_abs_advantage": abs_adv, "iw_opd/mean_weight": w},
            )
            empty = w.new_full((1,), float("nan"))
            lows = gather_rows(self.accelerator, (w.min() if w.numel() else empty).float().reshape(1))
            highs = gather_rows(self.accelerator, (w.max() if w.numel() else empty).float().reshape(1))
            if not torch.isnan(lows).all():
                self.record_metric("iw_opd/min_weight", float(lows[~torch.isnan(lows)].min()), mode=mode)
                self.record_metric("iw_opd/max_weight", float(highs[~torch.isnan(highs)].max()), mode=mode)
        else:
            per_token = outputs[0]
        loss = per_token.sum() / self._token_normaliser(inputs, per_token, mode).clamp(min=1.0)
        if per_token.numel() == 0:
            loss = loss + 0.0 * sum(p.sum() for p in model.parameters() if p.requires_grad)
        loss = self._finish_loss(loss, student.aux_loss, divide_by_grad_accum=False)
        self._record_token_means(mode, distillation_loss=per_token, entropy=entropy)
        return loss
