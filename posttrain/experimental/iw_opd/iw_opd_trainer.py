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
``completions/*``. Difference from TRL: the advantage's behaviour log-prob is the student's current one (TRL uses
vLLM's rollout log-probs when it has them; with one optimizer step per round they coincide up to sampling
processing).
"""

from __future__ import annotations

from posttrain.experimental._sparse_trainer import SparseDistillationMixin
from posttrain.experimental.iw_opd.iw_opd_config import IWOPDConfig
from posttrain.trainers.distillation import DistillationTrainer


class IWOPDTrainer(SparseDistillationMixin, DistillationTrainer):
    """TRL's ``IWOPDTrainer(model, teacher_model, args, ...)``; see :class:`DistillationTrainer` for the arguments.

    ``teacher_model`` must be None when ``args.use_teacher_server`` is set (the teacher is at
    ``args.teacher_model_server_url``).
    """

    config_class = IWOPDConfig
    _trainer_name = "IWOPD"
    _tag_names = ["posttrain", "iw-opd", "distillation"]
