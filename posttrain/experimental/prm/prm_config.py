"""PRMConfig: TRL's ``trl.experimental.prm.PRMConfig`` fields and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.base import BaseConfig


@dataclass
class PRMConfig(BaseConfig):
    """Configuration for :class:`~posttrain.experimental.prm.PRMTrainer` (TRL's ``PRMConfig``).

    Only PRM-specific fields are listed; everything else is ``transformers.TrainingArguments`` with TRL's overrides
    (``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` automatic, ``learning_rate=1e-5``).
    """

    learning_rate: float = field(default=1e-5, metadata={"help": "The initial learning rate for AdamW."})
    max_length: int | None = field(
        default=1024,
        metadata={"help": "Maximum length of the sequences (prompt + completion) used for truncation."},
    )
    max_completion_length: int | None = field(
        default=None,
        metadata={
            "help": "Maximum length of the completion used for truncation. The completion is the concatenation of "
            "the steps."
        },
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Whether to disable dropout in the model."})
    step_separator: str = field(
        default="\n", metadata={"help": "Separator used to separate each step of the reasoning process."}
    )
    train_on_last_step_only: bool = field(default=False, metadata={"help": "Whether to train only on the last step."})
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow models and tokenizers with custom code from the hub (`model` as a string). It lives here "
            "since `ModelConfig` no longer declares it (TRL 1.7)."
        },
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Number of processes to use for processing the dataset."}
    )

    def __post_init__(self):
        if not self.step_separator:
            raise ValueError("step_separator must be a non-empty string (its last token carries each step's label).")
        for name in ("max_length", "max_completion_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {value}.")
        super().__post_init__()
