"""``IWOPDConfig``: TRL's IW-OPD fields and defaults on posttrain's distillation config."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.experimental._sparse_loss import check_sparse_options
from posttrain.trainers.distillation import DistillationConfig

_OBJECTIVES = ("iw_opd", "jsd")


@dataclass
class IWOPDConfig(DistillationConfig):
    """Configuration of :class:`~posttrain.experimental.iw_opd.IWOPDTrainer` (TRL's ``IWOPDConfig``).

    On top of :class:`~posttrain.trainers.distillation.DistillationConfig` (``lmbda`` 1.0, ``beta`` 1.0,
    ``temperature`` 1.0, ``max_completion_length`` 512, the teacher and generation fields):

    - ``distillation_objective`` ("iw_opd"): ``"iw_opd"`` is the sampled-token objective
      −w_t·a_t·log π_θ(y_t) with a_t = log π_T(y_t) − log π_rollout(y_t) (the sampler's log-prob of the sampled
      token, as TRL's vLLM path; the current student's when the batch has none) and prefix weights
      w_t = 1 + γ(1 − Σ_{s<t}|a_s| / Σ_s|a_s|) (``core.distill.iw_opd_loss``); it is on-policy (needs ``lmbda`` 1.0).
      ``"jsd"`` is the generalized JSD, on the top-``loss_top_k`` support (0: the full vocabulary).
    - ``iw_opd_gamma`` (0.5): importance-weight amplification γ; ``iw_opd_epsilon`` (1e-8): stabiliser of Σ|a|.
    - ``loss_top_k`` (1), ``loss_add_tail`` (True), ``reverse_kl_top_1_mode`` ("sampled"): the sparse support of the
      ``"jsd"`` objective (teacher top-k for forward KL, student top-k for reverse KL, their union for mixed JSD;
      with ``loss_top_k`` 1 and β > 0 the reverse token is the sampled one or the student's argmax), plus a tail
      bucket for the rest of the mass.
    - ``use_teacher_server`` (False) / ``teacher_model_server_url``: fetch the teacher's log-probs from a generation
      server (``posttrain serve``, ``POST /get_sequence_logprobs/``) instead of running a local teacher.
    """

    distillation_objective: str = field(
        default="iw_opd",
        metadata={"help": "'iw_opd' (sampled-token Importance-Weighted OPD) or 'jsd' (generalized JSD/KL)."},
    )
    iw_opd_gamma: float = field(
        default=0.5, metadata={"help": "Importance-weight amplification for distillation_objective='iw_opd'."}
    )
    iw_opd_epsilon: float = field(
        default=1e-8, metadata={"help": "Stabilizer used when normalizing IW-OPD prefix weights."}
    )
    reverse_kl_top_1_mode: str = field(
        default="sampled",
        metadata={"help": "Reverse-KL top-1 token when beta > 0 and loss_top_k == 1: 'sampled' or 'argmax'."},
    )
    use_teacher_server: bool = field(
        default=False, metadata={"help": "Fetch teacher log-probs from a generation server instead of a local model."}
    )
    teacher_model_server_url: str | None = field(
        default=None, metadata={"help": "Base URL of the teacher server (required with use_teacher_server=True)."}
    )
    loss_top_k: int = field(
        default=1,
        metadata={"help": "Top tokens of the sparse JSD/KL support (0: full vocabulary); see the class docstring."},
    )
    loss_add_tail: bool = field(
        default=True, metadata={"help": "Append a tail bucket with the probability mass outside the top-k support."}
    )

    _trainer_name = "IWOPD"

    def _resolve_batch_plan(self) -> None:
        super()._resolve_batch_plan()
        if self.distillation_objective not in _OBJECTIVES:
            raise ValueError(
                f"distillation_objective must be one of {_OBJECTIVES}, got {self.distillation_objective!r}."
            )
        if self.distillation_objective == "iw_opd" and self.lmbda != 1.0:
            raise ValueError(
                f"distillation_objective='iw_opd' is on-policy and requires lmbda=1.0 (got lmbda={self.lmbda})."
            )
        if self.iw_opd_gamma < 0:
            raise ValueError(f"iw_opd_gamma must be >= 0, got {self.iw_opd_gamma}.")
        if not self.iw_opd_epsilon > 0:
            raise ValueError(f"iw_opd_epsilon must be > 0, got {self.iw_opd_epsilon}.")
        check_sparse_options(self, self.use_teacher_server)
