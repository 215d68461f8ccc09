"""``AsyncGRPOConfig``: TRL's ``trl.experimental.async_grpo.AsyncGRPOConfig`` fields and defaults over GRPOConfig.

The asynchronous pipeline's fields are TRL's (``max_staleness`` 4, ``weight_sync_steps`` 1, ``max_inflight_tasks``
−1 = auto, ``queue_maxsize`` 1024, ``request_timeout`` 600, ``vllm_server_base_url`` ``"http://localhost:8000"``,
``max_completion_length`` 2048, ``logging_steps`` 1, ``lr_scheduler_type`` ``"constant"``, ``num_completions_to_print``
3, ``ignore_data_skip`` True); every GRPO loss field (``loss_type``, ``beta``, ``epsilon``, the
``vllm_importance_sampling_*`` correction, ...) carries over from ``GRPOConfig``. Generation always goes through a
server (``use_vllm=True, vllm_mode="server"``: ``posttrain serve`` or ``posttrain vllm-serve``).

posttrain adds ``partial_rollout_max_tokens`` (None: off; partial rollouts, see ``posttrain.rollout.partial``) and
``heartbeat_stale_after_s`` (300, as AsyncDistillation): the trainer aborts with
``RolloutWorkerError`` when the rollout worker has made no progress for that long; with ``request_timeout`` and the
``/health`` probe of ``vllm_server_health_check_interval`` (GRPOConfig's) no wait on the server is unbounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.experimental._async_config import AsyncRolloutConfig, async_rollout_field
from posttrain.trainers.grpo import GRPOConfig


@dataclass
class AsyncGRPOConfig(AsyncRolloutConfig, GRPOConfig):
    """Configuration of :class:`AsyncGRPOTrainer` (TRL's experimental ``AsyncGRPOConfig``; see the module docstring)."""

    logging_steps: float = field(default=1, metadata={"help": "Log every X optimizer steps."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "The scheduler type to use."})
    max_completion_length: int | None = field(
        default=2048, metadata={"help": "Maximum number of tokens to generate per completion."}
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata={
            "help": "Always True in effect: on resume the rollout worker restarts at the first round not yet trained "
            "on (rollout_state.json) instead of HF Trainer replaying the dataloader."
        },
    )
    num_completions_to_print: int | None = field(
        default=3, metadata={"help": "Number of completions to print when `log_completions=True`."}
    )
    use_vllm: bool = field(
        default=True, metadata={"help": "Always True: generation runs on a server (`posttrain serve` / vLLM)."}
    )
    vllm_mode: str = field(default="server", metadata={"help": "Always 'server'."})
    vllm_server_base_url: str | None = field(
        default="http://localhost:8000", metadata={"help": "Base URL of the generation server."}
    )
    request_timeout: int = field(
        default=600, metadata={"help": "Timeout in seconds for individual HTTP requests to the server."}
    )
    # -- the async rollout pipeline (AsyncRolloutConfig's shared fields) ---------------------------------------
    max_inflight_tasks: int = async_rollout_field("max_inflight_tasks")
    max_staleness: int = async_rollout_field("max_staleness")
    queue_maxsize: int = async_rollout_field("queue_maxsize")
    weight_sync_steps: int = async_rollout_field("weight_sync_steps")
    heartbeat_stale_after_s: float | None = field(
        default=300.0,
        metadata={
            "help": "posttrain: seconds since the rollout worker's last progress (a server answer, an admission poll, "
            "a queued round) after which the trainer treats it as hung and aborts with RolloutWorkerError. None = "
            "no heartbeat check."
        },
    )
    seed_requests: bool = async_rollout_field("seed_requests")
    partial_rollout_max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "posttrain: partial rollouts (opt-in; None = whole rounds). The rollout worker generates in passes "
            "of at most this many new tokens per completion: groups that finished train at once, unfinished "
            "completions are cut and continue (prompt + partial completion) under the next weights. Every token "
            "keeps the weight version that sampled it: the IS correction and the max_staleness rule are per token "
            "(sample/version_lag_frac/<k>). Use it when completion lengths are long-tailed. Needs max_staleness >= "
            "1; not with tools, environment_factory or rollout_func."
        },
    )

    _trainer_name = "AsyncGRPO"

    def __post_init__(self):
        super().__post_init__()
        self.check_async_rollout()
        if self.heartbeat_stale_after_s is not None and not self.heartbeat_stale_after_s > 0:
            raise ValueError(f"heartbeat_stale_after_s must be > 0 (or None), got {self.heartbeat_stale_after_s}.")
        self._check_partial_rollouts()
        if self.steps_per_generation != self.gradient_accumulation_steps:
            raise ValueError(
                "AsyncGRPO generates one optimizer step's worth of samples per round: leave steps_per_generation / "
                "generation_batch_size unset (steps_per_generation = gradient_accumulation_steps)."
            )

    def _check_partial_rollouts(self) -> None:
        """``partial_rollout_max_tokens``: a positive budget below ``max_completion_length`` (else no round is ever
        cut), and ``max_staleness >= 1`` (a continued completion has tokens from an older version than the step
        that trains it)."""
        budget = self.partial_rollout_max_tokens
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"partial_rollout_max_tokens must be a positive integer or None, got {budget!r}.")
        if self.keep_routing:
            raise ValueError(
                "keep_routing=True cannot be combined with partial_rollout_max_tokens: a continued completion is "
                "prefilled again under newer weights, so one row's routing would mix two samplers. Set "
                "partial_rollout_max_tokens=None (whole rounds) or keep_routing=False."
            )
        if self.max_completion_length is not None and budget >= self.max_completion_length:
            raise ValueError(
                f"partial_rollout_max_tokens={budget} >= max_completion_length={self.max_completion_length}: no "
                "completion would ever be cut. Lower partial_rollout_max_tokens, or set it to None for whole rounds."
            )
        if self.max_staleness < 1:
            raise ValueError(
                "partial_rollout_max_tokens needs max_staleness >= 1: a completion cut and continued under the next "
                "weights holds tokens one version older than the step that trains it, which max_staleness=0 drops. "
                "Raise max_staleness or set partial_rollout_max_tokens=None."
            )
