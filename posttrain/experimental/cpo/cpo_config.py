"""CPOConfig: TRL's ``trl.experimental.cpo.CPOConfig`` fields and defaults."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.experimental._pairwise_config import ReferenceFreePairwiseConfig, pairwise_field

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")


@dataclass
class CPOConfig(ReferenceFreePairwiseConfig):
    """Configuration for :class:`~posttrain.experimental.cpo.CPOTrainer` (TRL's ``CPOConfig``).

    Only CPO-specific fields are listed; everything else is ``transformers.TrainingArguments`` with TRL's overrides
    (``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` automatic, ``learning_rate=1e-6``).
    ``loss_type="alphapo"`` is TRL's shorthand: it becomes ``loss_type="simpo"`` with ``cpo_alpha=0.0``.
    """

    # older TRL's `max_prompt_length` (cut the prompt only when the row is too long, then the completions) is
    # reproduced for this config: posttrain.legacy
    legacy_pair_prompt_rule: ClassVar[bool] = True

    learning_rate: float = pairwise_field("learning_rate")
    max_length: int | None = pairwise_field("max_length")
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Maximum length of each completion (cut before max_length applies)."}
    )
    beta: float = field(
        default=0.1,
        metadata={
            "help": "β: the temperature of the preference loss. For the IPO loss (loss_type='ipo'), β is the "
            "regularization parameter denoted by τ in the paper."
        },
    )
    label_smoothing: float = field(default=0.0, metadata={"help": "Label smoothing factor (sigmoid / simpo)."})
    loss_type: str = field(
        default="sigmoid",
        metadata={
            "help": "Type of loss to use: 'sigmoid', 'hinge', 'ipo', 'simpo' or 'alphapo' (= 'simpo' with "
            "cpo_alpha=0.0).",
            "choices": list(CPO_LOSS_TYPES),
        },
    )
    disable_dropout: bool = pairwise_field("disable_dropout")
    cpo_alpha: float = field(default=1.0, metadata={"help": "Weight of the BC regularizer (NLL of chosen) in CPO."})
    simpo_gamma: float = field(
        default=0.5, metadata={"help": "Target reward margin for the SimPO loss, used only when loss_type='simpo'."}
    )
    alpha: float = field(
        default=0.0,
        metadata={
            "help": "Alpha parameter that controls the reward shape across all loss types. alpha=0 (default) uses "
            "standard log probability rewards; alpha != 0 applies the AlphaPO transformation r = (1 - p^(-alpha)) / "
            "alpha from the AlphaPO paper."
        },
    )
    generate_during_eval: bool = field(
        default=False, metadata={"help": "Not supported by posttrain (TRL: log generations to W&B during eval)."}
    )
    is_encoder_decoder: bool | None = field(
        default=None, metadata={"help": "Whether the model is an encoder-decoder model (only decoder-only here)."}
    )
    trust_remote_code: bool = pairwise_field("trust_remote_code")
    dataset_num_proc: int | None = pairwise_field("dataset_num_proc")

    def __post_init__(self):
        if self.loss_type == "alphapo":  # TRL's syntactic sugar for AlphaPO
            self.loss_type = "simpo"
            self.cpo_alpha = 0.0
        if self.loss_type == "kto_pair":
            raise ValueError("Support for kto_pair has been removed in CPOTrainer. Please use KTOTrainer.")
        if self.loss_type not in CPO_LOSS_TYPES:
            raise ValueError(f"Unknown loss_type {self.loss_type!r}. Valid names: {', '.join(CPO_LOSS_TYPES)}.")
        if self.loss_type in ("hinge", "ipo") and self.label_smoothing > 0:
            warnings.warn(
                f"You are using the {self.loss_type} loss type that does not support label smoothing. The "
                "`label_smoothing` parameter will be ignored. Set `label_smoothing` to `0.0` to remove this warning.",
                UserWarning,
                stacklevel=3,
            )
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must lie in [0, 0.5), got {self.label_smoothing}.")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}.")
        super().__post_init__()  # ReferenceFreePairwiseConfig: the shared checks
