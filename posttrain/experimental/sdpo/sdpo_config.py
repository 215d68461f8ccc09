"""``SDPOConfig``: ``GRPOConfig`` plus TRL's SDPO fields (self-distillation loss, teacher, re-prompting, diagnostics).

TRL's ``SDPOConfig`` names and defaults (``trl.experimental.sdpo``, TRL 1.16). Where they differ from GRPO's, TRL's
SDPO values win: ``learning_rate`` 5e-5 (HF's default; TRL's SDPO does not lower it), ``disable_dropout`` True,
``max_completion_length`` 256, ``max_prompt_length`` 512 (left truncation), and ``epsilon_high`` resolved to
``epsilon`` when unset. Every other GRPO field (``loss_type``, ``beta``, ``scale_rewards``, vLLM, ...) keeps its
meaning for the policy term of the loss.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from posttrain.core.self_distillation import DISTILLATION_MODES
from posttrain.experimental._self_distillation_options import check_self_distillation_options
from posttrain.models.teacher_sync import TEACHER_MODEL_KINDS
from posttrain.trainers.grpo import GRPOConfig

# Placeholders each template is formatted with (TRL's names).
TEMPLATE_FIELDS = {
    "reprompt_template": ("prompt", "solution", "feedback"),
    "solution_template": ("successful_previous_attempt",),
    "feedback_template": ("feedback_raw",),
}


@dataclass
class SDPOConfig(GRPOConfig):
    """Configuration of :class:`~posttrain.experimental.sdpo.SDPOTrainer` (TRL's ``SDPOConfig``).

    The loss is ``(1 - distillation_weight) * policy_loss + distillation_weight * distillation_loss``: the policy
    term is GRPO's (``loss_type``, clipping, β·KL), the distillation term distils the teacher conditioned on a
    successful rollout of the same group (and optionally environment feedback, the ``privileged_context`` column)
    into the policy. The fields below are TRL's; GRPO's are documented on :class:`~posttrain.GRPOConfig`.
    """

    # -- GRPO fields whose SDPO defaults differ -----------------------------------------------------------------
    learning_rate: float = field(default=5e-5, metadata={"help": "The initial learning rate for AdamW."})
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Whether to disable dropout in the model (so that the student and the teacher passes see the "
            "same network)."
        },
    )
    max_prompt_length: int | None = field(
        default=512,
        metadata={"help": "Maximum prompt length. Longer prompts are truncated from the left. None = no limit."},
    )
    max_completion_length: int | None = field(
        default=256, metadata={"help": "Maximum length of the generated completion."}
    )
    use_teacher_server: bool = field(
        default=False,
        metadata={
            "help": "Compute teacher logprobs from the running vLLM generation server instead of a local teacher "
            "forward. Only supported for `teacher_model_kind='live'` with `use_vllm=True`, `vllm_mode='server'`, "
            "`distillation_weight=1.0` (pure distillation), and `distillation_mode` in {'sampled_token', "
            "'topk_logits'} (the server returns the teacher's top-k logprobs, not the full vocabulary; `topk_logits` "
            "distills over the teacher's own top-k support)."
        },
    )
    # -- the SDPO loss ------------------------------------------------------------------------------------------
    distillation_weight: float = field(
        default=1.0,
        metadata={
            "help": "Convex combination weight between the policy and self-distillation objectives. The loss is "
            "`(1 - distillation_weight) * policy_loss + distillation_weight * distillation_loss`. Must be in [0, 1]. "
            "1.0 (default) trains purely on self-distillation, 0.0 falls back to the GRPO policy gradient, and "
            "intermediate values blend both."
        },
    )
    distillation_alpha: float = field(
        default=1.0,
        metadata={
            "help": "Divergence interpolation coefficient (0 = forward KL, 1 = reverse KL, 0.5 = Jensen-Shannon). "
            "Sampled-token SDPO requires the reverse-KL setting `distillation_alpha=1.0`."
        },
    )
    distillation_mode: str = field(
        default="sampled_token",
        metadata={
            "help": "Distillation objective mode: 'sampled_token' (default; reverse KL at the sampled tokens, "
            "requires distillation_alpha=1.0), 'full_logits' or 'topk_logits'.",
            "choices": list(DISTILLATION_MODES),
        },
    )
    distillation_topk: int | None = field(
        default=None,
        metadata={
            "help": "Top-k approximation for logit-level SDPO. Must be set when `distillation_mode=topk_logits` and "
            "left unset otherwise."
        },
    )
    distillation_is_clip: float | None = field(
        default=2.0,
        metadata={"help": "Clipping coefficient for importance sampling in self-distillation. None disables it."},
    )
    distillation_add_tail: bool = field(
        default=False, metadata={"help": "Whether to add a tail bucket for non-top-k probability mass."}
    )
    # -- the teacher --------------------------------------------------------------------------------------------
    teacher_model_kind: str = field(
        default="ema",
        metadata={
            "help": "Semantic teacher choice. 'base' uses the initial student, 'live' uses the current student, "
            "and 'ema' uses an exponentially averaged teacher.",
            "choices": list(TEACHER_MODEL_KINDS),
        },
    )
    teacher_update_rate: float = field(
        default=0.05, metadata={"help": "Teacher update rate used for EMA teacher synchronization."}
    )
    teacher_sync_steps: int = field(default=1, metadata={"help": "How often to synchronize the EMA teacher model."})
    # -- re-prompting -------------------------------------------------------------------------------------------
    max_reprompt_len: int = field(
        default=10240, metadata={"help": "Maximum length for reprompting in self-distillation."}
    )
    use_successful_as_teacher: bool = field(
        default=True, metadata={"help": "Use successful rollouts as implicit feedback for self-distillation."}
    )
    success_reward_threshold: float = field(
        default=1.0, metadata={"help": "Minimum reward for a rollout to be considered a successful demonstration."}
    )
    dont_reprompt_on_self_success: bool = field(
        default=True, metadata={"help": "Skip reprompting when model generates correct response."}
    )
    reprompt_template: str = field(
        default="{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n",
        metadata={"help": "Template for reprompting the teacher with a successful demonstration."},
    )
    solution_template: str = field(
        default="\nCorrect solution:\n\n{successful_previous_attempt}\n\n",
        metadata={"help": "Template for formatting the successful demonstration text."},
    )
    feedback_template: str = field(
        default="\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n",
        metadata={"help": "Template for formatting environment feedback for reprompting."},
    )
    include_environment_feedback: bool = field(
        default=False,
        metadata={"help": "Whether to include environment feedback in teacher reprompts when available."},
    )
    environment_feedback_only_without_solution: bool = field(
        default=False,
        metadata={"help": "Whether to use feedback only when no successful solution is available."},
    )
    remove_thinking_from_demonstration: bool = field(
        default=False, metadata={"help": "Whether to remove <think>...</think> blocks from the demonstration text."}
    )
    # -- diagnostics --------------------------------------------------------------------------------------------
    diagnostics_warning_interval: int = field(
        default=10,
        metadata={
            "help": "Emit repeated trainer diagnostics every N consecutive degenerate steps. Set to 0 to disable."
        },
    )
    diagnostics_flat_tolerance: float = field(
        default=1e-8,
        metadata={
            "help": "Tolerance used to decide whether reward variance or reprompt activity is effectively zero."
        },
    )

    _trainer_name = "SDPO"

    def __post_init__(self):
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon  # TRL's SDPOConfig resolves it here
        self._check_sdpo_options()

    def _check_sdpo_options(self) -> None:
        if not 0.0 <= self.distillation_weight <= 1.0:
            raise ValueError(f"`distillation_weight` must be in [0, 1], got {self.distillation_weight}.")
        check_self_distillation_options(self)
        if self.distillation_mode != "topk_logits" and self.distillation_topk is not None:
            warnings.warn(
                f"`distillation_topk={self.distillation_topk}` is ignored with "
                f"`distillation_mode={self.distillation_mode!r}` (it is read by 'topk_logits' only).",
                UserWarning,
                stacklevel=3,
            )
        if self.distillation_add_tail and self.distillation_mode != "topk_logits":
            warnings.warn(
                "`distillation_add_tail=True` is ignored unless `distillation_mode='topk_logits'`.",
                UserWarning,
                stacklevel=3,
            )
        if self.max_reprompt_len < 1:
            raise ValueError(f"`max_reprompt_len` must be >= 1, got {self.max_reprompt_len}.")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"`max_prompt_length` must be >= 1 or None, got {self.max_prompt_length}.")
        if self.diagnostics_warning_interval < 0:
            raise ValueError(
                f"`diagnostics_warning_interval` must be >= 0 (0 disables), got {self.diagnostics_warning_interval}."
            )
        if self.beta != 0.0 and self.distillation_weight == 1.0:
            warnings.warn(
                f"beta={self.beta} only enters the policy term, which distillation_weight=1.0 switches off: the "
                "reference model is loaded for nothing. Set beta=0.0, or distillation_weight < 1.",
                UserWarning,
                stacklevel=3,
            )
        for name, placeholders in TEMPLATE_FIELDS.items():
            template = getattr(self, name)
            try:
                template.format(**{key: "" for key in placeholders})
            except (KeyError, IndexError, ValueError) as error:
                raise ValueError(
                    f"`{name}` {template!r} cannot be formatted: {type(error).__name__}: {error}. Its placeholders "
                    f"are {', '.join('{' + key + '}' for key in placeholders)} (write literal braces as '{{' / '}}')."
                ) from None
