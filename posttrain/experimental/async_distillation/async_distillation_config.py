"""``AsyncDistillationConfig``: TRL's ``trl.experimental.async_distillation.AsyncDistillationConfig`` fields and
defaults over posttrain's ``DistillationConfig``.

TRL's fields and defaults: ``dtype`` "float32", ``learning_rate`` 1e-6, ``logging_steps`` 1, ``ignore_data_skip``
True, ``max_completion_length`` 2048, sampling ``temperature`` 1.0 / ``top_p`` 1.0 / ``top_k`` 0 / ``min_p`` None /
``repetition_penalty`` 1.0, ``vllm_server_base_url`` "http://localhost:8000" (the student's server, generation and
weight pushes), ``vllm_server_timeout`` 240, ``teacher_server_urls`` ``{"default": "http://localhost:8001"}``,
``request_timeout`` 600, ``weight_sync_timeout`` 1800, ``beta`` 0.0, ``teacher_temperature`` 1.0 (the divergence's
temperature, on both sides; ``temperature`` only samples), ``teacher_top_k`` 8, ``add_tail_bucket`` True,
``max_inflight_tasks`` −1 (auto), ``max_staleness`` 4, ``queue_maxsize`` 1024, ``weight_sync_steps`` 1,
``heartbeat_stale_after_s`` 300, ``log_completions`` False, ``log_completions_steps`` 100,
``num_completions_to_print`` None.

posttrain: generation always goes through a ``posttrain serve`` server (``use_vllm=True, vllm_mode="server"``);
every sample is on-policy (``lmbda`` 1.0, no ``seq_kd``, as TRL); ``max_length`` defaults to None (no prompt cut;
TRL has no such field); ``seed_requests`` seeds each generation request from ``(seed, round)``.
``token_budget`` (None → the student server's ``max_model_len``; ≤ 0 off) caps the real tokens of one forward: each
micro-batch of ``per_device_train_batch_size`` rows is forwarded and backpropagated in consecutive packs of at most
that many tokens (the step's gradient is unchanged), and a sample longer than it is dropped with a warning
(``batch/dropped_oversize_total``) — TRL's budget bounds peak memory the same way, but also lets the number of
samples per micro-batch vary, which posttrain's fixed rounds do not. ``heartbeat_stale_after_s``: the trainer raises
``RolloutWorkerError`` when the worker has made no progress (no server answer) for that long while the trainer waits
(a dead worker is detected from its exit at once). ``weight_sync_timeout``: a weight push that has not landed within
it raises ``TimeoutError`` naming it. ``log_completions_steps`` counts optimizer steps (as in
``DistillationTrainer``; TRL counts scored samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.experimental._async_config import AsyncRolloutConfig, async_rollout_field
from posttrain.trainers.distillation import DistillationConfig


@dataclass
class AsyncDistillationConfig(AsyncRolloutConfig, DistillationConfig):
    """Configuration of :class:`AsyncDistillationTrainer` (TRL's experimental ``AsyncDistillationConfig``; see the
    module docstring)."""

    # -- model -------------------------------------------------------------------------------------------------
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Dtype to load the student under ('auto', 'bfloat16', 'float16', 'float32'); a dtype in "
            "model_init_kwargs takes precedence.",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )
    max_length: int | None = field(
        default=None, metadata={"help": "Maximum prompt + completion tokens (prompts cut to leave room); None = off."}
    )
    # -- defaults overridden from TrainingArguments / DistillationConfig ---------------------------------------
    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=1, metadata={"help": "Log every X optimizer steps."})
    ignore_data_skip: bool = field(
        default=True,
        metadata={
            "help": "Always True: on resume the rollout worker restarts at the first round not yet trained on "
            "(rollout_state.json) instead of HF Trainer replaying the dataloader."
        },
    )
    max_completion_length: int | None = field(
        default=2048, metadata={"help": "Maximum number of tokens to generate per completion."}
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Generalized JSD interpolation: 0.0 = forward KL on the teacher's top-k support (+ the sampled "
            "token, + tail), > 0 = support {teacher top-1, sampled token} (just the sampled token at 1.0)."
        },
    )
    use_vllm: bool = field(
        default=True, metadata={"help": "Always True: generation runs on a server (`posttrain serve` / vLLM)."}
    )
    vllm_mode: str = field(default="server", metadata={"help": "Always 'server'."})
    vllm_server_base_url: str | None = field(
        default="http://localhost:8000",
        metadata={"help": "Base URL of the student's generation server (generation and weight pushes)."},
    )
    # -- teacher servers ---------------------------------------------------------------------------------------
    teacher_server_urls: dict[str, str] | str | None = field(
        default=None,
        metadata={
            "help": "Teacher server(s) (`posttrain serve --model TEACHER`), never updated. Defaults to "
            "{'default': 'http://localhost:8001'}. Several entries: MOPD, each row's `teacher_id` column picks its "
            "teacher. Ignored when a local teacher_model is passed to the trainer."
        },
    )
    request_timeout: int = field(
        default=600, metadata={"help": "Timeout in seconds for individual HTTP requests to any server."}
    )
    weight_sync_timeout: int = field(
        default=1800,
        metadata={
            "help": "Timeout in seconds for a weight push to the student's server. A push that does not complete "
            "within this time raises instead of hanging the run."
        },
    )
    # -- the distillation loss ---------------------------------------------------------------------------------
    teacher_temperature: float = field(
        default=1.0,
        metadata={
            "help": "Softmax temperature of the divergence, on both the teacher's log-probs (server-side) and the "
            "student's logits. Unrelated to `temperature`, which only samples."
        },
    )
    teacher_top_k: int = field(
        default=8, metadata={"help": "Candidate tokens per position requested from the teacher server."}
    )
    add_tail_bucket: bool = field(
        default=True,
        metadata={"help": "Append a tail bucket with the probability mass outside the teacher's candidates."},
    )
    token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Most real (prompt + completion) tokens per forward: micro-batches are forwarded in packs of at "
            "most this many tokens, bounding peak memory. None = the student server's max_model_len. A sample "
            "longer than token_budget is dropped with a warning (batch/dropped_oversize_total). <= 0 = off."
        },
    )
    # -- the async rollout pipeline (AsyncRolloutConfig's shared fields) ---------------------------------------
    max_inflight_tasks: int = async_rollout_field("max_inflight_tasks")
    max_staleness: int = async_rollout_field("max_staleness")
    queue_maxsize: int = async_rollout_field("queue_maxsize")
    weight_sync_steps: int = async_rollout_field("weight_sync_steps")
    heartbeat_stale_after_s: float = field(
        default=300.0,
        metadata={
            "help": "Seconds since the rollout worker's last progress (a server answer) after which the trainer "
            "treats it as hung and aborts."
        },
    )
    seed_requests: bool = async_rollout_field("seed_requests")

    _trainer_name = "AsyncDistillation"
    _VALID_DICT_FIELDS = [*DistillationConfig._VALID_DICT_FIELDS, "teacher_server_urls"]

    def __post_init__(self):
        if self.teacher_server_urls is None:
            self.teacher_server_urls = {"default": "http://localhost:8001"}
        super().__post_init__()
        if not self.teacher_server_urls:
            raise ValueError("teacher_server_urls must have at least one entry.")
        self.check_async_rollout("STUDENT")
        if self.lmbda != 1.0 or self.seq_kd:
            raise ValueError("AsyncDistillation trains on the student's own samples only: lmbda=1.0, seq_kd=False.")
        if self.max_tool_calling_iterations is not None:
            raise ValueError(
                "AsyncDistillation does not run tools (as TRL's): leave max_tool_calling_iterations=None, or use "
                "DistillationTrainer / ServerDistillationTrainer with tools=."
            )
        if self.teacher_top_k < 1:
            raise ValueError(f"teacher_top_k must be >= 1, got {self.teacher_top_k}.")
        for name in ("teacher_temperature", "heartbeat_stale_after_s", "weight_sync_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")

    # The served-teacher loss of posttrain.experimental._sparse_loss reads these names (ServerDistillation's).
    @property
    def loss_top_k(self) -> int:
        return self.teacher_top_k

    @property
    def loss_add_tail(self) -> bool:
        return self.add_tail_bucket

    @property
    def reverse_kl_top_1_mode(self) -> str:
        return "sampled"
