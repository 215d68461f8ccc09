"""RLOOTrainer / RLOOConfig: REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv 2402.14740) with TRL's API.

RLOO is a preset of the shared online-RL pipeline, not a copy of GRPO. What differs (features.md §B2):

- the advantage estimator (``rollout.estimators.LeaveOneOutEstimator``): the KL penalty is folded into the reward,
  r ← Σ_k w_k r_k (clipped to ``reward_clip_range``) − β·Σ_t (log π_old − log π_ref), and each completion's
  baseline is the mean reward of the other completions of its prompt; ``normalize_advantages`` z-scores the
  advantages over the batch (REINFORCE++, arXiv 2501.03262);
- the loss (``core.presets.RLOO_LOSS_PRESET``): PPO's clip on the *sequence* ratio ρ_i = exp Σ_t (logp − old),
  averaged over sequences; π_old is always recomputed;
- defaults: ``num_generations=2``, ``beta=0.05``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from posttrain.core.aggregation import AGGREGATIONS
from posttrain.core.policy_objectives import POLICY_OBJECTIVES
from posttrain.core.presets import RLOO_LOSS_PRESET
from posttrain.reliability.validation import ALLOW_NEGATIVE_BETA_HELP, check_beta
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.estimators import LeaveOneOutEstimator
from posttrain.trainers.base import ConfigAttribute
from posttrain.trainers.online import OnlineRLConfig, OnlineTrainerBase


@dataclass
class RLOOConfig(OnlineRLConfig):
    """Configuration of :class:`RLOOTrainer`: TRL's ``RLOOConfig`` fields and defaults (features.md §B2).

    The shared online-RL fields (generation, batch arithmetic, vLLM, logging) are documented on ``OnlineRLConfig``.
    """

    # older TRL's `max_prompt_length` (a plain cut to the last tokens) is reproduced for this config: posttrain.legacy
    legacy_truncates_prompts: ClassVar[bool] = True

    num_generations: int | None = field(
        default=2, metadata={"help": "Completions sampled per prompt (>= 2: the leave-one-out baseline needs one)."}
    )
    beta: float = field(
        default=0.05,
        metadata={"help": "KL coefficient; the KL to the reference is subtracted from the reward (0 = no reference)."},
    )
    normalize_advantages: bool = field(
        default=False, metadata={"help": "Normalise the advantages over the batch (REINFORCE++ style)."}
    )
    reward_clip_range: tuple[float, float] | None = field(
        default=None, metadata={"help": "(min, max) clamp applied to the summed reward before the KL penalty."}
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Most rounds of tool calls per completion (agent training); None = until the budget is spent."
        },
    )
    allow_negative_beta: bool = field(default=False, metadata={"help": ALLOW_NEGATIVE_BETA_HELP})

    _trainer_name = "RLOO"

    def __post_init__(self):
        super().__post_init__()
        check_beta(self, "the KL penalty would then reward moving away from the reference policy")
        value = self.reward_clip_range
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, str) for v in value):
            # HfArgumentParser builds `tuple[float, float]` fields with tuple("-1,1"): undo the split characters.
            self.reward_clip_range = "".join(value) if all(len(v) == 1 for v in value) else " ".join(value)
        if isinstance(self.reward_clip_range, str):  # from the command line / YAML: "min,max", "[min, max]"
            parts = [p for p in self.reward_clip_range.strip("[]() ").replace(",", " ").split() if p]
            try:
                self.reward_clip_range = tuple(float(p) for p in parts)
            except ValueError as err:
                raise ValueError(
                    f"reward_clip_range must be two numbers 'min,max', got {self.reward_clip_range!r}."
                ) from err
        if self.reward_clip_range is not None:
            if len(self.reward_clip_range) != 2 or self.reward_clip_range[0] > self.reward_clip_range[1]:
                raise ValueError(
                    f"reward_clip_range must be a pair (min, max) with min <= max, got {self.reward_clip_range!r}."
                )
            self.reward_clip_range = (float(self.reward_clip_range[0]), float(self.reward_clip_range[1]))


class RLOOTrainer(OnlineTrainerBase):
    """Trainer for RLOO with TRL's constructor, config and metrics.

    Args:
        model: Hub id / local path, a ``PreTrainedModel`` causal LM, or a ``PeftModel``.
        reward_funcs: Required. Callables (sync/async), reward-model ids/paths or sequence classifiers, registered
            reward names or dotted import paths — the same contract as ``GRPOTrainer``.
        args: :class:`RLOOConfig`; None → defaults with ``output_dir=f"{model_name}-RLOO"``.
        train_dataset / eval_dataset: Prompt-only datasets (``"prompt"``: text or messages).
        processing_class / reward_processing_classes / callbacks / optimizers / quantization_config / peft_config:
            As ``GRPOTrainer``.
        tools / environment_factory: Agent training, as ``GRPOTrainer`` (a posttrain extension: TRL's RLOOTrainer
            has neither).
    """

    config_class = RLOOConfig
    _trainer_name = "RLOO"
    _tag_names = ["posttrain", "rloo"]
    supports_vision = True  # `image` / `images` columns train a vision-language model (TRL's VLM support)
    _generate_fields = ("prompt_ids", "completion_ids", "completions")  # what TRL's RLOO `_generate` returns

    # TRL's attributes copied from the config, which subclasses written for TRL read (``ConfigAttribute``)
    normalize_advantages = ConfigAttribute()
    reward_clip_range = ConfigAttribute()

    def __init__(
        self,
        model: str | torch.nn.Module,
        reward_funcs: Any,
        args: RLOOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list | None = None,
        environment_factory: Any = None,
    ):
        # TRL's signature (reward_funcs required, no rollout_func); the base does the rest.
        super().__init__(
            model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes,
            callbacks, optimizers, quantization_config, peft_config, tools, environment_factory=environment_factory,
        )  # fmt: skip

    def _setup_loss(self) -> None:
        self.objective = POLICY_OBJECTIVES.get(RLOO_LOSS_PRESET["objective"])
        self.aggregation = AGGREGATIONS.get(RLOO_LOSS_PRESET["aggregation"])

    def _make_estimator(self) -> LeaveOneOutEstimator:
        args = self.args
        return LeaveOneOutEstimator(args.beta, args.reward_clip_range, args.normalize_advantages)

    def _compute_loss(self, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        """mean_i −min(ρ_i·A_i, clip(ρ_i, 1 − ε_low, 1 + ε_high)·A_i) / GA with ρ_i = exp Σ_t m·(logp − old), plus
        ``router_aux_loss_coef · aux_loss / GA`` for a MoE policy with router logits (as TRL's RLOO)."""
        args = self.args
        mode = self._mode()
        stats = self._token_stats(model, inputs, compute_entropy=True)
        logps, entropies = stats.logps, stats.entropy
        mask = inputs["completion_mask"].to(logps.dtype)
        per_sequence_loss, objective_stats = self.objective(
            logps,
            inputs["old_per_token_logps"],
            inputs["advantages"],
            mask,
            importance_sampling_level=RLOO_LOSS_PRESET["importance_sampling_level"],
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high,
        )
        loss = self._finish_loss(self.aggregation(per_sequence_loss, mask), stats.aux_loss)

        self._record_policy_metrics(entropies, mask, objective_stats, mode)
        return loss
