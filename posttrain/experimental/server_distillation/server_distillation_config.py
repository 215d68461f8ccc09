"""``ServerDistillationConfig``: TRL's fields for distilling from a served teacher."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.experimental._sparse_loss import check_sparse_options
from posttrain.trainers.distillation import DistillationConfig


@dataclass
class ServerDistillationConfig(DistillationConfig):
    """Configuration of :class:`ServerDistillationTrainer` (TRL's ``ServerDistillationConfig``).

    The teacher is never held locally: per-token teacher log-probs come from a generation server
    (``posttrain serve --model TEACHER``, ``POST /get_sequence_logprobs/``), so the loss lives on a sparse support.

    - ``teacher_model_server_url`` (required): the server's base URL, e.g. ``"http://localhost:8000"``.
    - ``loss_top_k`` (1): teacher top-k returned per token. β = 0 (forward KL): any positive k; β > 0: must be 1
      (support {teacher top-1, sampled token}). 0 (full vocabulary) is not available from a server.
    - ``loss_add_tail`` (True): a tail bucket with the mass outside the support on both sides.
    - ``reverse_kl_top_1_mode`` ("sampled"): only ``"sampled"`` (the server cannot score student-chosen tokens).
    """

    teacher_model_server_url: str | None = field(
        default=None, metadata={"help": "Base URL of the server hosting the teacher model. Required."}
    )
    loss_top_k: int = field(
        default=1,
        metadata={"help": "Teacher top-k per token; beta=0 needs k >= 1, beta > 0 needs k == 1."},
    )
    loss_add_tail: bool = field(
        default=True, metadata={"help": "Append a tail bucket with the probability mass outside the top-k support."}
    )
    reverse_kl_top_1_mode: str = field(
        default="sampled", metadata={"help": "Reverse-KL top-1 token: 'sampled' (the only mode a server supports)."}
    )

    _trainer_name = "ServerDistillation"

    def _resolve_batch_plan(self) -> None:
        super()._resolve_batch_plan()
        check_sparse_options(self, uses_server=True)
