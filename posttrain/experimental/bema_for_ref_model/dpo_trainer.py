"""``DPOTrainer`` whose callbacks receive the reference model, so a ``BEMACallback(update_ref_model=True)`` can make
the reference track the BEMA weights of the policy. Everything else is :class:`posttrain.DPOTrainer`."""

from __future__ import annotations

from posttrain.experimental.bema_for_ref_model.callback import BEMACallback, CallbackHandlerWithRefModel
from posttrain.trainers.dpo import DPOTrainer as _DPOTrainer

__all__ = ["DPOTrainer"]


class DPOTrainer(_DPOTrainer):
    """:class:`posttrain.DPOTrainer` (same arguments) that passes ``ref_model=`` to its callbacks' events.

    The reference BEMA updates must be a separate frozen model: a PEFT policy's reference (its base with adapters
    disabled) and precomputed reference log-probs are refused when a ``BEMACallback(update_ref_model=True)`` is
    given.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        updating = any(isinstance(cb, BEMACallback) and cb.update_ref_model for cb in self.callback_handler.callbacks)
        if updating and self.reference.kind != "model":
            raise ValueError(
                f"BEMACallback(update_ref_model=True) needs a separate reference model, but this trainer's reference "
                f"is {self.reference.kind!r} (PEFT adapters or precomputed log-probs). Train without peft_config / "
                "precompute_ref_log_probs, or pass ref_model explicitly."
            )
        self.callback_handler = CallbackHandlerWithRefModel(
            self.callback_handler.callbacks,
            self.model,
            self.reference.model,
            self.processing_class,
            self.optimizer,
            self.lr_scheduler,
        )
