"""``A2POConfig``: TRL's A*-PO fields and defaults on top of the shared online-RL config.

TRL's fields keep their names and defaults (``max_prompt_length`` 512, ``max_completion_length`` 256,
``temperature`` 1.0, ``top_p`` 1.0, ``top_k`` None, ``num_value_samples`` 8, ``beta1`` 0.5, ``filter_all_incorrect``
True, ``beta2`` 1e-3, ``reward_weights``, ``learning_rate`` 5e-5 as HF's). Stage 2 draws one completion per prompt
and generates for every micro-step, so ``num_generations`` is 1, ``steps_per_generation`` 1 and ``num_iterations`` 1.
``beta`` (the shared field that loads π_ref when ≠ 0) is set to ``beta2``: A*-PO always needs the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.online_config import OnlineRLConfig


@dataclass
class A2POConfig(OnlineRLConfig):
    """Configuration of :class:`A2POTrainer` (TRL's ``A2POConfig`` names and defaults)."""

    learning_rate: float = field(default=5e-5, metadata={"help": "The initial learning rate for AdamW."})
    max_prompt_length: int | None = field(
        default=512,
        metadata={"help": "Maximum length of the prompt. If the prompt is longer than this, it is left-truncated."},
    )
    max_completion_length: int | None = field(
        default=256, metadata={"help": "Maximum length of the generated completion."}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature, used in both Stage 1 and Stage 2 generation."}
    )
    top_k: int | None = field(
        default=None,
        metadata={"help": "Number of highest-probability vocabulary tokens to keep. If `None`, top-k filtering is off."},
    )
    num_value_samples: int = field(
        default=8, metadata={"help": "Number of samples drawn from the reference policy per prompt to estimate `V*`."}
    )
    beta1: float = field(default=0.5, metadata={"help": "KL temperature used to estimate `V*` in Stage 1."})
    filter_all_incorrect: bool = field(
        default=True, metadata={"help": "Whether to drop prompts for which all reference samples are incorrect."}
    )
    beta2: float = field(default=1e-3, metadata={"help": "KL temperature used in the Stage 2 regression target."})
    num_generations: int | None = field(
        default=1, metadata={"help": "Stage-2 completions per prompt: always 1 (A*-PO)."}
    )

    _trainer_name = "A2PO"

    def __post_init__(self):
        if self.top_k is None:
            self.top_k = 0
        if self.num_value_samples < 1:
            raise ValueError(f"num_value_samples must be >= 1, got {self.num_value_samples}.")
        if self.beta1 <= 0 or self.beta2 <= 0:
            raise ValueError(f"beta1 and beta2 must be > 0, got {self.beta1} and {self.beta2}.")
        self.beta = self.beta2
        super().__post_init__()

    def _resolve_batch_plan(self) -> None:
        """One completion per prompt, generated every micro-step (TRL's A*-PO stage 2)."""
        if self.num_generations != 1:
            raise ValueError(f"A*-PO samples one completion per prompt: num_generations must be 1, got {self.num_generations}.")
        if self.num_iterations != 1 or self.steps_per_generation not in (None, 1):
            raise ValueError("A*-PO generates for every micro-step: leave num_iterations=1 and steps_per_generation unset.")
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be a positive integer, got {self.max_completion_length}.")
        self.steps_per_generation = 1
        self.generation_batch_size = self.per_device_train_batch_size * self.world_size
        self.num_generations_eval = 1
