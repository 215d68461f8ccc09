"""``GMPOConfig``: ``GRPOConfig`` with GMPO's loss and its log-space clipping range (TRL's fields and defaults).

Importing this package registers the ``"gmpo"`` loss preset (``core.presets.register_grpo_loss_preset``): the
``gmpo`` objective with a per-sequence mean, which keeps a ``(B, T)`` KL term added to the ``(B, 1)`` geometric-mean
loss per sequence. The stable ``GRPOConfig`` does not offer it (TRL's ``GRPOConfig`` has no ``gmpo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.core.presets import register_grpo_loss_preset
from posttrain.trainers.grpo import GRPOConfig

GMPO_LOSS_TYPE = "gmpo"
register_grpo_loss_preset(GMPO_LOSS_TYPE, "gmpo", "seq_mean_token_mean")


@dataclass
class GMPOConfig(GRPOConfig):
    """Configuration of :class:`GMPOTrainer`: every ``GRPOConfig`` field; ``epsilon`` / ``epsilon_high`` are in log
    space (ratio clip range ``(exp(-epsilon), exp(epsilon_high))``), with GMPO's default 0.4.

    ``loss_type`` defaults to ``"gmpo"`` (the preset this module registers: the ``gmpo`` objective with a
    per-sequence mean); TRL's GMPO trainer ignores ``loss_type``, posttrain's reads it, so another value trains that
    GRPO loss instead.
    """

    epsilon: float = field(
        default=0.4,
        metadata={
            "help": "Lower-bound clipping value, expressed in log space. The lower bound of the per-token importance "
            "ratio is exp(-epsilon). GMPO recommends 0.4."
        },
    )
    loss_type: str = field(
        default="gmpo",
        metadata={"help": "'gmpo' (the geometric-mean objective, default) or any GRPO loss type."},
    )

    _trainer_name = "GMPO"
