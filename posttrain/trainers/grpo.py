"""GRPOTrainer / GRPOConfig: Group Relative Policy Optimization (DeepSeekMath, arXiv 2402.03300) with TRL's API.

The rollout (generation, rewards, group-relative advantages) is the shared pipeline of ``posttrain.rollout``; this
module adds GRPO's config fields and its loss, which reads as TRL's ``_compute_loss``:

1. log-probs (and entropies) of the completion tokens under π_θ, chunked (no full-vocabulary logits);
2. the per-token objective of ``loss_type`` (``core.presets``: clip / cispo / sapo / vespo) with token- or
   sequence-level (GSPO) importance weights, ε_low/ε_high, δ;
3. masks: off-policy sequences (DeepSeek-V3.2), top-ρ entropy tokens (Wang et al. 2025), the sampler-vs-trainer
   importance ratio when active;
4. β·KL(π_θ‖π_ref) with the k3 estimator (optionally IS-weighted, ``use_bias_correction_kl``);
5. the aggregation of ``loss_type`` (DAPO's global token mean over the whole generation batch and all processes;
   the others divided by the gradient-accumulation steps, so accumulation and data parallelism leave the loss
   unchanged);
6. the entropy bonus (static, or Skywork-OR1's adaptive coefficient, saved in ``entropy_ctrl_state.json``): the
   plain token mean of the entropies over the micro-batch, whatever the loss type's aggregation (TRL 1.16);
7. the online base's loss tail (``_finish_loss``): the gradient-accumulation divisor and the MoE router aux loss.

Deliberate differences from TRL: the ``vllm_importance_sampling_*`` correction can also be applied to posttrain's
own sampler, which returns sampling log-probs (``rollout_importance_sampling=True``; TRL applies it only with
vLLM, and so does posttrain by default). Under truncated sampling (``top_k`` / ``top_p`` / ``min_p``) the ratio
takes TRL 1.17's correction: samplers that report the kept mass (the group sampler, ``posttrain serve``) have their
processed log-probs put back on the full-softmax scale before the comparison (``core/importance.py``). Agent training (``tools``, ``environment_factory``) runs the multi-turn tool
loop of ``posttrain.agents`` around the generation backend; tool-result tokens are context but not trained on.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from posttrain.core.importance import entropy_threshold, off_policy_sequence_mask
from posttrain.core.kl import kl_k3
from posttrain.core.masking import masked_sum
from posttrain.core.policy_objectives import (
    ObjectiveArguments,
    importance_weights,
    objective_metric_values,
    objective_properties,
)
from posttrain.core.presets import (
    GRPO_LOSS_TYPES,
    needs_grad_accum_division,
    resolve_grpo_loss,
    validate_grpo_loss_config,
)
from posttrain.distributed import gather_variable_length
from posttrain.models.forward import TokenStats
from posttrain.models.unwrap import unwrap_base_model
from posttrain.reliability.validation import ALLOW_NEGATIVE_BETA_HELP, check_beta
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.estimators import GroupRelativeEstimator
from posttrain.rollout.pipeline import ImportanceSamplingSettings, RolloutSettings
from posttrain.trainers.base import ConfigAttribute
from posttrain.trainers.online import OnlineRLConfig, OnlineTrainerBase

logger = logging.getLogger(__name__)

ENTROPY_CTRL_STATE = "entropy_ctrl_state.json"
_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
_IS_LEVELS = ("token", "sequence")
_MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass
class GRPOConfig(ObjectiveArguments, OnlineRLConfig):
    """Configuration of :class:`GRPOTrainer`: TRL's ``GRPOConfig`` fields and defaults (features.md §B1.1).

    Shared online-RL fields (generation, batch arithmetic, vLLM, β, logging) are documented on
    ``OnlineRLConfig``; the objectives' own hyper-parameters (``delta``, ``sapo_*``, ``vespo_*``) on
    ``core.policy_objectives.ObjectiveArguments``, beside the objectives that read them. ``generation_backend``
    ("posttrain" | "transformers"), ``rollout_importance_sampling`` and ``keep_sampling_mask`` (train over the
    sampler's top-k / top-p / min-p support, ``posttrain.core.sampling_mask``) are posttrain additions.
    """

    # older TRL's `max_prompt_length` (a plain cut to the last tokens) is reproduced for this config: posttrain.legacy
    legacy_truncates_prompts: ClassVar[bool] = True

    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Run the LM head in float32 (ScaleRL); with tied embeddings the shared weight becomes float32 and "
            "the embedding output keeps the model's dtype. Not with a PEFT adapter on the LM head."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token' (per-token ratios) or 'sequence' (GSPO: geometric mean ratio per sequence).",
            "choices": list(_IS_LEVELS),
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "'sum_then_normalize' (weighted sum, then scale_rewards) or 'normalize_then_sum' (GDPO).",
            "choices": list(_MULTI_OBJECTIVE_AGGREGATIONS),
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "'group' (or True): divide by the group std; 'batch': by the batch std; 'none' (False)."},
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": f"One of {', '.join(GRPO_LOSS_TYPES)} (default: dapo), or in Python a pair (objective, "
            "aggregation) of core registry names or callables.",
            "choices": list(GRPO_LOSS_TYPES),
        },
    )
    top_entropy_quantile: float = field(
        default=1.0, metadata={"help": "ρ: keep only the top-ρ fraction of tokens by entropy in the loss (0.2)."}
    )
    entropy_coef: float = field(
        default=0.0, metadata={"help": "Entropy bonus coefficient (initial value when adaptive); 0 = off."}
    )
    use_adaptive_entropy: bool = field(
        default=False, metadata={"help": "Skywork-OR1 adaptive entropy coefficient, updated each optimizer step."}
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy: lower bound."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy: upper bound."})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "Adaptive entropy: step per update."})
    entropy_target: float = field(
        default=0.2, metadata={"help": "Adaptive entropy: the bonus applies while entropy ≤ this (nats)."}
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Most rounds of tool calls per completion (agent training); None = until the budget is spent."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Correct the sampler-vs-trainer log-prob mismatch with importance sampling. Applied with "
            "use_vllm=True (as TRL), or with any backend returning sampling log-probs when "
            "rollout_importance_sampling=True."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={"help": f"One of {', '.join(_IS_MODES)}.", "choices": list(_IS_MODES)},
    )
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={"help": "IS upper bound C_max."})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={"help": "IS lower bound C_min."})
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Deprecated: use vllm_importance_sampling_clip_max."}
    )
    rollout_importance_sampling: bool | None = field(
        default=None,
        metadata={
            "help": "posttrain: apply the vllm_importance_sampling_* correction to backends other than vLLM that "
            "return sampling log-probs (generation_backend='posttrain', a rollout_func returning logprobs). None: "
            "only with use_vllm (TRL's behaviour)."
        },
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={"help": "DeepSeek-V3.2 δ: drop negative-advantage sequences whose mean KL to the sampler > δ."},
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the per-token KL term by the importance ratio π_θ/π_old (DeepSeek-V3.2's unbiased KL "
            "estimate; token or sequence level as importance_sampling_level). Default on, as TRL; only matters "
            "when beta > 0. --no_use_bias_correction_kl turns it off."
        },
    )
    log_completions_hub_repo: str | None = field(
        default=None, metadata={"help": "Hub dataset repo for completions parquet files (requires log_completions)."}
    )
    allow_negative_beta: bool = field(default=False, metadata={"help": ALLOW_NEGATIVE_BETA_HELP})

    _trainer_name = "GRPO"

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in ("true", "false"):
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated; use vllm_importance_sampling_clip_max.",
                FutureWarning,
                stacklevel=2,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        super().__post_init__()
        resolve_grpo_loss(self.loss_type)  # a typo fails here, listing the valid loss types
        for name, valid in (
            ("importance_sampling_level", _IS_LEVELS),
            ("multi_objective_aggregation", _MULTI_OBJECTIVE_AGGREGATIONS),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(f"Invalid {name} {getattr(self, name)!r}. Valid values: {', '.join(valid)}.")
        check_beta(self, "the KL term would then reward moving away from the reference policy")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(
                f"Invalid scale_rewards {self.scale_rewards!r}. Valid values: 'group' (or True), 'batch', 'none' "
                "(or False)."
            )
        if self.vllm_importance_sampling_mode not in _IS_MODES:
            raise ValueError(
                f"Invalid vllm_importance_sampling_mode {self.vllm_importance_sampling_mode!r}. Valid modes: "
                f"{', '.join(_IS_MODES)}."
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({low}) must be smaller than vllm_importance_sampling_clip_max "
                f"({high})."
            )
        if self.vllm_importance_sampling_mode.endswith("_truncate") and low is None and high is None:
            raise ValueError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} needs "
                "vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max."
            )
        if self.log_completions_hub_repo is not None and not self.log_completions:
            raise ValueError("log_completions_hub_repo requires log_completions=True.")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}.")
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min ({self.entropy_coef_min}) must not exceed entropy_coef_max ({self.entropy_coef_max})."
            )


@dataclass
class EntropyController:
    """Entropy-bonus coefficient: static, or adaptive (Skywork-OR1, arXiv 2505.22312).

    Adaptive: at each optimizer step the mean entropy H of the step (over the loss's token set, all processes)
    moves the coefficient, c ← min(c + Δ, c_max) if H ≤ target else max(c − Δ, c_min), and the bonus of the next
    step is applied only if H ≤ target. Before the first measurement it is not applied.
    """

    coef: float = 0.0
    adaptive: bool = False
    coef_min: float = 0.0
    coef_max: float = 1.0
    delta: float = 0.005
    target: float = 0.2
    below_target: bool = False
    last_entropy: float | None = None
    _sum: float = 0.0
    _count: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.adaptive or self.coef != 0.0

    def effective_coef(self) -> float:
        if not self.adaptive:
            return self.coef
        return self.coef if self.below_target else 0.0

    def accumulate(self, entropy_sum: float, count: float) -> None:
        self._sum += entropy_sum
        self._count += count

    def window(self) -> tuple[float, float]:
        """(Σ entropy, token count) accumulated since the last update (this process)."""
        return self._sum, self._count

    def update(self, entropy: float) -> None:
        """One optimizer-step update from the window's mean entropy (already averaged over processes)."""
        self._sum = self._count = 0.0
        if not self.adaptive or entropy != entropy:  # NaN: no valid token this step
            return
        self.last_entropy = entropy
        self.below_target = entropy <= self.target
        if self.below_target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)

    def state_dict(self) -> dict[str, Any]:
        return {"entropy_coef": self.coef, "below_target": self.below_target, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state["entropy_coef"])
        self.below_target = bool(state.get("below_target", False))
        self.last_entropy = state.get("last_entropy")


class GRPOTrainer(OnlineTrainerBase):
    """Trainer for GRPO (Shao et al. 2024, DeepSeekMath) with TRL's constructor, config and metrics.

    The constructor is ``OnlineTrainerBase.__init__`` (TRL's ``GRPOTrainer`` signature); ``_setup_loss`` adds GRPO's.

    Args:
        model: Hub id / local path (loaded with ``args.model_init_kwargs``, float32 by default), a
            ``PreTrainedModel`` causal LM, or a ``PeftModel``.
        reward_funcs: One or a list of: callables (sync or ``async def``; keyword-only TRL contract, may return
            ``None``), reward-model ids/paths or ``PreTrainedModel`` sequence classifiers, registered reward names
            (``"accuracy_reward"``) or dotted import paths.
        args: :class:`GRPOConfig`; None → defaults with ``output_dir=f"{model_name}-GRPO"``.
        train_dataset: Prompt-only dataset (``"prompt"``: text or messages); other columns go to reward functions.
            A ``datasets.IterableDataset`` needs ``max_steps``.
        eval_dataset: Same format (``num_generations_eval`` completions per prompt).
        processing_class: Tokenizer (left padding is set); None → loaded from the model.
        reward_processing_classes: Tokenizers of reward models (one per reward function; None entries are loaded).
        callbacks / optimizers: As ``transformers.Trainer``.
        quantization_config: Merged into ``model_init_kwargs`` when ``model`` is a string (QLoRA with peft_config).
        peft_config: Wraps the model; the reference is then the base model with adapters disabled.
        tools: Functions (sync or ``async``, type hints + Google-style docstring) the model may call; see
            ``posttrain.agents``. Model-chosen arguments are untrusted input.
        environment_factory: A callable (or ``{name: callable}`` selected by an ``environment`` column) making one
            environment per rollout: ``reset(**row) -> str | None``, public methods as tools, optional
            ``get_reward()`` (an extra reward column); reward functions receive ``environments``.
        rollout_func: ``rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", ...}``.
    """

    config_class = GRPOConfig
    _trainer_name = "GRPO"
    _tag_names = ["posttrain", "grpo"]
    supports_vision = True  # `image` / `images` columns train a vision-language model (TRL's VLM support)

    # TRL's attributes copied from the config, which subclasses written for TRL read (``ConfigAttribute``)
    loss_type = ConfigAttribute()
    importance_sampling_level = ConfigAttribute()
    scale_rewards = ConfigAttribute()
    multi_objective_aggregation = ConfigAttribute()
    off_policy_mask_threshold = ConfigAttribute()
    top_entropy_quantile = ConfigAttribute()
    use_adaptive_entropy = ConfigAttribute()
    max_tool_calling_iterations = ConfigAttribute()
    vllm_importance_sampling_correction = ConfigAttribute()
    vllm_importance_sampling_mode = ConfigAttribute()
    vllm_importance_sampling_clip_min = ConfigAttribute()
    vllm_importance_sampling_clip_max = ConfigAttribute()

    # The per-micro-batch loss when it is more than GRPO's: a stateless ``loss(trainer, model, inputs) -> scalar``
    # that calls ``trainer._grpo_loss`` for the policy term (SDPO's); None: GRPO's loss alone.
    loss_strategy: Callable[[GRPOTrainer, torch.nn.Module, RolloutBatch], torch.Tensor] | None = None

    def _setup_loss(self) -> None:
        """The loss of ``loss_type``, its config warnings and the entropy controller (after the shared setup)."""
        args = self.args
        self.objective, self.aggregation = resolve_grpo_loss(args.loss_type)
        self.divide_by_grad_accum = needs_grad_accum_division(args.loss_type)
        self.objective_properties = properties = objective_properties(self.objective)
        # The hyper-parameters the objective declares it reads, from their config fields.
        self.objective_kwargs = {kw: getattr(args, name) for kw, name in properties.config_fields.items()}
        self.objective_folds_sampling_ratio = properties.folds_sampling_ratio
        is_settings = self._importance_sampling()
        for message in validate_grpo_loss_config(
            args.loss_type,
            args.importance_sampling_level,
            epsilon=args.epsilon,
            epsilon_high=args.epsilon_high,
            vllm_importance_sampling_mode=is_settings.mode if is_settings is not None else None,
        ):
            logger.warning(message)  # through `logging`, as TRL's configuration warnings
        self.entropy_ctrl = EntropyController(
            coef=args.entropy_coef,
            adaptive=args.use_adaptive_entropy,
            coef_min=args.entropy_coef_min,
            coef_max=args.entropy_coef_max,
            delta=args.entropy_coef_delta,
            target=args.entropy_target,
        )

    # -- construction hooks ------------------------------------------------------------------------------------
    def _make_estimator(self) -> GroupRelativeEstimator:
        return GroupRelativeEstimator(self.args.scale_rewards, self.args.multi_objective_aggregation)

    def _importance_sampling(self) -> ImportanceSamplingSettings | None:
        args = self.args
        if not args.vllm_importance_sampling_correction:
            return None
        if not (args.use_vllm or args.rollout_importance_sampling):
            return None
        return ImportanceSamplingSettings(
            mode=args.vllm_importance_sampling_mode,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
        )

    def _rollout_settings(self) -> RolloutSettings:
        """Server rollouts (``vllm_mode="server"``, AsyncGRPO) defer the importance-sampling ratio to the loss
        (``RolloutSettings.defer_importance_sampling``): the loss's forward pass gives π_old, so no extra pass."""
        settings = super()._rollout_settings()
        settings.defer_importance_sampling = bool(self.args.use_vllm and self.args.vllm_mode == "server")
        return settings

    def _prepare_model(self, model: torch.nn.Module, args: GRPOConfig) -> None:
        if not args.cast_lm_head_to_fp32:
            return
        inner = unwrap_base_model(model)
        head = inner.get_output_embeddings()
        if type(head) is not torch.nn.Linear:
            raise ValueError(
                f"cast_lm_head_to_fp32=True cannot be used when the LM head is a {type(head).__name__} (e.g. a PEFT "
                "adapter on lm_head); remove lm_head from the adapter's target_modules."
            )
        original_dtype = head.weight.dtype
        head.float()
        head.register_forward_pre_hook(lambda module, inputs: tuple(x.float() for x in inputs))
        embeddings = inner.get_input_embeddings()
        if embeddings is not None and embeddings.weight is head.weight and original_dtype != torch.float32:
            # tied embeddings (as TRL accepts): the shared weight is float32 now; the embedding output keeps the
            # model's dtype so that the rest of the network runs as before
            embeddings.register_forward_hook(lambda module, inputs, output: output.to(original_dtype))

    # -- helpers -----------------------------------------------------------------------------------------------
    def _gather_1d(self, values: torch.Tensor) -> torch.Tensor:
        """Concatenate variable-length 1-D tensors from every process (NaN-padded, padding dropped)."""
        return gather_variable_length(self.accelerator, values)

    # -- loss --------------------------------------------------------------------------------------------------
    def _compute_loss(self, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        """The micro-batch's loss: ``self.loss_strategy(self, model, inputs)`` when a trainer composes GRPO's loss
        with more (SDPO's self-distillation term), else GRPO's own (:meth:`_grpo_loss`)."""
        if self.loss_strategy is not None:
            return self.loss_strategy(self, model, inputs)
        return self._grpo_loss(model, inputs)

    def _grpo_loss(
        self, model: torch.nn.Module, inputs: RolloutBatch, stats: TokenStats | None = None
    ) -> torch.Tensor:
        """TRL's GRPO loss on one micro-batch (see the module docstring for the recipe).

        ``stats``: the policy's token statistics of ``inputs`` when a loss strategy already ran the forward pass
        (SDPO shares it with its distillation term); None runs it here.
        """
        args = self.args
        mode = self._mode()
        # With an entropy bonus the entropies enter the loss: they keep their graph (still chunked, no full logits).
        if stats is None:
            stats = self._token_stats(
                model, inputs, compute_entropy=True, entropy_requires_grad=self.entropy_ctrl.enabled
            )
        logps, entropies = stats.logps, stats.entropy  # (B, C) each
        mask = inputs["completion_mask"].to(logps.dtype)  # (B, C) loss mask
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps  # on-policy: ratio ≡ 1
        inputs = self._deferred_importance_sampling(inputs, old_logps, mode)

        entropy_mask = self._entropy_mask(entropies, mask)
        per_token_loss, objective_stats = self._policy_term(logps, old_logps, inputs, mask, entropy_mask)
        if args.beta != 0.0:
            per_token_kl = kl_k3(logps, inputs["ref_per_token_logps"])
            if args.use_bias_correction_kl:
                per_token_kl = per_token_kl * importance_weights(
                    logps, old_logps, mask, args.importance_sampling_level
                )
            per_token_loss = per_token_loss + args.beta * per_token_kl
            self.record_metric("kl", self._global_masked_mean(per_token_kl.detach(), mask), mode=mode)

        loss = self._aggregate(per_token_loss, mask, inputs)
        if self.entropy_ctrl.enabled:
            loss = self._add_entropy_bonus(loss, entropies, entropy_mask if entropy_mask is not None else mask, inputs)
        loss = self._finish_loss(loss, stats.aux_loss, divide_by_grad_accum=self.divide_by_grad_accum)
        self._record_loss_metrics(entropies, mask, objective_stats, mode)
        return loss

    def _deferred_importance_sampling(self, inputs: RolloutBatch, old_logps: torch.Tensor, mode: str) -> RolloutBatch:
        """The sampler-vs-trainer ratio the pipeline left to the loss (``defer_importance_sampling``), from this
        forward pass's detached log-probs ``old_logps`` (B, C) = π_old on-policy; ``inputs`` itself is unchanged."""
        if "importance_sampling_ratio" in inputs or "sampling_per_token_logps" not in inputs:
            return inputs
        if not self.pipeline.defers_importance_sampling():
            return inputs
        view = {
            "old_per_token_logps": old_logps.float(),
            "sampling_per_token_logps": inputs["sampling_per_token_logps"],
            "completion_mask": inputs["completion_mask"],
        }
        if "sampling_log_kept_mass" in inputs:  # truncated sampling: TRL 1.17's correction, as in the pipeline
            view["sampling_log_kept_mass"] = inputs["sampling_log_kept_mass"]
        self.pipeline.importance_sampling(view, self.pipeline.settings.importance_sampling, self._record(mode))
        return {**inputs, "importance_sampling_ratio": view["importance_sampling_ratio"]}

    def _aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, inputs: RolloutBatch) -> torch.Tensor:
        """``loss_type``'s aggregation of a per-token term (before the gradient-accumulation divisor).

        ``num_items_in_batch`` counts the tokens of the whole generation batch, which training spreads over
        ``steps_per_generation`` micro-batches: the global token mean (dapo, cispo, vespo) of one optimizer step
        divides by its share, ``num_items_in_batch · GA / steps_per_generation`` (TRL's rescaling; the two are equal
        by default). Evaluation neither splits nor accumulates its batch.
        """
        num_items = inputs["num_items_in_batch"]
        if self._mode() == "train":
            num_items = num_items * self._grad_accum_divisor() / self.args.steps_per_generation
        return self.aggregation(
            per_token,
            mask,
            max_completion_length=self.args.max_completion_length,
            num_items_in_batch=num_items,
            num_processes=self.accelerator.num_processes,
        )

    def _entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """Top-ρ entropy tokens (Wang et al. 2025), ρ = ``top_entropy_quantile``; the quantile is over all processes."""
        rho = self.args.top_entropy_quantile
        if rho >= 1.0:
            return None
        return self.get_high_entropy_mask(entropies.detach(), mask, 1.0 - rho).to(mask.dtype)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's method: the tokens whose entropy is at least the ``threshold`` quantile (in [0, 1]) of the valid
        tokens' entropies over every process.

        Args:
            entropies: ``(B, T)`` per-token entropies.
            mask: ``(B, T)`` 1 = valid token.
            threshold: quantile level, ``1 - top_entropy_quantile`` in training (1.0 keeps only the maximum).

        Returns:
            ``(B, T)`` bool mask, False on padding (all False when there is no valid token).
        """
        valid = self._gather_1d(entropies.detach()[mask.bool()].float())
        if valid.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        cut = valid.max() if threshold >= 1.0 else entropy_threshold(valid, 1.0 - threshold)
        return (entropies.detach() >= cut.to(entropies.device)) & mask.bool()

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's method: DeepSeek-V3.2's off-policy sequence mask, ``(B, 1)`` with 1 = keep (A ≥ 0, or the mean
        of ``sampling − current`` log-probs over the completion ≤ δ) and 0 = drop."""
        mask = mask.to(per_token_logps.dtype)
        return off_policy_sequence_mask(
            advantages, sampling_per_token_logps, per_token_logps, mask, off_policy_threshold
        ).to(mask.dtype)

    @property
    def entropy_coef(self) -> float:
        """TRL's attribute: the entropy-bonus coefficient now (moved each step by the adaptive controller)."""
        return self.entropy_ctrl.coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        self.entropy_ctrl.coef = float(value)

    def _policy_term(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor,
        inputs: RolloutBatch,
        mask: torch.Tensor,
        entropy_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss of ``loss_type``, times the off-policy, entropy and sampling-IS masks (TRL's order)."""
        args = self.args
        advantages = inputs["advantages"]  # (B,)
        is_ratio = inputs.get("importance_sampling_ratio")  # (B, C) or (B, 1), when the correction is active
        folds_ratio = self.objective_folds_sampling_ratio  # e.g. VESPO: the sampler correction enters its kernel
        objective_kwargs = self.objective_kwargs
        if folds_ratio and is_ratio is not None:
            objective_kwargs = {**objective_kwargs, "importance_sampling_ratio": is_ratio}
        per_token_loss, objective_stats = self.objective(logps, old_logps, advantages, mask, **objective_kwargs)
        if args.off_policy_mask_threshold is not None:
            # The generator's log-probs when they come from outside the trainer (vLLM, a rollout_func's
            # "logprobs"), as TRL, else π_old's (posttrain's own sampler returns log-probs too, TRL's
            # transformers path none).
            external = is_ratio is not None or getattr(self, "rollout_func", None) is not None
            sampling_logps = inputs.get("sampling_per_token_logps") if external else None
            if sampling_logps is not None and "sampling_log_kept_mass" in inputs:
                # truncated sampling: the drift from the sampler on the full-softmax scale (TRL 1.17's correction)
                sampling_logps = sampling_logps + inputs["sampling_log_kept_mass"].to(sampling_logps.dtype)
            sampling_logps = old_logps if sampling_logps is None else sampling_logps
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages, logps, sampling_logps, mask, args.off_policy_mask_threshold
            )
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if is_ratio is not None and not folds_ratio:
            per_token_loss = per_token_loss * is_ratio
        return per_token_loss, objective_stats

    def _add_entropy_bonus(
        self, loss: torch.Tensor, entropies: torch.Tensor, bonus_mask: torch.Tensor, inputs: RolloutBatch
    ) -> torch.Tensor:
        """loss − c·H/GA, H the mean entropy over this micro-batch's bonus tokens, whatever ``loss_type`` is.

        As TRL 1.16 (``entropy_coef``'s documented meaning): the bonus is a plain token mean, never reduced by the loss
        type's own aggregation (a per-sequence mean for grpo, the optimizer step's global token mean for dapo ...),
        so ``entropy_coef`` means the same for every loss type; it is divided only by the gradient-accumulation
        count (in training), here directly when ``_finish_loss`` will not divide the loss by it.
        """
        mode = self._mode()
        entropy_term = masked_sum(entropies, bonus_mask) / bonus_mask.sum().clamp(min=1.0)
        if not self.divide_by_grad_accum:  # a globally normalised loss: _finish_loss leaves GA to us
            entropy_term = entropy_term / self._grad_accum_divisor()
        # TRL logs the policy term as aggregated, before the gradient-accumulation divisor (dapo's includes GA)
        self.record_metric("policy_loss", self._gather_mean(loss.detach()), mode=mode)
        self.record_metric("entropy_coef", self.entropy_ctrl.coef, mode=mode)  # the controller's current value
        if mode == "train":
            detached = entropies.detach()
            self.entropy_ctrl.accumulate(float(masked_sum(detached, bonus_mask)), float(bonus_mask.sum()))
        return loss - self.entropy_ctrl.effective_coef() * entropy_term

    def _on_optimizer_step(self) -> None:
        if not self.entropy_ctrl.adaptive:
            return
        total, count = self.entropy_ctrl.window()
        window = torch.tensor([total, count], dtype=torch.float64, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            window = self.accelerator.reduce(window, reduction="sum")
        self.entropy_ctrl.update(float(window[0] / window[1]) if window[1] > 0 else float("nan"))

    def _record_loss_metrics(
        self, entropies: torch.Tensor, mask: torch.Tensor, objective_stats: dict[str, torch.Tensor], mode: str
    ) -> None:
        """``entropy`` and ``clip_ratio/*`` (the online base's), then the metrics the objective declares
        (``ObjectiveProperties.metrics``), each averaged over processes."""
        self._record_policy_metrics(entropies, mask, objective_stats, mode)
        for name, value in objective_metric_values(self.objective_properties, objective_stats, mask).items():
            self.record_metric(name, self._gather_mean(value), mode=mode)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _extra_checkpoint_state(self) -> dict[str, Any]:
        if not self.entropy_ctrl.adaptive:
            return {}
        return {ENTROPY_CTRL_STATE: self.entropy_ctrl.state_dict()}

    def _load_extra_checkpoint_state(self, states: dict[str, Any]) -> None:
        if ENTROPY_CTRL_STATE in states:
            self.entropy_ctrl.load_state_dict(states[ENTROPY_CTRL_STATE])
