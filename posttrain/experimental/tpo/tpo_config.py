"""TPOConfig: TRL's ``trl.experimental.tpo.TPOConfig`` fields and defaults."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from posttrain.experimental._pairwise_config import ReferenceFreePairwiseConfig, pairwise_field

TPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "tpo-l")


@dataclass
class TPOConfig(ReferenceFreePairwiseConfig):
    """Configuration for :class:`~posttrain.experimental.tpo.TPOTrainer` (TRL's ``TPOConfig``).

    Only TPO-specific fields are listed; everything else is ``transformers.TrainingArguments`` with TRL's overrides
    (``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` automatic, ``learning_rate=5e-7``).
    """

    learning_rate: float = pairwise_field("learning_rate", default=5e-7)
    trust_remote_code: bool = pairwise_field("trust_remote_code")
    disable_dropout: bool = pairwise_field("disable_dropout")
    dataset_num_proc: int | None = pairwise_field("dataset_num_proc")
    max_length: int | None = pairwise_field(
        "max_length",
        help="Maximum length of the tokenized sequence (prompt + completion). Sequences longer than max_length are "
        "truncated from the left or right depending on truncation_mode. None: no truncation.",
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={
            "help": "Truncation mode to use when the sequence exceeds max_length.",
            "choices": ["keep_end", "keep_start"],
        },
    )
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"help": "If set, the sequences will be padded to a multiple of this value."}
    )
    loss_type: str = field(
        default="sigmoid",
        metadata={
            "help": "Contrastive loss between chosen and rejected: 'sigmoid', 'hinge', 'ipo' or 'tpo-l' "
            "(length-normalized with a target reward margin tpo_l_gamma).",
            "choices": list(TPO_LOSS_TYPES),
        },
    )
    beta: float = field(
        default=0.01,
        metadata={"help": "β: the temperature of the contrastive loss (τ for IPO)."},
    )
    label_smoothing: float = field(default=0.0, metadata={"help": "Label smoothing factor."})
    tpo_alpha: float = field(
        default=1.0,
        metadata={"help": "Weight of the NLL term on the gold (reference) response; 0 drops that branch."},
    )
    tpo_l_gamma: float = field(
        default=0.5, metadata={"help": "Target reward margin γ for the TPO-L loss, used only when loss_type='tpo-l'."}
    )

    def __post_init__(self):
        if self.loss_type not in TPO_LOSS_TYPES:
            raise ValueError(f"Unknown loss_type {self.loss_type!r}. Valid names: {', '.join(TPO_LOSS_TYPES)}.")
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end', got {self.truncation_mode!r}.")
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
        if self.tpo_alpha < 0:
            raise ValueError(f"tpo_alpha must be >= 0, got {self.tpo_alpha}.")
        super().__post_init__()  # ReferenceFreePairwiseConfig: the shared checks (max_length >= 1, ...)
