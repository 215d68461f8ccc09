"""A tree attention mask that makes a model's sdpa attention compute only the blocks the mask allows.

The shared-prompt layout (:mod:`posttrain.models.prefix_sharing`) hands the model a dense ``(K, 1, L, L)`` boolean
mask; sdpa's kernels compute all ``L²`` scores of a pack whatever the mask says. :class:`TreeAttentionMask` is that
same boolean tensor carrying a :class:`~posttrain.core.block_attention.BlockIndex`: when the model's attention calls
``scaled_dot_product_attention`` with it as ``attn_mask`` (transformers' sdpa integration passes a 4-D mask through
unchanged, in the forward and in a gradient-checkpointing recompute alike), the call becomes
:func:`~posttrain.core.block_attention.block_attention` — the same attention over the allowed (query, key) pairs
only. Every other use of the tensor (eager attention's additive conversion, shape checks, a model that slices or
converts the mask) sees a plain boolean tensor, so such models run the dense attention, still correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.core.block_attention import BlockIndex, block_attention

__all__ = ["TreeAttentionMask"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class TreeAttentionMask(torch.Tensor):
    """A ``(K, 1, L, L)`` bool attention mask whose sdpa calls run as block attention (see the module docstring).

    Build with :meth:`wrap`; ``blocks`` (one bucket or several) must cover every True entry of the mask for the rows
    they query.
    """

    blocks: tuple[BlockIndex, ...]

    @staticmethod
    def wrap(mask: torch.Tensor, blocks: BlockIndex | Sequence[BlockIndex]) -> TreeAttentionMask:
        """``mask`` (same storage) as a :class:`TreeAttentionMask` carrying ``blocks``."""
        if mask.dim() != 4 or mask.dtype != torch.bool:
            raise ValueError(f"TreeAttentionMask wraps a 4-D bool mask, got {tuple(mask.shape)} {mask.dtype}.")
        out = mask.as_subclass(TreeAttentionMask)
        out.blocks = (blocks,) if isinstance(blocks, BlockIndex) else tuple(blocks)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            result = _block_sdpa(args, kwargs)
            if result is not None:
                return result
        with torch._C.DisableTorchFunctionSubclass():  # everything else: a plain bool tensor, plain results
            return func(*args, **kwargs)


def _block_sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Block attention for an sdpa call on the packs' own ``(K, H, L, D)`` tensors, None when it does not apply
    (dropout, ``is_causal``, other shapes: e.g. a mask broadcast or sliced by the caller)."""
    call = dict(zip(_SDPA_ARGS, args), **kwargs)
    mask = call.get("attn_mask")
    if not isinstance(mask, TreeAttentionMask) or call.get("dropout_p") or call.get("is_causal"):
        return None
    query, key, value = call["query"], call["key"], call["value"]
    packs, _, length, _ = mask.shape
    if query.dim() != 4 or query.shape[0] != packs or query.shape[2] != length or key.shape[2] != length:
        return None
    return block_attention(
        query, key, value, mask.blocks, scale=call.get("scale"), enable_gqa=bool(call.get("enable_gqa", False))
    )
