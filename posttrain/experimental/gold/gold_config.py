"""``GOLDConfig``: TRL's GOLD fields and defaults on posttrain's distillation config."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.distillation import DistillationConfig

_MERGE_STRATEGIES = ("observed", "bayesian")


@dataclass
class GOLDConfig(DistillationConfig):
    """Configuration of :class:`~posttrain.experimental.gold.GOLDTrainer` (TRL's ``GOLDConfig``).

    GKD's scheduling (``lmbda`` 0.5, ``beta`` 0.5, ``seq_kd``, ``temperature`` 0.9, ``top_p`` 0.95, ``top_k`` 0,
    ``max_completion_length`` 128, learning rate 1e-7) plus Universal Logit Distillation for a teacher with another
    tokenizer:

    - ``use_uld_loss`` (False): the ULD loss (sorted-probability L1, ``core.uld``) instead of the generalized JSD
      (which needs a shared vocabulary). ``teacher_tokenizer_name_or_path``: the teacher's tokenizer (default: the
      one saved with the teacher).
    - ``use_extended_uld`` (True): align the two tokenizations by byte offsets of the completion text and merge the
      probabilities of split tokens (``uld_token_merge_strategy`` "observed" or "bayesian"); False: positional
      truncation to the shorter side, as in the ULD paper.
    - ``uld_use_hybrid_loss`` (False): generalized JSD (``beta``) on tokens whose strings both vocabularies contain,
      sorted L1 on the rest, weighted by ``uld_hybrid_matched_weight`` / ``uld_hybrid_unmatched_weight`` (both None:
      the matched share of the teacher vocabulary).
    - ``uld_crossentropy_weight`` (0.0) × cross-entropy on the completion tokens + ``uld_distillation_weight``
      (1.0) × ULD; ``uld_student_temperature`` / ``uld_teacher_temperature`` (1.0); ``uld_skip_student_eos`` /
      ``uld_skip_teacher_eos`` (True).
    """

    learning_rate: float = field(default=1e-7, metadata={"help": "The initial learning rate for AdamW."})
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature (and the JSD's)."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling mass for on-policy generation."})
    lmbda: float = field(default=0.5, metadata={"help": "Probability that a batch uses on-policy student samples."})
    beta: float = field(default=0.5, metadata={"help": "Generalized JSD interpolation (also the hybrid matched part)."})
    max_completion_length: int | None = field(default=128, metadata={"help": "Maximum generated tokens."})
    teacher_tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "The teacher's tokenizer (ULD); None: the one saved with the teacher."}
    )
    use_uld_loss: bool = field(
        default=False, metadata={"help": "Use the Universal Logit Distillation loss instead of the generalized JSD."}
    )
    uld_token_merge_strategy: str = field(
        default="observed",
        metadata={"help": "'observed' (first position × later tokens' probabilities) or 'bayesian' (chain rule)."},
    )
    use_extended_uld: bool = field(
        default=True, metadata={"help": "Align tokenizations by byte offsets and merge split tokens' probabilities."}
    )
    uld_use_hybrid_loss: bool = field(
        default=False, metadata={"help": "JSD on vocabulary-matched tokens, sorted L1 on the others."}
    )
    uld_hybrid_matched_weight: float | None = field(
        default=None, metadata={"help": "Weight of the matched part (None with the unmatched weight: adaptive)."}
    )
    uld_hybrid_unmatched_weight: float | None = field(
        default=None, metadata={"help": "Weight of the unmatched part (None with the matched weight: adaptive)."}
    )
    uld_crossentropy_weight: float = field(default=0.0, metadata={"help": "Weight of the cross-entropy term."})
    uld_distillation_weight: float = field(default=1.0, metadata={"help": "Weight of the ULD term."})
    uld_student_temperature: float = field(default=1.0, metadata={"help": "Student softmax temperature in ULD."})
    uld_teacher_temperature: float = field(default=1.0, metadata={"help": "Teacher softmax temperature in ULD."})
    uld_skip_student_eos: bool = field(default=True, metadata={"help": "Leave the student's EOS out of ULD."})
    uld_skip_teacher_eos: bool = field(default=True, metadata={"help": "Leave the teacher's EOS out of ULD."})

    _trainer_name = "GOLD"

    def _resolve_batch_plan(self) -> None:
        super()._resolve_batch_plan()
        if self.uld_token_merge_strategy not in _MERGE_STRATEGIES:
            raise ValueError(
                f"uld_token_merge_strategy must be one of {_MERGE_STRATEGIES}, got {self.uld_token_merge_strategy!r}."
            )
        if (self.uld_hybrid_matched_weight is None) != (self.uld_hybrid_unmatched_weight is None):
            raise ValueError(
                "uld_hybrid_matched_weight and uld_hybrid_unmatched_weight must both be None (adaptive weights) or "
                "both be set."
            )
        for name in ("uld_student_temperature", "uld_teacher_temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
        if self.use_uld_loss and self.seq_kd:
            raise ValueError(
                "seq_kd=True with use_uld_loss=True is not supported: teacher samples are in the teacher's tokenizer."
            )
