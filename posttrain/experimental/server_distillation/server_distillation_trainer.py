"""``ServerDistillationTrainer``: on-policy distillation from a teacher behind a generation server.

The student samples (or takes dataset completions, ``lmbda``) exactly as in
:class:`~posttrain.trainers.distillation.DistillationTrainer`; instead of a local teacher forward, each
micro-batch's ``[prompt | completion]`` sequences are sent to ``teacher_model_server_url``
(``POST /get_sequence_logprobs/`` of ``posttrain serve``, TRL's ``vllm-serve`` call), which returns the teacher's
top-``loss_top_k`` log-probs and the log-prob of each actual token. The loss is the generalized JSD on that sparse
support with an optional tail bucket (``core.distill.sparse_support_divergence``), summed over tokens and divided
by the optimizer step's completion tokens. The teacher must use the student's tokenizer.

Metrics: ``loss``, ``distillation_loss``, ``entropy``, ``completions/*``, ``num_tokens``.
"""

from __future__ import annotations

from typing import Any

from posttrain.experimental._distill_support import ServedTeacher
from posttrain.experimental._sparse_loss import SparseDistillationLoss
from posttrain.experimental.server_distillation.server_distillation_config import ServerDistillationConfig
from posttrain.trainers.distillation import DistillationLoss, DistillationTrainer


class ServerDistillationTrainer(DistillationTrainer):
    """TRL's ``ServerDistillationTrainer(model, args, train_dataset, ...)``: as :class:`DistillationTrainer`
    without a local teacher (``teacher_model`` must be None; the teacher is ``args.teacher_model_server_url``). The
    loss is the :class:`SparseDistillationLoss` strategy on the served teacher's support."""

    config_class = ServerDistillationConfig
    _trainer_name = "ServerDistillation"
    _tag_names = ["posttrain", "server-distillation", "distillation"]
    loss_strategy: DistillationLoss = SparseDistillationLoss()
    served_teacher: ServedTeacher | None = None  # the teacher server's client, made on first use

    def __init__(self, model: Any, teacher_model: Any = None, args: ServerDistillationConfig | None = None, **kwargs):
        super().__init__(model, teacher_model, args, **kwargs)

    def _uses_teacher_server(self, args: Any) -> bool:
        return True
