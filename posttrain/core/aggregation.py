"""Ways to reduce a per-token loss ``(B, T)`` (or per-sequence ``(B, 1)``) to the scalar that is back-propagated.

The normaliser decides the length bias of a GRPO-style loss (Dr. GRPO, DAPO, LUSPO papers), independently of the
per-token objective, so it is its own registry. Keys and formulas (m = completion mask, B = local micro-batch):

=======================  ============================================================  ====================
key                      loss                                                          TRL ``loss_type``
=======================  ============================================================  ====================
``seq_mean_token_mean``  mean_i [ Σ_t L·m / max(Σ_t m, 1) ]                            grpo, sapo
``token_mean_local``     Σ L·m / max(Σ m, 1)                                           bnpo
``constant_norm``        Σ L·m / (B · max_completion_length)                           dr_grpo
``token_mean_global``    Σ L·m / (num_items_in_batch / num_processes)                  dapo, cispo, vespo
``length_weighted``      mean_i Σ_t L·m  (L_i·|o_i| for a (B, 1) loss)                 luspo
``sequence_mean``        mean_i L_i  (a ``(B, 1)`` per-sequence loss)                  RLOO
=======================  ============================================================  ====================

Gradient accumulation: these functions never divide by the number of accumulation steps. The trainer divides the
``seq_mean_token_mean``, ``token_mean_local``, ``constant_norm`` and ``length_weighted`` results by it (TRL's
``current_gradient_accumulation_steps`` in training, 1 in evaluation); ``token_mean_global`` is already normalised
by the token count of the whole generation batch, so it is not divided again. Masked-out positions never contribute,
even if they hold NaN/inf.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.core.masking import masked_sum, masked_where
from posttrain.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "constant_norm",
    "length_weighted",
    "seq_mean_token_mean",
    "sequence_mean",
    "token_mean_global",
    "token_mean_local",
]

AGGREGATIONS: Registry[Callable[..., torch.Tensor]] = Registry("aggregation")


def _lengths(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return mask.sum(dim=-1).to(dtype)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, **_) -> torch.Tensor:
    """mean_i [ Σ_t L_it m_it / max(Σ_t m_it, 1) ] — each sequence weighs the same (GRPO, DeepSeekMath).

    Args:
        loss: ``(B, T)`` per-token loss, or ``(B, 1)`` (counted once per valid token, so its sequence mean is L_i).
        mask: ``(B, T)``.

    Returns:
        Scalar. Shorter sequences get larger per-token weight (the length bias Dr. GRPO removes).
    """
    per_seq = masked_sum(loss, mask, dim=-1) / _lengths(mask, loss.dtype).clamp(min=1.0)
    return per_seq.mean()


@AGGREGATIONS.register("token_mean_local")
def token_mean_local(loss: torch.Tensor, mask: torch.Tensor, **_) -> torch.Tensor:
    """Σ_{i,t} L m / max(Σ m, 1) over the local micro-batch (BNPO). Depends on how tokens split across devices."""
    return masked_sum(loss, mask) / mask.sum().to(loss.dtype).clamp(min=1.0)


@AGGREGATIONS.register("constant_norm")
def constant_norm(
    loss: torch.Tensor, mask: torch.Tensor, *, max_completion_length: int | None = None, **_
) -> torch.Tensor:
    """Σ_{i,t} L m / (B · max_completion_length) — a length-independent constant (Dr. GRPO, Liu et al. 2025).

    Args:
        loss: ``(B, T)`` (or ``(B, 1)``).
        mask: ``(B, T)``.
        max_completion_length: the constant (GRPOConfig ``max_completion_length``); required.
    """
    if not max_completion_length:
        raise ValueError(
            "constant_norm (loss_type='dr_grpo') needs max_completion_length, the constant normaliser: pass "
            "max_completion_length=args.max_completion_length."
        )
    return masked_sum(loss, mask) / (mask.shape[0] * max_completion_length)


@AGGREGATIONS.register("token_mean_global")
def token_mean_global(
    loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    num_processes: int = 1,
    **_,
) -> torch.Tensor:
    """Σ_{i,t} L m / (num_items_in_batch / num_processes) (DAPO token-level mean over the global batch).

    ``num_items_in_batch`` is the number of valid completion tokens in the whole generation batch (all
    micro-batches of the optimizer step, gathered over all processes). DDP averages gradients over processes,
    hence the division by ``num_processes``; summed over micro-batches and processes this is the exact global token
    mean, whatever the split. A zero count gives 0 (the masked sum is 0) instead of NaN.

    Args:
        loss: ``(B, T)``.
        mask: ``(B, T)``.
        num_items_in_batch: global token count; required.
        num_processes: number of data-parallel processes.
    """
    if num_items_in_batch is None:
        raise ValueError(
            "token_mean_global (loss_type in 'dapo', 'cispo', 'vespo') needs num_items_in_batch, the number of "
            "completion tokens in the whole generation batch across processes."
        )
    normalizer = torch.as_tensor(num_items_in_batch, dtype=loss.dtype, device=loss.device) / num_processes
    normalizer = torch.where(normalizer == 0, torch.ones_like(normalizer), normalizer)
    return masked_sum(loss, mask) / normalizer


# Already normalised by the whole optimizer step's token count: the trainer must not divide it by the number of
# gradient-accumulation steps (``presets.needs_grad_accum_division`` reads this; other aggregations are divided).
token_mean_global.normalised_over_step = True


@AGGREGATIONS.register("length_weighted")
def length_weighted(loss: torch.Tensor, mask: torch.Tensor, **_) -> torch.Tensor:
    """LUSPO (arXiv 2602.05261): each sequence's loss scaled by its length, to undo GSPO's bias against long answers.

    mean_i Σ_t L_it m_it, as TRL 1.16 (``(per_token_loss * mask).sum(-1).mean()``):

    * ``(B, 1)`` loss (``importance_sampling_level="sequence"``, no per-token terms): mean_i (L_i · |o_i|) with
      |o_i| = Σ_t m_it.
    * ``(B, T)`` loss (token-level weights, or a KL / entropy-mask term made it per-token): each sequence's masked
      token sum, averaged over sequences (older TRL releases multiplied every element by |o_i| and averaged over all
      B·T elements instead).

    Args:
        loss: ``(B, 1)`` or ``(B, T)``.
        mask: ``(B, T)``.
    """
    return masked_where(loss.expand(mask.shape), mask).sum(dim=-1).mean()


@AGGREGATIONS.register("sequence_mean")
def sequence_mean(loss: torch.Tensor, mask: torch.Tensor | None = None, **_) -> torch.Tensor:
    """mean_i L_i for a per-sequence loss ``(B,)`` or ``(B, 1)`` (RLOO's sequence-level PPO loss; mask unused).

    Every sequence counts, including one whose mask is empty (its ratio is 1, so its loss is −A_i), as in TRL's RLOO.
    """
    if not (loss.dim() == 1 or (loss.dim() == 2 and loss.shape[-1] == 1)):
        raise ValueError(
            f"sequence_mean expects a per-sequence loss of shape (B,) or (B, 1), got {tuple(loss.shape)}: use "
            "importance_sampling_level='sequence_sum' (RLOO) so the objective is per sequence."
        )
    return loss.mean()
