"""``PPOConfig``: TRL's PPO fields and defaults (``trl.experimental.ppo``) on the shared online-RL config.

Kept with TRL's names and defaults: ``num_ppo_epochs`` 4, ``num_mini_batches`` 1, ``whiten_rewards`` False,
``kl_coef`` 0.05, ``kl_estimator`` "k1", ``cliprange`` 0.2, ``vf_coef`` 0.1, ``cliprange_value`` 0.2, ``gamma`` 1.0,
``lam`` 0.95, ``response_length`` 53, ``temperature`` 0.7, ``missing_eos_penalty``, ``learning_rate`` 3e-6.
Mapped onto the shared rollout: one completion per prompt (``num_generations`` 1), ``response_length`` →
``max_completion_length``, ``num_ppo_epochs`` → ``num_iterations`` (passes over each rollout batch),
``num_mini_batches`` × ``gradient_accumulation_steps`` → ``steps_per_generation`` (micro-batches per rollout), and
``kl_coef`` → ``beta`` (a reference is loaded when it is ≠ 0). Deliberate differences: ``reward_model_path`` and
``sft_model_path`` default to None (TRL: a hub model id), ``total_episodes`` is replaced by ``max_steps`` /
``num_train_epochs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.online_config import OnlineRLConfig

_KL_ESTIMATORS = ("k1", "k3")


@dataclass
class PPOConfig(OnlineRLConfig):
    """Configuration of :class:`PPOTrainer` (TRL's ``PPOConfig`` names and defaults, see the module docstring)."""

    learning_rate: float = field(default=3e-6, metadata={"help": "The initial learning rate for AdamW."})
    reward_model_path: str | None = field(
        default=None, metadata={"help": "Path to the reward model (a sequence classifier), used as a reward source."}
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Number of epochs to train on each rollout batch."})
    num_mini_batches: int = field(default=1, metadata={"help": "Number of minibatches to split a batch into."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whether to whiten the rewards."})
    kl_coef: float = field(default=0.05, metadata={"help": "KL coefficient."})
    kl_estimator: str = field(
        default="k1",
        metadata={
            "help": "Which estimator for KL-Divergence to use: 'k1' (log π − log π_ref, unbiased, may be negative) or "
            "'k3' ((r − 1) − log r with r = π_ref/π, unbiased, lower variance, always ≥ 0).",
            "choices": list(_KL_ESTIMATORS),
        },
    )
    cliprange: float = field(default=0.2, metadata={"help": "Clip range."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value function coefficient."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range for the value function."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "Lambda value for GAE."})
    response_length: int = field(default=53, metadata={"help": "Length of the response."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={
            "help": "Penalty applied to the score when the model fails to generate an EOS token. This is useful to "
            "encourage to generate completions shorter than the maximum length (`response_length`). The penalty must "
            "be a positive value."
        },
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the policy and value head."})
    num_generations: int | None = field(default=1, metadata={"help": "Completions per prompt: always 1 (PPO)."})

    _trainer_name = "PPO"

    def __post_init__(self):
        if self.kl_estimator not in _KL_ESTIMATORS:
            raise ValueError(f"Invalid kl_estimator {self.kl_estimator!r}. Valid values: k1, k3.")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise ValueError(f"missing_eos_penalty must be a positive value, got {self.missing_eos_penalty}.")
        for name in ("num_ppo_epochs", "num_mini_batches", "response_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        self.max_completion_length = self.response_length
        self.num_iterations = self.num_ppo_epochs
        self.beta = self.kl_coef
        if self.ddp_find_unused_parameters is None:
            # The value head runs on the trunk outside the DDP forward (values use a second, direct trunk call):
            # DDP's unused-parameter search would mark v_head ready before its gradient arrives ("Expected to mark
            # a variable ready only once"). Every parameter gets a gradient each step, so no search is needed.
            self.ddp_find_unused_parameters = False
        super().__post_init__()

    def _resolve_batch_plan(self) -> None:
        """One completion per prompt; a rollout serves ``num_mini_batches × gradient_accumulation_steps``
        micro-batches, ``num_ppo_epochs`` times."""
        if self.num_generations != 1:
            raise ValueError(
                f"PPO samples one completion per prompt: num_generations must be 1, got {self.num_generations}."
            )
        steps = self.num_mini_batches * self.gradient_accumulation_steps
        if self.steps_per_generation not in (None, steps) or self.generation_batch_size not in (
            None,
            self.per_device_train_batch_size * self.world_size * steps,
        ):
            raise ValueError("PPO sizes its rollout with num_mini_batches: leave steps_per_generation and "
                             "generation_batch_size unset.")  # fmt: skip
        self.steps_per_generation = steps
        self.generation_batch_size = self.per_device_train_batch_size * self.world_size * self.steps_per_generation
        self.num_generations_eval = 1
