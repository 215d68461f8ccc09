"""``OnlineDPOConfig``: TRL's Online DPO fields and defaults on top of the shared online-RL config.

TRL's ``OnlineDPOConfig`` fields keep their names and defaults (``max_new_tokens`` 64, ``max_length`` 512,
``temperature`` 0.9, ``beta`` [0.1], ``loss_type`` "sigmoid", ``missing_eos_penalty``, ``reward_model_path``,
``disable_dropout`` True, ``learning_rate`` 5e-7, ``vllm_gpu_memory_utilization`` 0.55). The generation, vLLM and
logging fields are the shared ``OnlineRLConfig``'s. The batch arithmetic is TRL's: ``per_device_train_batch_size``
counts *prompts*, each sampled twice, one generation per micro-step (so ``num_generations`` is 2,
``steps_per_generation`` 1 and ``num_iterations`` 1; other values are rejected), and ``max_completion_length``
follows ``max_new_tokens``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from posttrain.trainers.online_config import OnlineRLConfig

_LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class OnlineDPOConfig(OnlineRLConfig):
    """Configuration of :class:`OnlineDPOTrainer` (TRL's ``OnlineDPOConfig`` names and defaults)."""

    learning_rate: float = field(default=5e-7, metadata={"help": "The initial learning rate for AdamW."})
    reward_model_path: str | None = field(
        default=None,
        metadata={
            "help": "Path to the reward model. As in TRL, the trainer does not read it: scripts load it and pass it "
            "in `reward_funcs` (`python -m posttrain.experimental.run online_dpo` does)."
        },
    )
    max_new_tokens: int = field(default=64, metadata={"help": "Maximum number of tokens to generate per completion."})
    max_length: int = field(
        default=512,
        metadata={
            "help": "Maximum total length of the sequence (prompt + completion) used to compute log probabilities. If "
            "the sequence exceeds this limit, the leftmost tokens will be truncated to preserve as much of the "
            "completion as possible."
        },
    )
    temperature: float = field(
        default=0.9,
        metadata={"help": "Temperature for sampling. The higher the temperature, the more random the completions."},
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={
            "help": "Penalty applied to the score when the model fails to generate an EOS token. This is useful to "
            "encourage to generate completions shorter than the maximum length (`max_new_tokens`). The penalty must "
            "be a positive value."
        },
    )
    beta: list[float] = field(
        default_factory=lambda: [0.1],
        metadata={
            "help": "Parameter controlling the deviation from the reference model. Higher β means less deviation from "
            "the reference model. For the IPO loss (`loss_type='ipo'`), β is the regularization parameter τ. If a "
            "list of floats is provided then the β is selected for each new epoch and the last β is used for the "
            "rest of the epochs."
        },
    )
    loss_type: str = field(
        default="sigmoid", metadata={"help": "Type of loss to use.", "choices": list(_LOSS_TYPES)}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Whether to disable dropout in the model."})
    vllm_gpu_memory_utilization: float = field(default=0.55, metadata={"help": "Colocate: GPU memory fraction."})
    num_generations: int | None = field(
        default=2, metadata={"help": "Completions per prompt: always 2 (a chosen/rejected pair)."}
    )

    _trainer_name = "OnlineDPO"

    def __post_init__(self):
        if isinstance(self.beta, str):
            self.beta = [float(b) for b in self.beta.strip("[]").split(",")]
        if isinstance(self.beta, (int, float)):
            self.beta = float(self.beta)
        elif hasattr(self.beta, "__len__") and len(self.beta) == 1:
            self.beta = float(self.beta[0])
        elif hasattr(self.beta, "__len__") and len(self.beta) == 0:
            raise ValueError("beta must be a float or a non-empty list of floats.")
        else:
            self.beta = [float(b) for b in self.beta]
        if self.loss_type not in _LOSS_TYPES:
            raise ValueError(f"Invalid loss_type {self.loss_type!r}. Valid values: {', '.join(_LOSS_TYPES)}.")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise ValueError(f"missing_eos_penalty must be a positive value, got {self.missing_eos_penalty}.")
        self.max_completion_length = self.max_new_tokens
        super().__post_init__()
        if self.max_new_tokens >= self.max_length:
            warnings.warn(
                f"The configuration has `max_new_tokens` ({self.max_new_tokens}) >= `max_length` ({self.max_length}). "
                "This will cause prompts to be truncated or completely removed in the forward pass. To preserve "
                "prompts, ensure e.g. `max_length > max_new_tokens + 512`.",
                stacklevel=3,
            )

    def _resolve_batch_plan(self) -> None:
        """TRL's Online DPO batches: ``per_device_train_batch_size`` prompts × 2 completions, generated every
        micro-step."""
        if self.num_generations != 2:
            raise ValueError(f"Online DPO samples a pair per prompt: num_generations must be 2, got {self.num_generations}.")
        if self.num_iterations != 1:
            raise ValueError(f"Online DPO generates for every micro-step: num_iterations must be 1, got {self.num_iterations}.")
        if self.steps_per_generation not in (None, 1) or self.generation_batch_size not in (
            None,
            2 * self.per_device_train_batch_size * self.world_size,
        ):
            raise ValueError(
                "Online DPO generates for every micro-step: leave steps_per_generation and generation_batch_size unset "
                "(per_device_train_batch_size counts prompts; each gets 2 completions)."
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}.")
        self.steps_per_generation = 1
        self.generation_batch_size = 2 * self.per_device_train_batch_size * self.world_size
        self.num_generations_eval = 2
