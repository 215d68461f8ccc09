"""Importance-Weighted On-Policy Distillation (TRL's ``trl.experimental.iw_opd``)."""

from posttrain.experimental.iw_opd.iw_opd_config import IWOPDConfig
from posttrain.experimental.iw_opd.iw_opd_trainer import IWOPDTrainer

__all__ = ["IWOPDConfig", "IWOPDTrainer"]
