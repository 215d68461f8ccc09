"""``IWOPDTrainer``: Importance-Weighted On-Policy Distillation ("On the Position Bias of On-Policy Distillation",
https://huggingface.co/papers/2606.22600) on posttrain's distillation machinery.

On-policy distillation's sampled-token objective weighs every completion token alike, so tokens generated after the
student has drifted from the teacher (whose supervision is then out of distribution) count as much as early ones.
IW-OPD reweights each token's update by how little prefix discrepancy has accumulated before it
(``core.distill.iw_opd_weights``). The round (student samples), batching and checkpoints are
:class:`~posttrain.trainers.distillation.DistillationTrainer`'s; the teacher is local or served
(``use_teacher_server``).

Metrics (TRL's names): ``loss``, ``distillation_loss``, ``entropy``, ``iw_opd/mean_advantage``,
``iw_opd/mean_abs_advantage``, ``iw_opd/mean_weight``, ``iw_opd/min_weight``, ``iw_opd/max_weight``,
``completions/*``.

The behaviour log-prob in the advantage a_t = log π_T(y_t) − log π_rollout(y_t) is the *sampler's*, as in TRL: TRL's
vLLM generation requests ``logprobs=0`` (with ``logprobs_mode="processed_logprobs"``) for the IW-OPD objective and
stores the sampled tokens' log-probs as ``rollout_logprobs``, which ``_compute_iw_opd_loss`` uses; only its
``model.generate`` fallback, which records none, uses the student's current (detached) log-probs. posttrain's
samplers always return them, so the rollout records them (``sampling_per_token_logps``, under the sampling
distribution after temperature / top-k / top-p / min-p) and the loss uses them; they differ from the current
student's when the sampler truncates the distribution (top-k, top-p) or runs stale weights (``vllm_sync_frequency``
> 1). A batch without them (dataset completions) falls back to the current log-probs, as TRL does.
"""

from __future__ import annotations

from typing import Any

from posttrain.experimental._distill_support import ServedTeacher
from posttrain.experimental._sparse_loss import SparseDistillationLoss
from posttrain.experimental.iw_opd.iw_opd_config import IWOPDConfig
from posttrain.trainers.distillation import DistillationLoss, DistillationTrainer


class IWOPDTrainer(DistillationTrainer):
    """TRL's ``IWOPDTrainer(model, teacher_model, args, ...)``; see :class:`DistillationTrainer` for the arguments.

    ``teacher_model`` must be None when ``args.use_teacher_server`` is set (the teacher is at
    ``args.teacher_model_server_url``). The loss is the :class:`SparseDistillationLoss` strategy.
    """

    config_class = IWOPDConfig
    shuffles_generation_batch = False  # TRL's IW-OPD splits its generation batch unshuffled
    _trainer_name = "IWOPD"
    _tag_names = ["posttrain", "iw-opd", "distillation"]
    dataset_truncation = "fill"  # TRL's IW-OPD collator: the completion fills what the prompt leaves of max_length
    loss_strategy: DistillationLoss = SparseDistillationLoss()
    served_teacher: ServedTeacher | None = None  # the teacher server's client (use_teacher_server), made on first use

    def _uses_teacher_server(self, args: Any) -> bool:
        return bool(args.use_teacher_server)

    def _wants_sampling_logprobs(self) -> bool:
        """The IW-OPD advantage's behaviour log-probs come from the sampler (TRL's ``rollout_logprobs``)."""
        return self.args.distillation_objective == "iw_opd"
