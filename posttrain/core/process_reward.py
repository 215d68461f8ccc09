"""Process reward model (PRM) objective as pure tensor math: a token classifier trained on step labels.

A stepwise-supervision row becomes one sequence ``prompt + step_1 + sep + step_2 + sep + ...`` whose label sits on
the last token of each ``step_i + sep`` (the separator), every other position holding ``-100``
(https://huggingface.co/papers/2211.14275, https://huggingface.co/papers/2312.08935). The loss is the cross-entropy
of the per-token class logits at the labelled positions, averaged over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "step_label_loss", "step_label_accuracy"]

IGNORE_INDEX = -100


def step_label_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    num_labels: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions.

    Args:
        logits: ``(B, T, C)`` per-token class logits (C = 2 for correct / incorrect steps).
        labels: ``(B, T)`` class ids, ``ignore_index`` at unlabelled positions.
        num_labels: Divide the summed cross-entropy by this instead of the local labelled count (data-parallel:
            the global count / processes, so the processes' mean is the mean over all of them).

    Returns:
        Scalar loss (0 with a zero gradient when no position is labelled).
    """
    mask = labels != ignore_index
    if not bool(mask.any()):
        return logits.sum() * 0.0
    if num_labels is None:
        return F.cross_entropy(logits[mask].float(), labels[mask])
    total = F.cross_entropy(logits[mask].float(), labels[mask], reduction="sum")
    return total / torch.as_tensor(num_labels, dtype=total.dtype, device=total.device).clamp(min=1.0)


@torch.no_grad()
def step_label_accuracy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Fraction of labelled positions whose argmax class equals the label (NaN when none is labelled)."""
    mask = labels != ignore_index
    if not bool(mask.any()):
        return torch.tensor(float("nan"), device=logits.device)
    return (logits[mask].argmax(dim=-1) == labels[mask]).float().mean()
