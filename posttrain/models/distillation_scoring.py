"""Scoring distillation completions without full-vocabulary logits: what one forward pass of the student or the
teacher gives the divergence at the loss tokens of a micro-batch, and that divergence.

- :class:`DistillationScores`: the last hidden states at the positions predicting the loss tokens plus the LM-head
  weight (or, on the fallback path, the model's logits there).
- :func:`forward_logits_fn`: one forward pass whose head runs on an empty slice, returning a function that computes
  the logits of any flat positions on demand (for losses that need other positions than the loss tokens, e.g. ULD).
- :func:`score_distillation_completions`: one forward pass of a causal LM over ``[prompt | completion]`` (or a
  shared-prompt layout, :mod:`posttrain.models.prefix_sharing`) in which the head runs on an empty slice, so no
  ``(B, T, V)`` logits are built. Heads that are not a plain linear map (LoRA on ``lm_head``, soft-capping, logit
  scales, sharded weights) fall back to the model's own logits at those positions, logged once.
- :func:`token_divergence`: the generalized JSD per loss token between the student's and the teacher's
  ``DistillationScores``, from ``core.distill.chunked_generalized_jsd`` (peak memory chunk × V, logits recomputed in
  backward), plus the student's entropy at the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.core.distill import chunked_generalized_jsd, generalized_jsd_loss
from posttrain.core.logprobs import chunked_logprobs_from_hidden, entropy_from_logits
from posttrain.models.forward import (
    forward_capturing_head_input,
    log_once,
    prepare_attention_mask,
    resolve_lm_head,
)
from posttrain.models.unwrap import unwrap_base_model

__all__ = ["DistillationScores", "forward_logits_fn", "score_distillation_completions", "token_divergence"]


@dataclass
class DistillationScores:
    """What one forward pass gives the divergence, for the ``N`` loss tokens of a micro-batch.

    Either ``hidden`` ``(N, H)`` (the last hidden states at the positions predicting the loss tokens) with the LM
    head's ``weight`` ``(V, H)`` and ``bias`` ``(V,)|None`` — or, on the fallback path, ``logits`` ``(N, V)``.

    Attributes:
        tokens: ``(N,)`` the loss tokens (the completion tokens under the loss mask).
        aux_loss: The model's MoE load-balancing loss, or None.
    """

    tokens: torch.Tensor
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None

    def head(self, vocab_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's first ``vocab_rows`` rows: ``(weight (vocab_rows, H), bias (vocab_rows,) | None)``."""
        return self.weight[:vocab_rows], None if self.bias is None else self.bias[:vocab_rows]

    def logits_fn(self, vocab_rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """``rows -> (len(rows), vocab_rows)`` logits of the given loss tokens (for ``teacher_logits_fn``)."""
        if self.logits is not None:
            logits = self.logits
            return lambda rows: logits[rows, :vocab_rows]
        hidden, (weight, bias) = self.hidden, self.head(vocab_rows)
        return lambda rows: F.linear(hidden[rows], weight, bias)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(unwrap_base_model(model).forward).parameters
    except (TypeError, ValueError):
        return False


def score_distillation_completions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    completion_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    predictors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DistillationScores:
    """Run ``model`` over ``[prompt | completion]`` and keep what the divergence needs at the loss tokens.

    Position ``P + t − 1`` predicts completion token ``t``, so the last ``C + 1`` hidden states minus the final one
    are the ``C`` predicting positions; of those, the ones where ``loss_mask`` is set are returned. The call goes
    through the model's own ``forward`` (DDP, PEFT adapters, gradient checkpointing behave as usual); a pre-hook
    hands the LM head an empty slice instead of the hidden states. On the first call per head, the head computes
    one position and the result is compared with ``hidden @ weightᵀ + bias``; a mismatch switches that model to the
    logits path for good.

    Args:
        model: A causal LM (possibly PEFT- or accelerator-wrapped).
        input_ids / attention_mask / position_ids: ``(B, P + C)``.
        completion_ids: ``(B, C)``.
        loss_mask: ``(B, C)`` 1 on the tokens the loss counts.
        predictors: ``(row, position)`` of the hidden state predicting each loss token (row-major order of
            ``loss_mask``) when the inputs are a shared-prompt layout (:mod:`posttrain.models.prefix_sharing`)
            rather than ``[prompt | completion]`` rows; the attention mask is then its 4-D tree mask.

    Returns:
        :class:`DistillationScores` with ``N = loss_mask.sum()`` rows, differentiable when grad is enabled.
    """
    width = completion_ids.shape[1]
    keep = width + 1
    sel = loss_mask.bool()
    tokens = completion_ids[sel]
    kwargs: dict[str, Any] = {"use_cache": False}
    if predictors is None and _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = keep
    attention_mask = prepare_attention_mask(model, attention_mask)

    def at_loss_tokens(values: torch.Tensor) -> torch.Tensor:
        """``(N, ·)``: the rows of per-position ``values`` that predict the loss tokens."""
        if predictors is not None:
            return values[predictors[0], predictors[1]]
        return values[:, -keep:-1][sel]

    def forward() -> Any:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)

    head = resolve_lm_head(model)
    if not isinstance(head, str) and head.scale != 1.0:  # the divergence reads logits as h Wᵀ + b
        head = f"the model scales its logits by {head.scale}"
    reason = head if isinstance(head, str) else ""
    if not isinstance(head, str):
        captured = forward_capturing_head_input(model, head, forward)
        if captured is not None:
            outputs, hidden = captured
            return DistillationScores(
                tokens=tokens,
                hidden=at_loss_tokens(hidden),  # (N, H)
                weight=head.weight,
                bias=head.bias,
                aux_loss=getattr(outputs, "aux_loss", None),
            )
        reason = "its logits differ from hidden_states @ lm_head.weight (an unknown head transform)"
    log_once(
        f"posttrain distillation: chunked divergence is not used for {type(unwrap_base_model(model)).__name__} because "
        f"{reason}; using its full-vocabulary logits at the completion positions (more memory, same result)."
    )
    outputs = forward()
    return DistillationScores(
        tokens=tokens, logits=at_loss_tokens(outputs.logits), aux_loss=getattr(outputs, "aux_loss", None)
    )


