"""``GKDTrainer``: TRL's GKD trainer on posttrain's distillation machinery.

TRL's ``GKDTrainer`` wraps ``SFTTrainer``: each batch of SFT-style data (conversational ``"messages"``, or
``"prompt"`` / ``"completion"``) is replaced with probability ``lmbda`` by the student's own samples (on-policy),
otherwise kept (or, with ``seq_kd``, replaced by teacher samples), and the loss is the generalized JSD between the
student's and the teacher's token distributions over the completion (at temperature 1: TRL's GKD uses
``temperature`` for sampling only, unlike its DistillationTrainer). That is exactly
:class:`~posttrain.trainers.distillation.DistillationTrainer`'s round and loss, so this class only carries GKD's
name, config and defaults (``GKDConfig``); data, metrics (``loss``, ``distillation_loss``, ``entropy``,
``completions/*``), checkpoints and generation backends are the distillation trainer's.
"""

from __future__ import annotations

from posttrain.experimental.gkd.gkd_config import GKDConfig
from posttrain.trainers.distillation import DistillationTrainer


class GKDTrainer(DistillationTrainer):
    """Generalized Knowledge Distillation with TRL's ``GKDTrainer(model, teacher_model, args, ...)`` signature.

    See :class:`~posttrain.trainers.distillation.DistillationTrainer` for the arguments; ``args`` is a
    :class:`GKDConfig` (None → defaults with ``output_dir=f"{model_name}-GKD"``). The dataset is SFT-style: a
    ``"messages"`` column (the last assistant turn is the completion) or ``"prompt"``/``"completion"``.
    """

    config_class = GKDConfig
    keeps_short_last_round = True  # TRL's plain Trainer dataloader keeps an epoch's short last batch
    shuffles_generation_batch = False  # TRL's GKD trains its dataloader's batches in order
    _trainer_name = "GKD"
    _tag_names = ["posttrain", "gkd"]
    dataset_truncation = "keep_end"  # TRL's ChatML collator: a dataset row keeps its last max_length tokens

    def _loss_temperature(self) -> float:
        """1.0: TRL's GKD divides the logits by ``temperature`` when sampling only, never in the JSD loss."""
        return 1.0
