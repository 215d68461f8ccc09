"""Reductions and gathers over data-parallel processes, in one place (each is the identity on one process).

- :func:`gather_mean` / :func:`gather_masked_mean`: a metric over every process's values (offline trainers);
  :func:`gather_row_masked_mean` for ``(B, T)`` values of the batch rows (the rows a process repeats to even out
  the last batch left out);
- :func:`mean_over_processes`: the NaN-aware mean of one scalar per process (online trainers' metrics);
- :func:`gather_rows` / :func:`gather_objects`: tensors concatenated along dim 0, or Python lists, over processes
  (the rollout's rewards, lengths, completions table);
- :func:`gather_variable_length`: 1-D tensors of different lengths per process, concatenated (NaN-padded first);
- :func:`sum_over_processes`: a tensor summed elementwise over processes (global token counts, moments, numerators
  and denominators of token means).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "gather_masked_mean",
    "gather_mean",
    "gather_objects",
    "gather_row_masked_mean",
    "gather_rows",
    "gather_variable_length",
    "mean_over_processes",
    "sum_over_processes",
]


def _num_processes(accelerator: Any) -> int:
    return getattr(accelerator, "num_processes", 1) if accelerator is not None else 1


def gather_mean(accelerator: Any, values: torch.Tensor) -> float:
    """Mean of ``values`` — one per batch row — over every process (NaN when there are none).

    ``gather_for_metrics`` drops the rows a process repeats to even out the last batch, and trims what it gathers to
    that batch's row count: pass only per-row values here (sums go through :func:`gather_masked_mean`).
    """
    values = accelerator.gather_for_metrics(values.detach().float().reshape(-1))
    return values.mean().item() if values.numel() else float("nan")


def gather_masked_mean(accelerator: Any, values: torch.Tensor, mask: torch.Tensor) -> float:
    """Σ values·mask / Σ mask over every process (NaN when the mask is empty everywhere)."""
    mask = mask.float()
    totals = torch.stack([(values.detach().float() * mask).sum(), mask.sum()])
    totals = accelerator.gather(totals.unsqueeze(0)).sum(dim=0)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")


def gather_row_masked_mean(accelerator: Any, values: torch.Tensor, mask: torch.Tensor) -> float:
    """Σ values·mask / Σ mask over every process for ``(B, T)`` values whose rows are the batch's rows.

    Row sums go through ``gather_for_metrics``, which drops the rows a process repeats to even out the last batch
    (:func:`gather_masked_mean` counts them). NaN when the mask is empty everywhere.
    """
    mask = mask.float()
    rows = torch.stack([(values.detach().float() * mask).sum(dim=-1), mask.sum(dim=-1)], dim=-1)  # (B, 2)
    totals = accelerator.gather_for_metrics(rows).reshape(-1, 2).sum(dim=0)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")


def mean_over_processes(accelerator: Any, value: torch.Tensor) -> float:
    """Mean over processes of a per-process scalar (NaN-aware)."""
    value = value.detach().float().reshape(1).to(accelerator.device)
    gathered = accelerator.gather(value) if accelerator.num_processes > 1 else value
    return float(torch.nanmean(gathered))


def gather_variable_length(accelerator: Any, values: torch.Tensor) -> torch.Tensor:
    """Concatenate variable-length 1-D tensors from every process (NaN-padded, padding dropped)."""
    if accelerator.num_processes == 1:
        return values
    padded = accelerator.pad_across_processes(values.float(), dim=0, pad_index=float("nan"))
    gathered = accelerator.gather(padded)
    return gathered[~torch.isnan(gathered)]


def gather_rows(accelerator: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` over processes along dim 0 (identity on one process)."""
    if _num_processes(accelerator) == 1:
        return tensor
    device = getattr(accelerator, "device", tensor.device)
    return accelerator.gather(tensor.to(device))


def gather_objects(accelerator: Any, values: list) -> list:
    """Concatenate Python lists over processes (identity on one process)."""
    if _num_processes(accelerator) == 1:
        return values
    # the async rollout worker's virtual ranks (posttrain.rollout.multiprocess) gather over threads
    own = getattr(accelerator, "gather_python_objects", None)
    if own is not None:
        return own(values)
    from accelerate.utils import gather_object

    return gather_object(values)


def sum_over_processes(accelerator: Any, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed elementwise over processes, same shape and device (identity on one process).

    Every process must call it (a collective). The sum is not differentiable: pass detached counts and moments.
    """
    if _num_processes(accelerator) == 1:
        return tensor
    device = getattr(accelerator, "device", tensor.device)
    return accelerator.reduce(tensor.detach().to(device), reduction="sum").to(tensor.device)
