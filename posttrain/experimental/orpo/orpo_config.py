"""ORPOConfig: TRL's ``trl.experimental.orpo.ORPOConfig`` fields and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.experimental._pairwise_config import ReferenceFreePairwiseConfig, pairwise_field


@dataclass
class ORPOConfig(ReferenceFreePairwiseConfig):
    """Configuration for :class:`~posttrain.experimental.orpo.ORPOTrainer` (TRL's ``ORPOConfig``).

    Only ORPO-specific fields are listed; everything else is ``transformers.TrainingArguments`` with TRL's overrides
    (``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` automatic, ``learning_rate=1e-6``).
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
        metadata={"help": "λ in the paper: the weight of the relative (odds-ratio) loss against the NLL loss."},
    )
    disable_dropout: bool = pairwise_field("disable_dropout")
    padding_value: int | None = field(
        default=None, metadata={"help": "Padding value to use; None: the tokenizer's pad token id."}
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
        if self.beta < 0:
            raise ValueError(f"beta (ORPO's λ) must be >= 0, got {self.beta}.")
        super().__post_init__()  # ReferenceFreePairwiseConfig: the shared checks
