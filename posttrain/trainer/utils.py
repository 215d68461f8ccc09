"""TRL's ``trl.trainer.utils`` helpers that users import: ``selective_log_softmax`` (as in TRL's DPO customization
guide), ``entropy_from_logits``, ``pad``, ``flush_left``, ``nanstd``/``nanmin``/``nanmax``, ``RepeatSampler``,
``remove_none_values``, ``disable_dropout_in_model``, ``get_peft_config``, ``get_quantization_config``.

Each is posttrain's implementation (``posttrain.core``, ``posttrain.data``, ``posttrain.models``,
``posttrain.cli.configs``); only ``selective_log_softmax`` is wrapped here, to take TRL's ``temperature`` and
``row_mask`` arguments and ``(..., K)`` indices.
"""

from __future__ import annotations

import torch

from posttrain.cli.configs import get_kbit_device_map, get_peft_config, get_quantization_config
from posttrain.core.logprobs import entropy_from_logits
from posttrain.core.logprobs import selective_log_softmax as _chunked_selective_log_softmax
from posttrain.core.masking import flush_left, nanmax, nanmin, nanstd
from posttrain.data.collators import pad
from posttrain.data.utils import remove_none_values
from posttrain.models.loading import disable_dropout_in_model
from posttrain.rollout.sampler import RepeatSampler

__all__ = [
    "RepeatSampler",
    "disable_dropout_in_model",
    "entropy_from_logits",
    "flush_left",
    "get_kbit_device_map",
    "get_peft_config",
    "get_quantization_config",
    "nanmax",
    "nanmin",
    "nanstd",
    "pad",
    "remove_none_values",
    "selective_log_softmax",
]


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``index``, without a full log-softmax tensor.

    Equals ``torch.gather(logits.log_softmax(-1), -1, index.unsqueeze(-1)).squeeze(-1)`` for an ``index`` of shape
    ``(...)``, and ``torch.gather(logits.log_softmax(-1), -1, index)`` for ``(..., K)`` (e.g. top-K ids).

    Args:
        logits: ``(..., V)`` logits.
        index: ``(...)`` or ``(..., K)`` token ids.
        temperature: Divides the logits first; must be positive.
        row_mask: Same shape as ``index``; entries where it is 0 return log-probability 0.

    Returns:
        Log-probabilities with the shape of ``index`` (float32 for ``(...)`` indices, as posttrain computes them).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}.")
    if temperature != 1.0:
        logits = logits / temperature
    if index.dim() == logits.dim() - 1:
        out = _chunked_selective_log_softmax(logits, index)
    elif index.dim() == logits.dim() and index.shape[:-1] == logits.shape[:-1]:
        # (..., K): logp_k = z_k − logsumexp(z), one log-sum-exp per position
        lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        out = torch.gather(logits.float(), -1, index.long()) - lse
    else:
        raise ValueError(
            f"index of shape {tuple(index.shape)} does not fit logits of shape {tuple(logits.shape)}: use "
            "(...) or (..., K) with the logits' leading dimensions."
        )
    if row_mask is not None:
        out = torch.where(row_mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out
