"""BEMA for the reference model: DPO whose reference policy tracks the BEMA weights of the policy (TRL's
``trl.experimental.bema_for_ref_model``)."""

from posttrain.experimental.bema_for_ref_model.callback import BEMACallback, CallbackHandlerWithRefModel
from posttrain.experimental.bema_for_ref_model.dpo_trainer import DPOTrainer

__all__ = ["BEMACallback", "CallbackHandlerWithRefModel", "DPOTrainer"]
