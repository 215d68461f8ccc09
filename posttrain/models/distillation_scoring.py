"""Scoring distillation completions without full-vocabulary logits: what one forward pass of the student or the
teacher gives the divergence (``rollout/distillation.token_divergence``) at the loss tokens of a micro-batch.

- :class:`DistillationScores`: the last hidden states at the positions predicting the loss tokens plus the LM-head
  weight (or, on the fallback path, the model's logits there).
- :func:`forward_logits_fn`: one forward pass whose head runs on an empty slice, returning a function that computes
  the logits of any flat positions on demand (for losses that need other positions than the loss tokens, e.g. ULD).
- :func:`score_distillation_completions`: one forward pass of a causal LM over ``[prompt | completion]`` (or a
  shared-prompt layout, :mod:`posttrain.models.prefix_sharing`) in which the head runs on an empty slice, so no
  ``(B, T, V)`` logits are built. Heads that are not a plain linear map (LoRA on ``lm_head``, soft-capping, logit
  scales, sharded weights) fall back to the model's own logits at those positions, logged once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.models.forward import (
    _log_once,
    forward_capturing_head_input,
    prepare_attention_mask,
    resolve_lm_head,
)
from posttrain.models.unwrap import unwrap_base_model

__all__ = ["DistillationScores", "forward_logits_fn", "score_distillation_completions"]


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
    _log_once(
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
    _log_once(
        f"posttrain: chunked logits are not used for {type(unwrap_base_model(model)).__name__} because {reason}; "
        "using its full-vocabulary logits (more memory, same result)."
    )
    outputs = forward()
    flat_logits = outputs.logits.reshape(-1, outputs.logits.shape[-1])
    return outputs, lambda positions: flat_logits[positions.to(flat_logits.device)]
