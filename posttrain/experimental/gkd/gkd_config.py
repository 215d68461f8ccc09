"""``GKDConfig``: TRL's GKD fields and defaults on posttrain's distillation config."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.distillation import DistillationConfig


@dataclass
class GKDConfig(DistillationConfig):
    """Configuration of :class:`~posttrain.experimental.gkd.GKDTrainer` (TRL's ``GKDConfig``).

    GKD's own fields, with TRL's defaults: ``temperature`` 0.9, ``lmbda`` 0.5 (fraction of on-policy slices),
    ``beta`` 0.5 (generalized JSD), ``max_new_tokens`` 128, ``seq_kd`` False, ``disable_dropout`` True,
    ``teacher_model_name_or_path`` / ``teacher_model_init_kwargs``. Generation samples with ``top_k`` 0 and
    ``top_p`` 1.0 as TRL's GKD does; the learning rate defaults to SFT's 2e-5 (TRL's ``GKDConfig`` extends
    ``SFTConfig``).

    ``max_new_tokens`` sets the completion budget; ``max_completion_length`` (the shared online field) follows it
    unless set explicitly. Everything else is :class:`~posttrain.trainers.distillation.DistillationConfig`'s.
    """

    learning_rate: float = field(default=2e-5, metadata={"help": "The initial learning rate for AdamW."})
    temperature: float = field(
        default=0.9,
        metadata={"help": "Temperature for sampling; the JSD loss uses the raw logits (TRL). Higher: more random."},
    )
    lmbda: float = field(
        default=0.5,
        metadata={"help": "Student data fraction: the probability that a batch uses on-policy student samples."},
    )
    beta: float = field(
        default=0.5,
        metadata={
            "help": "Generalized JSD interpolation: 0.0 = KL(teacher||student), 1.0 = KL(student||teacher), "
            "0.5 = JSD."
        },
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Maximum number of tokens to generate per completion."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Completion budget; None: max_new_tokens (GKD's field)."}
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass for on-policy generation."})
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the student (TRL's GKD default)."})

    _trainer_name = "GKD"

    def _resolve_batch_plan(self) -> None:
        if self.max_new_tokens is None or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}.")
        if self.max_completion_length is None:
            self.max_completion_length = self.max_new_tokens
        super()._resolve_batch_plan()