def forward_logits_fn(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]]:
    """One forward pass of ``model`` over ``(B, L)`` inputs without its ``(B, L, V)`` logits.

    Returns ``(outputs, logits_fn)`` where ``logits_fn(positions)`` gives the ``(n, V)`` logits (the whole head) at
    flat positions ``b · L + t`` — ``scale · (hidden @ Wᵀ + b)`` from the captured last hidden states,
    differentiable when grad is enabled. Heads that are not a plain linear map fall back to the model's own logits
    (logged once), which ``logits_fn`` then slices.
    """
    kwargs: dict[str, Any] = {"use_cache": False}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids

    def forward() -> Any:
        return model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    head = resolve_lm_head(model)
    reason = head if isinstance(head, str) else ""
    if not isinstance(head, str):
        captured = forward_capturing_head_input(model, head, forward)
        if captured is not None:
            outputs, hidden = captured
            flat = hidden.reshape(-1, hidden.shape[-1])
            weight, bias, scale = head.weight, head.bias, head.scale

            def logits_fn(positions: torch.Tensor) -> torch.Tensor:
                logits = F.linear(flat[positions.to(flat.device)], weight, bias)
                return logits if scale == 1.0 else logits * scale

            return outputs, logits_fn
        reason = "its logits differ from hidden_states @ lm_head.weight (an unknown head transform)"
    log_once(
        f"posttrain: chunked logits are not used for {type(unwrap_base_model(model)).__name__} because {reason}; "
        "using its full-vocabulary logits (more memory, same result)."
    )
    outputs = forward()
    flat_logits = outputs.logits.reshape(-1, outputs.logits.shape[-1])
    return outputs, lambda positions: flat_logits[positions.to(flat_logits.device)]


def token_divergence(
    student: DistillationScores,
    teacher: DistillationScores,
    *,
    vocab_rows: int,
    beta: float,
    temperature: float,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token generalized JSD between student and teacher, and the student's entropy, at the ``N`` loss tokens.

    D_β = KL(p_T‖p_S) for β = 0, KL(p_S‖p_T) for β = 1, else β·KL(p_T‖p_M) + (1 − β)·KL(p_S‖p_M) with
    p_M = (1 − β)·p_S + β·p_T, where p = softmax(logits[:vocab_rows] / temperature) (GKD, arXiv 2306.13649).
    With student hidden states the logits are computed ``chunk_size`` tokens at a time and recomputed in backward
    (``core.distill.chunked_generalized_jsd``), so peak memory is chunk × V, not N × V.

    Returns:
        ``(divergence (N,), entropy (N,))`` float32; the divergence carries gradients to the student, the entropy
        H(p_S) (at the same temperature) is detached.
    """
    rows = vocab_rows
    if student.hidden is not None:
        weight, bias = student.head(rows)
        teacher_kwargs: dict[str, Any]
        if teacher.hidden is not None:
            teacher_weight, teacher_bias = teacher.head(rows)
            teacher_kwargs = dict(
                teacher_hidden=teacher.hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias
            )
        else:
            teacher_kwargs = dict(teacher_logits_fn=teacher.logits_fn(rows))
        divergence = chunked_generalized_jsd(
            student.hidden,
            weight,
            student_bias=bias,
            beta=beta,
            temperature=temperature,
            reduction="none",
            chunk_size=chunk_size,
            **teacher_kwargs,
        )
        with torch.no_grad():
            # Entropy does not depend on the label; clamp ids of padding rows beyond `rows` (never a real token).
            _, entropy = chunked_logprobs_from_hidden(
                student.hidden.detach(),
                weight.detach(),
                student.tokens.clamp(max=rows - 1),
                bias=None if bias is None else bias.detach(),
                temperature=temperature,
                chunk_size=chunk_size,
                compute_entropy=True,
            )
        return divergence.float(), entropy.float()
    student_logits = student.logits[:, :rows]
    n = student_logits.shape[0]
    with torch.no_grad():
        teacher_logits = teacher.logits_fn(rows)(torch.arange(n, device=student_logits.device))
    divergence = generalized_jsd_loss(
        student_logits, teacher_logits, beta=beta, temperature=temperature, reduction="none"
    )
    with torch.no_grad():
        entropy = entropy_from_logits(student_logits.detach().float() / temperature)
    return divergence.float(), entropy.float()
