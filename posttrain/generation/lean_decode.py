"""A decode-step forward for the group sampler that calls a causal LM's own modules without its wrapper layers.

At one token per row, a small model's decode forward is dominated by per-call Python overhead: transformers'
output-capturing and kwarg-merging decorators, the output dataclasses and the causal-mask construction (which the
sampler's boolean 4-D mask already makes void) cost ~15 % of a 2-layer model's rollout on CPU. For the common
decoder layout (``model.model`` with ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``, and ``model.lm_head``:
Llama, Qwen2/3, Mistral, ...) :class:`LeanDecoder` runs exactly those modules in the model's order: embedding,
rotary embedding, each decoder layer with the mask, positions and cache, the final norm and the LM head on the last
position.

It is only used after it proved itself on the model: the first decode step runs both the model's forward and the
lean one and compares the logits bitwise; any difference or error (an architecture that scales its embeddings in
``forward``, returns tuples from its layers, ...) turns it off for that model object for good, and the sampler keeps
the model's own forward. The check is per model object, so training (which changes weights, not structure) keeps it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["LeanDecoder"]

# model object -> verified (True) / rejected (False); absent = not checked yet
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parts(model: Any) -> tuple[Any, Any] | None:
    """``(decoder, lm_head)`` of the standard causal-LM layout, or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner, head = getattr(base, "model", None), getattr(base, "lm_head", None)
    if inner is None or head is None:
        return None
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb", "config")):
        return None
    return inner, head


def _plain_float_head(head: Any) -> bool:
    """A bias-free float32 ``nn.Linear`` with no hooks: its output is exactly ``x @ weight.T``."""
    return (
        type(head) is torch.nn.Linear
        and head.bias is None
        and head.weight.dtype == torch.float32
        and not (head._forward_hooks or head._forward_pre_hooks)
    )


class LeanDecoder:
    """Decode-step logits ``(R, V)`` float32 for one new token per row, through the model's modules directly.

    Args:
        model: The (unwrapped) causal LM the sampler decodes with.
        full_forward: The model's own decode forward, ``(input_ids, mask, position_ids) -> (R, V)``; used until the
            lean forward is verified against it, and for good if it is rejected.
        cache_kw: The decoder layers' KV-cache argument name (``cache`` or ``past_key_values``).
    """

    def __init__(self, model: Any, full_forward: Callable[..., torch.Tensor], cache_kw: str):
        self.model = model
        self.full_forward = full_forward
        self.cache_kw = cache_kw
        self.parts = _parts(model)
        if self.parts is None:
            _VERDICTS[model] = False

    @property
    def active(self) -> bool:
        """Whether the lean forward is (or may become, after its check) the decode path."""
        return _VERDICTS.get(self.model, True)

    def __call__(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        out: torch.Tensor | None = None,
    ):
        """Logits ``(R, V)``; the lean forward writes them into ``out`` (an ``(R, V)`` float32 buffer the caller
        reuses every step, so no vocabulary-sized tensor is allocated per step) when the head is a plain
        float32 ``nn.Linear`` without bias."""
        step = (input_ids, mask, position_ids, cache)
        verdict = _VERDICTS.get(self.model)
        if verdict is False:
            return self.full_forward(*step)
        if verdict is True:
            return self._lean(*step, out)
        return self._check(step, out)

    def _lean(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        out: torch.Tensor | None = None,
    ):
        inner, head = self.parts
        hidden = inner.embed_tokens(input_ids)  # (R, 1, d)
        position_embeddings = inner.rotary_emb(hidden, position_ids)
        kwargs = {self.cache_kw: cache}
        for layer in inner.layers[: inner.config.num_hidden_layers]:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=True,
                **kwargs,
            )
        last = inner.norm(hidden[:, -1:, :])  # (R, 1, d)
        if out is not None and _plain_float_head(head) and not torch.is_grad_enabled():
            return torch.mm(last[:, -1, :], head.weight.T, out=out)  # F.linear's own kernel, into the buffer
        return head(last)[:, -1, :].float()  # (R, V)

    def _check(self, step: tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any], out: torch.Tensor | None):
        """Run the lean forward, roll the cache back, run the model's forward; keep the lean one if bitwise equal.

        The model's forward runs last and rewrites the positions the lean one wrote, so the cache ends as the
        model's forward leaves it whatever the lean forward did (a partial write, different values, an error).
        """
        cache = step[3]
        before = [layer.get_seq_length() for layer in cache.layers]
        try:
            lean = self._lean(*step, out)
        except Exception as error:  # noqa: BLE001 - any failure means "not this architecture"
            logger.debug("lean decode forward rejected for %s: %r", type(self.model).__name__, error)
            lean = None
        for layer, length in zip(cache.layers, before):
            grown = layer.get_seq_length() - length
            if grown:
                layer.crop(-grown)
        reference = self.full_forward(*step)
        ok = isinstance(lean, torch.Tensor) and lean.shape == reference.shape and torch.equal(lean, reference)
        _VERDICTS[self.model] = ok
        if lean is not None and not ok:
            logger.debug("lean decode forward differs from %s's forward; using the model's", type(self.model).__name__)
        return reference
