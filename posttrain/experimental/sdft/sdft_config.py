"""``SDFTConfig``: TRL's ``trl.experimental.sdft.SDFTConfig`` fields and defaults on posttrain's online-RL config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from posttrain.core.self_distillation import DISTILLATION_MODES
from posttrain.experimental._self_distillation_options import check_self_distillation_options
from posttrain.models.teacher_sync import TEACHER_MODEL_KINDS
from posttrain.rollout.sampler import check_eval_batch
from posttrain.trainers.online_config import OnlineRLConfig

# OnlineRLConfig fields of GRPO/RLOO's policy-gradient loss and reference model: SDFT has neither, so a value other
# than the default would silently do nothing.
_POLICY_GRADIENT_FIELDS = (
    "beta",
    "reward_weights",
    "epsilon",
    "epsilon_high",
    "sync_ref_model",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
)


@dataclass
class SDFTConfig(OnlineRLConfig):
    """Configuration of :class:`~posttrain.experimental.sdft.SDFTTrainer` (TRL's ``SDFTConfig``, same defaults).

    SDFT's own fields:

    - the loss: ``distillation_mode`` ("topk_logits"; or "full_logits", "sampled_token"), ``distillation_alpha``
      (0.5; 0 = forward KL(teacher‖student), 1 = reverse KL, else the generalized JSD; ``sampled_token`` needs 1.0),
      ``distillation_topk`` (100), ``distillation_add_tail`` (False), ``distillation_is_clip`` (2.0; None = off: the
      cap of the importance ratio π_θ/π_old when a rollout outlives an optimizer step), ``num_loss_tokens_to_skip``
      (0);
    - the teacher: ``teacher_model_kind`` ("base" initial student, "live" current student, "ema" moving average),
      ``teacher_update_rate`` (0.05), ``teacher_sync_steps`` (1) — see :mod:`posttrain.models.teacher_sync`;
    - the teacher prompt: ``teacher_prompt_template`` ("{prompt}\\n\\n{privileged_context}"), filled from each row's
      ``prompt`` (the last user turn's text for conversational prompts) and ``privileged_context``;
      ``generate_from_teacher`` (False) samples the completions from the teacher prompt instead;
    - ``use_teacher_server`` (False): the live teacher's log-probs come from the generation server
      (``use_vllm=True, vllm_mode="server"``: ``POST /get_sequence_logprobs/`` on the teacher prompts), top-k on the
      teacher's own support.

    The generation fields, ``num_generations`` (8), ``generation_batch_size`` / ``steps_per_generation``,
    ``num_iterations``, ``max_completion_length`` (256) and ``max_prompt_length`` (512, cut on the left) follow TRL's
    SDFT rules (as GRPO's, but one generation per prompt is allowed). Defaults that differ from posttrain's online
    config, as in TRL: ``learning_rate`` 5e-5, ``disable_dropout`` True.
    """

    learning_rate: float = field(default=5e-5, metadata={"help": "The initial learning rate for AdamW."})
    disable_dropout: bool = field(
        default=True, metadata={"help": "Whether to disable dropout in the student and teacher models."}
    )
    max_prompt_length: int | None = field(
        default=512, metadata={"help": "Maximum prompt length. Longer prompts are truncated from the left."}
    )
    max_completion_length: int | None = field(
        default=256, metadata={"help": "Maximum length of the generated completion."}
    )
    # -- teacher -----------------------------------------------------------------------------------------------------
    teacher_model_kind: str = field(
        default="base",
        metadata={
            "help": "Semantic teacher choice for SDFT. `base` uses the initial student, `live` uses the current "
            "student, and `ema` uses an exponentially averaged teacher.",
            "choices": list(TEACHER_MODEL_KINDS),
        },
    )
    teacher_update_rate: float = field(
        default=0.05,
        metadata={
            "help": 'EMA update rate used when `teacher_model_kind="ema"`. A value of `1.0` reduces the update to a '
            "hard overwrite, periodically resyncing the teacher to the current student weights."
        },
    )
    teacher_sync_steps: int = field(default=1, metadata={"help": "Number of optimizer steps between teacher updates."})
    # -- loss --------------------------------------------------------------------------------------------------------
    distillation_alpha: float = field(
        default=0.5, metadata={"help": "Divergence interpolation coefficient for SDFT top-k logit distillation."}
    )
    distillation_mode: str = field(
        default="topk_logits",
        metadata={
            "help": "Distillation objective mode. SDFT defaults to top-k logit distillation.",
            "choices": list(DISTILLATION_MODES),
        },
    )
    distillation_topk: int | None = field(
        default=100, metadata={"help": "Number of top tokens used by the default SDFT top-k logit objective."}
    )
    distillation_is_clip: float | None = field(
        default=2.0,
        metadata={
            "help": "Clipping coefficient for importance sampling in self-distillation. `None` disables clipping."
        },
    )
    distillation_add_tail: bool = field(
        default=False, metadata={"help": "Whether to add a tail bucket for non-top-k probability mass."}
    )
    num_loss_tokens_to_skip: int = field(
        default=0, metadata={"help": "Number of initial completion tokens to exclude from the distillation loss."}
    )
    # -- teacher prompt ----------------------------------------------------------------------------------------------
    generate_from_teacher: bool = field(
        default=False,
        metadata={
            "help": "Whether on-policy generation should use the teacher-conditioned prompt instead of the student "
            "prompt."
        },
    )
    teacher_prompt_template: str = field(
        default="{prompt}\n\n{privileged_context}",
        metadata={
            "help": "Template used to combine the student prompt and privileged context into the teacher prompt."
        },
    )
    use_teacher_server: bool = field(
        default=False,
        metadata={
            "help": "Compute teacher logprobs from the running vLLM generation server instead of a local teacher "
            "forward. Only supported for `teacher_model_kind='live'` with `use_vllm=True` and `vllm_mode='server'`, "
            "and `distillation_mode` in {'sampled_token', 'topk_logits'} (the server returns the teacher's top-k "
            "logprobs, not the full vocabulary; `topk_logits` distills over the teacher's own top-k support)."
        },
    )

    _trainer_name = "SDFT"

    def __post_init__(self):
        for name in _POLICY_GRADIENT_FIELDS:
            default = next(f.default for f in dataclasses.fields(OnlineRLConfig) if f.name == name)
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is a GRPO/RLOO option with no effect on SDFT; remove it."
                )
        super().__post_init__()  # TrainingArguments, the shared online checks, then _resolve_batch_plan below

    def _resolve_batch_plan(self) -> None:
        """TRL's SDFT rules: GRPO's generation-batch arithmetic without the ``num_generations >= 2`` floor, plus the
        loss, teacher and template checks."""
        check_self_distillation_options(self)
        if self.num_loss_tokens_to_skip < 0:
            raise ValueError(f"num_loss_tokens_to_skip must be >= 0, got {self.num_loss_tokens_to_skip}.")
        if (
            "{prompt}" not in self.teacher_prompt_template
            or "{privileged_context}" not in self.teacher_prompt_template
        ):
            raise ValueError(
                "teacher_prompt_template must contain both `{prompt}` and `{privileged_context}` placeholders"
            )
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}.")
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be a positive integer, got {self.max_completion_length}.")
        if self.num_generations is None or self.num_generations < 1:
            raise ValueError(f"num_generations must be at least 1, got {self.num_generations}.")
        global_batch = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is None and self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = global_batch * self.steps_per_generation
        elif self.generation_batch_size is not None and self.steps_per_generation is None:
            if self.generation_batch_size % global_batch != 0:
                raise ValueError(
                    f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global batch size "
                    f"({global_batch})."
                )
            self.steps_per_generation = self.generation_batch_size // global_batch
        elif self.generation_batch_size is None:
            if self.steps_per_generation < 1:
                raise ValueError(f"steps_per_generation must be >= 1, got {self.steps_per_generation}.")
            self.generation_batch_size = global_batch * self.steps_per_generation
        else:
            raise ValueError("'generation_batch_size' and 'steps_per_generation' can not both be configured")
        if self.generation_batch_size % self.num_generations != 0:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by num_generations "
                f"({self.num_generations})."
            )
        if self.do_eval and str(getattr(self.eval_strategy, "value", self.eval_strategy)) != "no":
            check_eval_batch(
                self.per_device_eval_batch_size, self.world_size, self.num_generations_eval or self.num_generations
            )
