"""``BEMACallback`` with reference-model updates, and the callback handler that hands callbacks the reference."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.trainer_callback import CallbackHandler

from posttrain.callbacks import BEMACallback as _BEMACallback

logger = logging.getLogger(__name__)

__all__ = ["BEMACallback", "CallbackHandlerWithRefModel"]


class CallbackHandlerWithRefModel(CallbackHandler):
    """A ``transformers`` ``CallbackHandler`` that also passes ``ref_model=`` to every callback event."""

    def __init__(self, callbacks, model, ref_model, processing_class, optimizer, lr_scheduler):
        super().__init__(callbacks, model, processing_class, optimizer, lr_scheduler)
        self.ref_model = ref_model

    def call_event(self, event, args, state, control, **kwargs):
        return super().call_event(event, args, state, control, ref_model=self.ref_model, **kwargs)


class BEMACallback(_BEMACallback):
    r"""``posttrain.BEMACallback`` that can also load the BEMA weights into the reference model, making the
    reference a lagged, smoothed copy of the policy (use it with
    :class:`posttrain.experimental.bema_for_ref_model.DPOTrainer`).

    Args:
        update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier, device: As
            :class:`posttrain.BEMACallback`.
        update_ref_model: Whether to update the reference model with the BEMA weights.
        ref_model_update_freq: Update the reference model every this many steps.
        ref_model_update_after: Steps to wait before the first reference update.
    """

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: int = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str = "cpu",
        update_ref_model: bool = False,
        ref_model_update_freq: int = 400,
        ref_model_update_after: int = 0,
    ):
        super().__init__(update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier, device)
        if ref_model_update_freq < 1:
            raise ValueError(f"ref_model_update_freq must be >= 1, got {ref_model_update_freq}.")
        self.update_ref_model = update_ref_model
        self.ref_model_update_freq = ref_model_update_freq
        self.ref_model_update_after = ref_model_update_after

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.update_ref_model and kwargs.get("ref_model") is None:
            raise ValueError(
                "BEMACallback(update_ref_model=True) needs a separate reference model, but the trainer passed none. "
                "Use posttrain.experimental.bema_for_ref_model.DPOTrainer without PEFT and without "
                "precompute_ref_log_probs (its reference is then a frozen copy that BEMA can update)."
            )
        super().on_train_begin(args, state, control, model=model, **kwargs)

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        super().on_step_end(args, state, control, model=model, **kwargs)
        step = state.global_step
        if not self.update_ref_model or step < self.ref_model_update_after:
            return
        if (step - self.ref_model_update_after) % self.ref_model_update_freq != 0:
            return
        ref_model = self._unwrap_model(kwargs["ref_model"])
        _load_weights(ref_model, self.running_model)
        logger.info("BEMACallback: updated the reference model with the BEMA weights at step %d", step)


def _load_weights(target: torch.nn.Module, source: Any) -> None:
    """Copy ``source``'s weights into ``target`` (same architecture; devices may differ); keys must match."""
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
        raise ValueError(
            "The reference model's parameters do not match the policy's (missing: "
            f"{missing[:3]}, unexpected: {unexpected[:3]}); BEMA can only update a reference of the same architecture."
        )
