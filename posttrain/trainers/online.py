"""The online-RL trainer base shared by GRPO, RLOO and on-policy distillation.

``OnlineRLConfig`` (defined in ``posttrain.trainers.online_config``, re-exported here) holds the fields GRPOConfig
and RLOOConfig share (TRL's names and defaults: data, generation, vLLM, reference/KL, batch arithmetic, logging)
plus posttrain's ``generation_backend``. ``OnlineTrainerBase`` wires
the parts: model and tokenizer (left padding), reward functions into a ``RewardScorer``, the reference policy
(β ≠ 0 only), a generation backend, the ``RolloutPipeline`` with the subclass's advantage estimator, and the
``RolloutBuffer``. It replaces HF Trainer's data path the way TRL does:

- the dataloader yields ``per_device_train_batch_size × steps_per_generation`` raw rows per micro-step from a
  ``RepeatSampler`` (identity collator); a trainer that keeps an epoch's short last round and generates once per
  optimizer step (GKD, ``_round_per_window``) gets TRL's plain ``per_device_train_batch_size`` batches instead, and
  ``get_batch_samples`` hands the optimizer step's rows to its first micro-step (the round);
- ``_prepare_inputs`` generates once every ``steps_per_generation × num_iterations`` micro-steps and serves the
  buffered micro-batches in between (evaluation generates for every batch, with ``num_generations_eval``);
- ``compute_loss`` calls the subclass's ``_compute_loss(model, inputs)``, which ends in ``_finish_loss`` (the
  gradient-accumulation divisor and the MoE router aux loss; ``loss_is_scaled_for_ga``), so HF Trainer does not
  divide again.

Subclasses provide ``config_class``, ``_trainer_name``, ``_make_estimator()``, ``_compute_loss()`` and may extend
``_setup_loss()``, ``_rollout_settings()`` and the checkpoint hooks. A trainer without rewards or a reference
(distillation) composes the construction steps itself (``_setup_policy``, ``_configure_train_dataset``,
``_init_trainer``, ``_setup_rollout`` with its own ``_make_rollout``) and overrides ``_prompts_per_round()``; its
config replaces ``OnlineRLConfig._resolve_batch_plan`` (the shared option checks stay in ``_check_online_options``).
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from typing import Any

import torch

from posttrain.data.dataset_ops import configure_streaming
from posttrain.data.formats import is_vision_dataset
from posttrain.distributed import mean_over_processes
from posttrain.generation.base import SamplingConfig
from posttrain.generation.host_memory import release_freed_host_memory
from posttrain.models.completion_scoring import completion_token_stats
from posttrain.models.forward import TokenStats
from posttrain.models.loading import (
    create_model_from_path,
    disable_dropout_in_model,
    load_processor,
    resolve_model,
    resolve_processing_class,
    resolve_router_aux_loss_coef,
)
from posttrain.models.reference import SyncRefModelCallback, create_reference_policy
from posttrain.models.unwrap import unwrap_base_model
from posttrain.reliability.validation import check_datasets, check_liger_peft_head, check_text_only
from posttrain.rollout.buffer import RolloutBatch, RolloutBuffer
from posttrain.rollout.completions_log import print_completions_table, write_completions_parquet
from posttrain.rollout.metrics import clip_ratio_metrics
from posttrain.rollout.pipeline import ImportanceSamplingSettings, RolloutPipeline, RolloutSettings
from posttrain.rollout.sampler import (
    RepeatSampler,
    repeat_iterable_dataset,
)
from posttrain.trainers.base import BaseTrainer, ConfigAttribute, router_aux_loss_coef_attribute
from posttrain.trainers.online_config import GENERATION_BACKENDS, OnlineRLConfig

__all__ = ["GENERATION_BACKENDS", "OnlineRLConfig", "OnlineTrainerBase"]
logger = logging.getLogger(__name__)


def _completion_logs(size: int | None) -> dict[str, Any]:
    """TRL's ``self._logs``: the last ``size`` (the generation batch) prompts, completions, rewards per function,
    advantages and ``log_extra`` columns."""
    from collections import defaultdict, deque

    return {
        "images": deque(maxlen=size),
        "prompt": deque(maxlen=size),
        "completion": deque(maxlen=size),
        "rewards": defaultdict(lambda: deque(maxlen=size)),
        "advantages": deque(maxlen=size),
        "extra": defaultdict(lambda: deque(maxlen=size)),
    }


class _GenerateHookBackend:
    """A trainer subclass's ``_generate(prompts)`` (TRL's rollout dispatch) as the generation backend: it receives
    the raw prompts, one per completion (as a ``rollout_func``), and returns TRL's tuple (``_generate_fields``), or a
    dict with those names. ``inner`` is the backend posttrain would have used (``super()._generate`` runs it)."""

    def __init__(self, trainer: Any, inner: Any):
        self.trainer = trainer
        self.inner = inner

    def sync_weights(self, model: Any) -> None:
        self.inner.sync_weights(model)

    def generate_from_prompts(self, prompts: list[Any], sampling: Any = None, num_generations: int = 1) -> Any:
        from posttrain.generation.rollout_func import RolloutFuncBackend

        trainer = self.trainer
        prompts = [p for p in prompts for _ in range(num_generations)]
        output = trainer._generate(prompts)
        fields = trainer._generate_fields
        if isinstance(output, dict):
            values = dict(output)
        elif isinstance(output, (tuple, list)) and len(output) == len(fields):
            values = dict(zip(fields, output))
        else:
            got = f"{len(output)} values" if isinstance(output, (tuple, list)) else type(output).__name__
            raise ValueError(
                f"{type(trainer).__name__}._generate must return TRL's tuple {fields} ({len(fields)} values), or a "
                f"dict with those names; got {got}."
            )
        for name in ("prompt_ids", "completion_ids"):
            if name not in values:
                raise ValueError(f"{type(trainer).__name__}._generate returned no {name!r}.")
        result = {
            "prompt_ids": values["prompt_ids"],
            "completion_ids": values["completion_ids"],
            "logprobs": values.get("logprobs"),
            **(values.get("extra_fields") or {}),
        }
        if values.get("tool_mask") is not None:
            result["env_mask"] = values["tool_mask"]
        # the rollout-function adapter validates the rows (one per prompt, per-token lengths) and builds Completions
        adapter = RolloutFuncBackend(lambda _prompts, _trainer: result, trainer, tokenizer=trainer.processing_class)
        adapter.warn_experimental = False
        return adapter.generate_from_prompts(prompts, sampling, 1)


def _identity_collator(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows go to ``_prepare_inputs`` untouched (the rollout pipeline does its own batching)."""
    return features


def _loss_is_already_scaled(*args, **kwargs):
    """Marker: a non-None ``compute_loss_func`` tells HF Trainer not to rescale the loss by gradient accumulation.

    Online-RL trainers compute their loss in ``compute_loss`` and scale it themselves (TRL does the same).
    """
    raise RuntimeError("OnlineTrainerBase computes its loss in compute_loss; this marker is never called.")


class OnlineTrainerBase(BaseTrainer):
    """Shared constructor, data path, rollout and checkpoint handling of GRPO/RLOO (see the module docstring)."""

    config_class: type[OnlineRLConfig] = OnlineRLConfig
    _trainer_name = "GRPO"
    # Trains vision-language models from `image` / `images` columns (GRPO, RLOO); others refuse image columns.
    supports_vision = False
    loss_is_scaled_for_ga = True
    # Score completions under π / temperature (GRPO/RLOO: the sampling distribution); False scores under π itself
    # (TRL's Online DPO and A2PO take log_softmax of the raw logits whatever the sampling temperature).
    scores_at_sampling_temperature = True
    # What TRL's `_generate(prompts)` returns, in order (GRPO's; RLOO returns three of them). A subclass that
    # overrides `_generate` is called for every generation (see `_generate`).
    _generate_fields: tuple[str, ...] = (
        "prompt_ids", "completion_ids", "tool_mask", "completions", "logprobs", "extra_fields", "images", "tool_images",
    )  # fmt: skip

    # TRL's attributes copied from the config, which subclasses written for TRL read (``ConfigAttribute``)
    beta = ConfigAttribute()
    num_iterations = ConfigAttribute()
    temperature = ConfigAttribute()
    top_p = ConfigAttribute()
    top_k = ConfigAttribute()
    min_p = ConfigAttribute()
    repetition_penalty = ConfigAttribute()
    max_completion_length = ConfigAttribute()
    mask_truncated_completions = ConfigAttribute()
    shuffle_dataset = ConfigAttribute()
    pad_to_multiple_of = ConfigAttribute()
    log_completions = ConfigAttribute()
    log_unique_prompts = ConfigAttribute()
    log_multimodal = ConfigAttribute()
    num_completions_to_print = ConfigAttribute()
    use_vllm = ConfigAttribute()
    vllm_mode = ConfigAttribute()
    vllm_gpu_memory_utilization = ConfigAttribute()
    vllm_tensor_parallel_size = ConfigAttribute()
    use_transformers_continuous_batching = ConfigAttribute()
    epsilon_low = ConfigAttribute("epsilon")
    epsilon_high = ConfigAttribute(read=lambda trainer, value: trainer.args.epsilon if value is None else value)
    chat_template_kwargs = ConfigAttribute(read=lambda trainer, value: value or {})
    router_aux_loss_coef = ConfigAttribute(read=router_aux_loss_coef_attribute)
    reward_weights = ConfigAttribute(
        read=lambda trainer, value: trainer.scorer.weights.detach().clone(), writable=False
    )

    @property
    def eos_token_ids(self) -> list[int]:
        """TRL's attribute: the token ids that end a completion (the tokenizer's EOS, or the generation config's)."""
        return list(self.sampling.eos_token_ids)

    def __init__(
        self,
        model: str | torch.nn.Module,
        reward_funcs: Any = None,
        args: OnlineRLConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ):
        args = self.resolve_args(args, model, self.config_class, self._trainer_name)
        check_datasets(train_dataset, eval_dataset)
        if train_dataset is None:
            train_dataset = self._environment_placeholder_dataset(args, environment_factory)
        model_id = model if isinstance(model, str) else None
        if (
            processing_class is None
            and self.supports_vision
            and any(is_vision_dataset(split) for split in (train_dataset, eval_dataset) if split is not None)
        ):
            processing_class = load_processor(model)  # images: the model's processor, as TRL's AutoProcessor
        model, processing_class = self._setup_policy(model, args, processing_class, peft_config, quantization_config)
        self._check_vision(model, processing_class, args, train_dataset, eval_dataset, tools, rollout_func,
                           environment_factory)  # fmt: skip
        check_liger_peft_head(model, args)
        self._prepare_model(model, args)
        # Agent training (tools / environment_factory): checks (and may swap) the chat template, adds the
        # environments' get_reward columns.
        self.agent = self._make_agent(tools, environment_factory, rollout_func, processing_class, model, args)
        self._setup_rewards(
            reward_funcs, args, reward_processing_classes, train_dataset, rollout_func, environment_factory
        )
        self.reference = create_reference_policy(
            model,
            getattr(self, "_ref_model_arg", None),  # an explicit reference (OnlineDPOTrainer's ref_model)
            required=args.beta != 0.0,
            sync_ref_model=args.sync_ref_model,
            adapter_created_by_trainer=peft_config is not None,
            reload_from=model_id,
            model_init_kwargs=dict(args.model_init_kwargs or {}),
        )
        if self.reference.model is not None and args.disable_dropout:
            disable_dropout_in_model(self.reference.model)
        if self._configure_train_dataset(train_dataset, args) is not None:
            prompts_per_round = args.generation_batch_size // args.num_generations
            if len(train_dataset) < prompts_per_round:
                raise ValueError(
                    f"train_dataset has {len(train_dataset)} prompts but one generation round needs "
                    f"generation_batch_size / num_generations = {args.generation_batch_size} / "
                    f"{args.num_generations} = {prompts_per_round}; add prompts or lower "
                    "per_device_train_batch_size / steps_per_generation."
                )
        self._init_trainer(model, args, train_dataset, eval_dataset, processing_class, callbacks, optimizers)
        self._setup_rollout(rollout_func)
        self._setup_loss()

    # -- construction steps (composed by __init__ here and by DistillationTrainer's) ----------------------------
    @staticmethod
    def _setup_policy(
        model: str | torch.nn.Module,
        args: OnlineRLConfig,
        processing_class: Any,
        peft_config: Any,
        quantization_config: Any = None,
    ) -> tuple[torch.nn.Module, Any]:
        """The policy (loaded, PEFT-wrapped, dropout off if asked) and its tokenizer (left padding and truncation)."""
        model_id = model if isinstance(model, str) else None
        model = resolve_model(model, args, peft_config=peft_config, quantization_config=quantization_config)
        processing_class = resolve_processing_class(
            model_id or model, processing_class, padding_side="left", truncation_side="left"
        )
        if args.disable_dropout:
            disable_dropout_in_model(model)
        return model, processing_class

    def _setup_rewards(
        self,
        reward_funcs: Any,
        args: OnlineRLConfig,
        reward_processing_classes: Any,
        train_dataset: Any,
        rollout_func: Any,
        environment_factory: Any,
    ) -> None:
        """``self.reward_funcs``, ``self.reward_func_names`` and the ``RewardScorer`` (environment rewards last)."""
        env_rewards = self.agent.reward_funcs if self.agent is not None else []
        reward_funcs = self._resolve_reward_funcs(reward_funcs, args, env_rewards)
        reward_weights = args.reward_weights
        if reward_weights is not None and env_rewards and len(reward_weights) == len(reward_funcs) - len(env_rewards):
            reward_weights = [*reward_weights, *([1.0] * len(env_rewards))]  # environment rewards weigh 1 (TRL)
        if env_rewards and reward_processing_classes is not None:
            if not isinstance(reward_processing_classes, (list, tuple)):
                reward_processing_classes = [reward_processing_classes]
            reward_processing_classes = [*reward_processing_classes, *([None] * len(env_rewards))]
        from posttrain.rewards.scoring import RewardScorer

        self.scorer = RewardScorer(
            reward_funcs,
            reward_processing_classes=reward_processing_classes,
            reward_weights=reward_weights,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        self.reward_funcs = reward_funcs
        self.reward_func_names = list(self.scorer.names)
        # TRL's attribute: one tokenizer per reward function (None for callables)
        self.reward_processing_classes = self.scorer.reward_processing_classes
        self._validate_reward_signatures(reward_funcs, env_rewards, train_dataset, rollout_func, environment_factory)

    def _configure_train_dataset(self, train_dataset: Any, args: OnlineRLConfig) -> int | None:
        """Text only unless the trainer ``supports_vision``; a stream gets the shared streaming set-up
        (``configure_streaming``). Returns the length (None: stream)."""
        if not self.supports_vision:
            check_text_only(train_dataset, f"{self._trainer_name}Trainer")
        self._is_iterable = configure_streaming(args, train_dataset)
        return None if self._is_iterable else len(train_dataset)

    def _init_trainer(
        self,
        model: torch.nn.Module,
        args: OnlineRLConfig,
        train_dataset: Any,
        eval_dataset: Any,
        processing_class: Any,
        callbacks: list | None,
        optimizers: tuple,
    ) -> None:
        """HF Trainer's constructor with the online data path, then the reference and reward models on the device.

        Needs ``self.reference`` and ``self.reward_funcs`` (``ReferencePolicy("none")`` and ``[]`` when unused).
        """
        splits = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
        if any(isinstance(split, torch.utils.data.IterableDataset) for split in splits):
            # raw rows (strings) cannot be dispatched from the main process; each process reads its own share
            args.accelerator_config.dispatch_batches = False
        super().__init__(
            model=model,
            args=args,
            data_collator=_identity_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            compute_loss_func=_loss_is_already_scaled,
        )
        from accelerate.utils import set_seed

        set_seed(args.seed, device_specific=True)  # each process samples different completions (TRL)
        self.reference.prepare(self.accelerator)  # device, or a DeepSpeed/FSDP inference engine
        for func in self.reward_funcs:
            if isinstance(func, torch.nn.Module):
                func.to(self.accelerator.device).eval()
        if args.sync_ref_model:
            self.add_callback(SyncRefModelCallback(self.reference.model, self.accelerator))
        config = getattr(unwrap_base_model(self.model), "config", None)
        resolve_router_aux_loss_coef(args, self.model)  # None → the model's own coefficient (TRL)
        self.aux_loss_enabled = bool(getattr(config, "output_router_logits", False)) and args.router_aux_loss_coef != 0

    def _setup_rollout(self, rollout_func: Any) -> None:
        """Sampling settings, the generation backend (agent-wrapped), the rollout (``_make_rollout``), the buffer."""
        args = self.args
        self.num_generations = args.num_generations
        self.num_generations_eval = args.num_generations_eval or args.num_generations
        self.sampling = SamplingConfig.from_args(args, self.processing_class).resolved()
        self.rollout_func = rollout_func
        if getattr(args, "keep_routing", False) and (
            rollout_func is not None
            or self.agent is not None
            or type(self)._generate is not OnlineTrainerBase._generate
        ):
            used = ("rollout_func (agent_rollout_func included)" if rollout_func is not None
                    else "tools / environment_factory" if self.agent is not None else "a _generate override")  # fmt: skip
            raise ValueError(
                f"keep_routing=True cannot be combined with {used}: it replays the routing the group sampler records "
                "for plain completions, and these completions carry none (a tool loop or a captured agent row "
                "joins several generation calls plus tool-output tokens, which no single sampler call routed). "
                "Set keep_routing=False, or train without it."
            )
        self.backend = self._make_backend(rollout_func)
        if type(self)._generate is not OnlineTrainerBase._generate:
            # TRL's rollout dispatch: a subclass's `_generate(prompts)` produces every completion (in TRL the tool
            # loop runs inside `_generate`, so an override replaces it too)
            self.backend = _GenerateHookBackend(self, self.backend)
        elif self.agent is not None:
            self.backend = self.agent.wrap(self.backend)
        self._make_rollout()
        # seed=None: the shuffle draws from the global torch RNG, as TRL's (see posttrain.rollout.buffer)
        self.buffer = RolloutBuffer(args.steps_per_generation, args.num_iterations, seed=None)
        self._last_synced_step = -1
        self._pending_completions = None
        self._logs = _completion_logs(getattr(args, "generation_batch_size", None))

    def _check_vision(
        self,
        model: torch.nn.Module,
        processing_class: Any,
        args: OnlineRLConfig,
        train_dataset: Any,
        eval_dataset: Any,
        tools: Any,
        rollout_func: Any,
        environment_factory: Any,
    ) -> None:
        """A trainer that ``supports_vision`` (GRPO, RLOO) takes datasets with an ``image`` / ``images`` column:
        before training, the model must be a vision-language model with a processor that has an image processor and
        a chat template, the first rows' image placeholders must match their images, and the options that cannot
        carry images yet are refused."""
        from posttrain.data.vision_prompts import check_vision_rows, check_vision_setup

        splits = {"train_dataset": train_dataset}
        if isinstance(eval_dataset, dict):
            splits.update({f"eval_dataset[{name!r}]": split for name, split in eval_dataset.items()})
        elif eval_dataset is not None:
            splits["eval_dataset"] = eval_dataset
        vision = [name for name, split in splits.items() if split is not None and is_vision_dataset(split)]
        self._vision = bool(vision) and self.supports_vision
        if not self._vision:
            return
        trainer = f"{self._trainer_name}Trainer"
        check_vision_setup(processing_class, unwrap_base_model(model), trainer, vision[0])
        unsupported = {
            "use_vllm=True with vllm_mode='colocate'": args.use_vllm and args.vllm_mode != "server",
            "tools with use_vllm=True (tool turns with images are generated in-process)": bool(tools)
            and args.use_vllm,
            "environment_factory": environment_factory is not None,
            "rollout_func": rollout_func is not None,
            "a `_generate` override": type(self)._generate is not OnlineTrainerBase._generate,
        }
        for option, used in unsupported.items():
            if used:
                raise ValueError(
                    f"{trainer} with images (the {vision[0]} has an image column) does not support {option} yet in "
                    "posttrain: vision-language prompts are generated in-process (generation_backend='posttrain' or "
                    "'transformers') or on a generation server (use_vllm=True, vllm_mode='server'). Drop the option, "
                    "or the image column to train on text."
                )
        for name in vision:
            check_vision_rows(splits[name], name)

    # -- construction helpers ----------------------------------------------------------------------------------
    def _resolve_reward_funcs(
        self, reward_funcs: Any, args: OnlineRLConfig, env_rewards: list | None = None
    ) -> list[Any]:
        """Reward functions as callables or loaded reward models (TRL's rules; tokenizers are the scorer's job).

        Strings: a local folder or an ``org/name`` hub id is a reward model, loaded with
        ``AutoModelForSequenceClassification`` (``num_labels=1``, ``args.model_init_kwargs``); anything else is a
        registered reward-function name (``"accuracy_reward"``) or a dotted import path (``"my_rewards.func"``).
        ``env_rewards`` (the environments' ``get_reward`` columns) come last.
        """
        if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
            reward_funcs = []
        if not isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [reward_funcs]
        if not reward_funcs and not env_rewards:
            raise ValueError(
                "No reward source provided. Pass reward_funcs, or an environment_factory whose environment defines "
                "a get_reward method."
            )
        return [*(self._resolve_reward_func(func, args) for func in reward_funcs), *(env_rewards or [])]

    @staticmethod
    def _validate_reward_signatures(
        reward_funcs: list, env_rewards: list, train_dataset: Any, rollout_func: Any, environment_factory: Any
    ) -> None:
        """Fail at init, not at the first step, when a reward function cannot take the keyword arguments it will
        receive or needs a dataset column that is missing (unknown with a rollout_func: its extra keys are columns)."""
        from posttrain.rewards.scoring import validate_reward_func_signature

        columns = getattr(train_dataset, "column_names", None)
        if rollout_func is not None:
            columns = None
        for func in reward_funcs:
            if any(func is env for env in env_rewards):
                continue
            validate_reward_func_signature(func, columns, environments=environment_factory is not None)

    def _environment_placeholder_dataset(self, args: OnlineRLConfig, environment_factory: Any) -> Any:
        """TRL: with a single ``environment_factory`` the dataset may be omitted; rows of empty prompts stand in."""
        if environment_factory is None:
            unless = " unless an `environment_factory` is provided" if self._trainer_name == "GRPO" else ""
            raise ValueError(
                f"`train_dataset` is required{unless}: {self._trainer_name}Trainer generates completions for the "
                "prompts of its 'prompt' column. Pass train_dataset=... (a Dataset or IterableDataset)."
            )
        if isinstance(environment_factory, dict):
            raise ValueError(  # TRL's phrase first
                "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                "`environment` column to route each example to its environment: every row needs an 'environment' "
                "column naming its environment. Provide a dataset, or pass a single environment factory."
            )
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError(  # TRL's phrase first
                "When training without a `train_dataset` (the environment owns the data and returns the prompt from "
                "`reset()`), `max_steps` must be set to a positive value to define the training length: set "
                "max_steps to a positive number."
            )
        from posttrain.agents.environments import placeholder_dataset

        return placeholder_dataset(args.generation_batch_size // args.num_generations)

    def _make_agent(
        self, tools: Any, environment_factory: Any, rollout_func: Any, processing_class: Any, model: Any, args: Any
    ) -> Any:
        """The ``AgentRollout`` for ``tools`` / ``environment_factory`` (None when neither is given)."""
        if not tools and environment_factory is None:
            return None
        if rollout_func is not None:
            raise ValueError(
                "rollout_func cannot be combined with tools / environment_factory: the rollout function does its own "
                "generation (return env_mask from it for tool tokens), while tools run in posttrain's tool loop."
            )
        from posttrain.agents.loop import AgentRollout

        config = getattr(model, "config", None)
        return AgentRollout(
            processing_class,
            tools=tools,
            environment_factory=environment_factory,
            max_tool_calling_iterations=getattr(args, "max_tool_calling_iterations", None),
            max_completion_length=args.max_completion_length,
            chat_template_kwargs=args.chat_template_kwargs,
            max_model_length=getattr(config, "max_position_embeddings", None),
        )

    @staticmethod
    def _resolve_reward_func(func: Any, args: OnlineRLConfig) -> Any:
        """A local folder or an ``org/name`` id is a reward model; other strings are reward names or dotted paths."""
        if not isinstance(func, str):
            return func
        if not os.path.isdir(func) and "/" not in func:
            from posttrain.rewards.registry import resolve_reward_func

            return resolve_reward_func(func)
        kwargs = dict(args.model_init_kwargs or {})
        if args.trust_remote_code:
            kwargs.setdefault("trust_remote_code", True)
        return create_model_from_path(func, task="sequence-classification", **kwargs)

    def _make_backend(self, rollout_func: Any) -> Any:
        from posttrain.generation.registry import get_backend

        args = self.args
        model = self.accelerator.unwrap_model(self.model)
        if rollout_func is not None:
            from posttrain.generation.rollout_func import RolloutFuncBackend

            return RolloutFuncBackend(rollout_func, self, tokenizer=self.processing_class)
        if args.use_vllm:
            backend = get_backend(f"vllm_{args.vllm_mode}", model, self.processing_class, args=args)
            if getattr(args, "keep_routing", False):
                # server mode: the posttrain server's group sampler records the routing the policy replays
                from posttrain.models.moe_routing import require_routers

                require_routers(model)
                backend.check_routing_support()
            return backend
        name = args.generation_backend
        if args.use_transformers_continuous_batching:
            warnings.warn(
                "use_transformers_continuous_batching: posttrain generates with the 'transformers' backend "
                "(model.generate) instead; set generation_backend='posttrain' for shared-prefix group sampling.",
                stacklevel=3,
            )
            name = "transformers"
        if getattr(args, "keep_routing", False):
            if name != "posttrain" or self.sampling.generation_kwargs:
                raise ValueError(
                    "keep_routing=True needs the 'posttrain' group sampler, which records the MoE routing; "
                    "generation_kwargs or use_transformers_continuous_batching select model.generate instead."
                )
            return get_backend(
                name,
                model,
                self.processing_class,
                return_logprobs=self._wants_sampling_logprobs(),
                record_routing=True,
            )
        if name == "posttrain" and self.sampling.generation_kwargs:
            # TRL passes generation_kwargs to model.generate: so does the transformers backend
            logger.info(
                "generation_kwargs %s are not options of the 'posttrain' group sampler (it takes only keys that "
                "override sampling fields); generating with generation_backend='transformers' (model.generate).",
                sorted(self.sampling.generation_kwargs),
            )
            name = "transformers"
        return get_backend(name, model, self.processing_class, return_logprobs=self._wants_sampling_logprobs())

    # -- subclass hooks ----------------------------------------------------------------------------------------
    def _prepare_model(self, model: torch.nn.Module, args: OnlineRLConfig) -> None:
        """Adjust the policy before the reference is derived from it (e.g. GRPO's ``cast_lm_head_to_fp32``)."""

    def _setup_loss(self) -> None:
        """Last construction step: the subclass's loss settings (``self.args`` and the rollout exist by now)."""

    def _make_rollout(self) -> None:
        """``self.pipeline``: generation → rewards → advantages with the subclass's estimator."""
        self.pipeline = RolloutPipeline(
            tokenizer=self.processing_class,
            backend=self.backend,
            scorer=self.scorer,
            sampling=self.sampling,
            settings=self._rollout_settings(),
            estimator=self._make_estimator(),
            policy_logps=self._policy_logps_no_grad,
            ref_logps=self._ref_logps if self.reference.kind != "none" else None,
            accelerator=self.accelerator,
            agent=self.agent,
        )

    def _make_estimator(self):
        raise TypeError(f"{type(self).__name__} must define _make_estimator().")

    def _compute_loss(self, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} must define _compute_loss().")

    def _importance_sampling(self) -> ImportanceSamplingSettings | None:
        """The sampler-vs-trainer correction to apply when the backend returns log-probs (None = off)."""
        return None

    def _wants_sampling_logprobs(self) -> bool:
        return self._importance_sampling() is not None

    def _needs_old_logps(self) -> bool:
        """TRL's rule: π_old differs from π_θ when the batch outlives one optimizer step."""
        args = self.args
        return args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0

    def _rollout_settings(self) -> RolloutSettings:
        args = self.args
        return RolloutSettings(
            num_generations=self.num_generations,
            num_generations_eval=self.num_generations_eval,
            logprob_batch_size=args.per_device_train_batch_size,
            mask_truncated_completions=args.mask_truncated_completions,
            pad_to_multiple_of=args.pad_to_multiple_of,
            chat_template_kwargs=args.chat_template_kwargs,
            compute_old_logps=self._needs_old_logps(),
            compute_ref_logps=args.beta != 0.0,
            importance_sampling=self._importance_sampling(),
            keep_completions=True,  # every round, for TRL's `self._logs` (printed only with log_completions)
            # TRL 0.x's GRPO/RLOO `max_prompt_length` (posttrain.legacy keeps it as a plain attribute)
            max_prompt_length=getattr(args, "_legacy_max_prompt_length", None),
            multimodal=getattr(self, "_vision", False),
        )

    # -- log-probs ---------------------------------------------------------------------------------------------
    def _token_stats(
        self,
        model: torch.nn.Module,
        batch: RolloutBatch,
        compute_entropy: bool = False,
        entropy_requires_grad: bool = False,
    ) -> TokenStats:
        return completion_token_stats(
            model,
            batch,
            temperature=self.sampling.temperature if self.scores_at_sampling_temperature else 1.0,
            compute_entropy=compute_entropy,
            entropy_requires_grad=entropy_requires_grad,
            share_prompts=bool(self.args.shared_prompt_forward),
        )

    def _policy_logps_no_grad(self, batch: RolloutBatch) -> torch.Tensor:
        return self._token_stats(self.model, batch).logps

    def _ref_logps(self, batch: RolloutBatch) -> torch.Tensor:
        with self.reference.activate(self.model) as ref_model:
            return self._token_stats(ref_model, batch).logps

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """TRL's ``trainer.ref_model``: the separate frozen reference module, or None (β = 0, or a PEFT policy whose
        reference is the base model with adapters disabled)."""
        reference = getattr(self, "reference", None)
        return None if reference is None else reference.model

    # -- data path ---------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "image", "images"]

    def _prompts_per_round(self) -> int:
        """Unique prompts per generation round over all processes (``generation_batch_size`` counts completions)."""
        return self.args.generation_batch_size // self.num_generations

    # TRL's GRPO, RLOO and distillation shuffle each generation batch (torch.randperm, the global RNG) before splitting
    # it into micro-batches; its other online trainers (SDPO, SDFT, GOLD, IW-OPD, and those on the plain dataloader)
    # split it as it comes. The same rule here keeps both the micro-batches and the global RNG stream (which
    # model.generate samples from next) equal to TRL's.
    shuffles_generation_batch: bool = True

    # TRL's trainers on the plain Trainer dataloader (Online DPO, A2PO, GKD) keep an epoch's short last batch unless
    # ``dataloader_drop_last``; the ones on ``RepeatSampler`` (GRPO, RLOO, distillation, GOLD, ...) drop it.
    keeps_short_last_round: bool = False

    def _round_per_window(self, args: Any = None) -> bool:
        """True for a trainer that keeps the short last round and generates once per optimizer step (GKD: a round is
        the ``steps_per_generation = gradient_accumulation_steps`` micro-batches of one optimizer step).

        Its dataloader then yields TRL's batches of ``per_device_train_batch_size`` rows, each chunk once per
        iteration, so HF Trainer cuts the epoch into optimizer steps exactly as TRL's plain dataloader does, a short
        last window (fewer micro-batches, the last one short) included; ``get_batch_samples`` gives the window's rows
        to its first micro-step, which generates the round.
        """
        args = self.args if args is None else args
        return (
            self.keeps_short_last_round
            and args.steps_per_generation > 1
            and args.steps_per_generation == args.gradient_accumulation_steps
        )

    def _repeat_kwargs(self) -> dict[str, Any]:
        """TRL's prompt grouping for training, shared by the map-style sampler and the stream."""
        args = self.args
        per_window = self._round_per_window()
        # replays: every micro-step of every iteration, or (per-micro-batch batches) once per iteration
        repeat_count = args.num_iterations * (1 if per_window else args.steps_per_generation)
        return dict(
            mini_repeat_count=self.num_generations,
            batch_size=self._prompts_per_round(),
            repeat_count=repeat_count,
            shuffle=args.shuffle_dataset,
            seed=args.seed,
            # a replayed round cannot be short (see RepeatSampler's drop_last); with per-micro-batch batches the
            # dataloader's own drop_last drops a short last batch, as TRL's does
            drop_last=(
                not self.keeps_short_last_round or repeat_count != 1 or (args.dataloader_drop_last and not per_window)
            ),
        )

    def _get_train_sampler(self, train_dataset=None) -> RepeatSampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return RepeatSampler(dataset, **self._repeat_kwargs())

    def _get_eval_sampler(self, eval_dataset) -> RepeatSampler:
        return RepeatSampler(eval_dataset, mini_repeat_count=self.num_generations_eval, seed=self.args.seed)

    def get_train_dataloader(self):
        args = self.args
        dataset = self.train_dataset
        if self._is_iterable:
            dataset = repeat_iterable_dataset(dataset, **self._repeat_kwargs())
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self._train_batch_size * (1 if self._round_per_window() else args.steps_per_generation),
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """HF's window of ``num_batches`` micro-batches; with ``_round_per_window`` its first micro-batch carries
        every row of the window (the round it generates; the others are served from the buffer). A short last window
        has fewer micro-batches, which HF counts in ``current_gradient_accumulation_steps``."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._round_per_window() and len(batch_samples) > 1:
            batch_samples = [[row for batch in batch_samples for row in batch], *batch_samples[1:]]
        return batch_samples, num_items_in_batch

    def get_eval_dataloader(self, eval_dataset=None):
        """HF's eval dataloader; a streaming eval set gets the eval sampler's grouping (each prompt
        ``num_generations_eval`` times, in order) and no workers, leaving the training dataloader's settings alone."""
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = self.eval_dataset if dataset is None else dataset
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            return super().get_eval_dataloader(eval_dataset)
        stream = repeat_iterable_dataset(dataset, mini_repeat_count=self.num_generations_eval, shuffle=False)
        loader = torch.utils.data.DataLoader(
            stream,
            batch_size=self.args.eval_batch_size,
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, description="Evaluation"),
            num_workers=0,  # several workers would each replay the stream
            pin_memory=self.args.dataloader_pin_memory,
        )
        # Raw rows (strings) cannot be dispatched from the main process: each process reads its own share, as the
        # constructor sets up for a stream given there (a stream given to evaluate() arrives after that set-up).
        config = self.accelerator.dataloader_config
        dispatch_batches, config.dispatch_batches = config.dispatch_batches, False
        try:
            return self.accelerator.prepare(loader)
        finally:
            config.dispatch_batches = dispatch_batches

    def _prepare_inputs(self, inputs: list[dict[str, Any]]) -> RolloutBatch:
        mode = self._mode()
        if mode == "eval":
            return self._generate_and_score(inputs, mode)
        if self.buffer.needs_generation():
            # an epoch's short last round: micro-batches of per_device_train_batch_size rows, the last one short
            micro_batch_size = self.args.per_device_train_batch_size if self._round_per_window() else None
            self.buffer.fill(
                self._generate_and_score(inputs, mode),
                shuffle=self.shuffles_generation_batch,
                micro_batch_size=micro_batch_size,
            )
        return self.buffer.next()

    def _record(self, mode: str):
        def sink(name: str, value: float) -> None:
            if name == "num_tokens":  # the pipeline reports this batch's tokens; TRL logs the running total
                if mode == "train":
                    self.state.num_input_tokens_seen += int(value)
                    self.record_metric("num_tokens", self.state.num_input_tokens_seen, mode=mode)
                return
            self.record_metric(name, value, mode=mode)

        return sink

    def _generate_and_score(self, rows: list[dict[str, Any]], mode: str) -> RolloutBatch:
        if self.state.global_step != self._last_synced_step:
            self.backend.sync_weights(self.accelerator.unwrap_model(self.model))
            self._last_synced_step = self.state.global_step
            pushed = getattr(self._inner_backend(), "last_sync_bytes", None)
            if pushed:  # server mode: bytes of this push (full model, or the LoRA adapter with adapter-only sync)
                self.record_metric("perf/weight_sync_bytes", float(pushed), mode="train")
        batch = self.pipeline.run(
            rows,
            mode=mode,
            device=self.accelerator.device,
            trainer_state=self.state,
            record_metric=self._record(mode),
        )
        self._record_backend_metrics(mode)
        if self.pipeline.last_completions is not None:
            self._pending_completions = self.pipeline.last_completions
            self._record_completion_logs(rows, self.pipeline.last_completions)
        return batch

    def _record_backend_metrics(self, mode: str) -> None:
        """Log the generation backend's own metrics when it has some (``pop_metrics``: the server pool's
        ``server/<i>/requests``, ``tokens``, ``tokens_per_second``, ``failures``)."""
        pop = getattr(self._inner_backend(), "pop_metrics", None)
        if callable(pop):
            for name, value in pop().items():
                self.record_metric(name, value, mode=mode)

    def _record_completion_logs(self, rows: list[dict[str, Any]], table: Any) -> None:
        """Keep the round's prompts, completions, rewards, advantages and ``log_extra`` columns (over every process)
        in ``self._logs``, where TRL keeps them: raw prompts, completions as text (or one assistant message for
        conversational prompts), ``rewards[name]``, ``advantages`` and ``extra[column]``, each the last
        ``generation_batch_size`` values."""
        from posttrain.data.utils import is_conversational

        columns = dict(table.columns)
        prompts = self.pipeline.gather_object([row.get("prompt") for row in rows])
        texts, advantages = columns.pop("completion"), columns.pop("advantage")
        columns.pop("prompt")
        logs = self._logs
        logs["prompt"].extend(prompts)
        logs["completion"].extend(
            [{"role": "assistant", "content": text}] if is_conversational({"prompt": prompt}) else text
            for prompt, text in zip(prompts, texts)
        )
        for name in self.reward_func_names:
            logs["rewards"][name].extend(columns.pop(name, []))
        for column, values in columns.items():
            logs["extra"][column].extend(values)
        logs["advantages"].extend(advantages)
        if self.args.log_multimodal and any("image" in row or "images" in row for row in rows):
            from posttrain.data.vision_prompts import row_images

            logs["images"].extend(self.pipeline.gather_object([row_images(row) for row in rows]))  # TRL's

    def _generate(self, prompts: list) -> tuple:
        """TRL's generation hook: completions for ``prompts``, this process's raw prompts (text or message lists, each
        repeated once per completion, as the sampler laid them out).

        Returns TRL's tuple (``_generate_fields``): GRPO's ``(prompt_ids, completion_ids, tool_mask, completions,
        logprobs, extra_fields, images, tool_images)``, RLOO's ``(prompt_ids, completion_ids, completions)``.

        A subclass that overrides it (as in TRL) is called for every generation, and may call ``super()._generate``
        to use posttrain's generation; from what it returns posttrain uses ``prompt_ids``, ``completion_ids``,
        ``logprobs`` (None: none), ``tool_mask`` (1 = model token) and ``extra_fields`` (per-row reward kwargs).
        Completions are decoded from ``completion_ids`` for the reward functions. Without an override, posttrain's
        pipeline generates directly (this method is not called). With ``tools`` the override replaces the tool loop
        too (as in TRL, where it runs inside ``_generate``); ``super()._generate`` here generates without it.
        """
        from posttrain.rollout.pipeline import completions_as_messages, render_prompts

        backend = self.backend.inner if isinstance(self.backend, _GenerateHookBackend) else self.backend
        _, prompt_ids = render_prompts(
            [{"prompt": p} for p in prompts], self.processing_class, self.args.chat_template_kwargs
        )
        max_prompt_length = getattr(self.pipeline.settings, "max_prompt_length", None)
        if max_prompt_length:  # as the pipeline does
            prompt_ids = [ids[-max_prompt_length:] for ids in prompt_ids]
        num_generations = self.num_generations if self._mode() == "train" else self.num_generations_eval
        pipeline_backend, self.pipeline.backend = self.pipeline.backend, backend
        try:
            generated = self.pipeline.generate(prompts, prompt_ids, num_generations)
        finally:
            self.pipeline.backend = pipeline_backend
        texts = self.processing_class.batch_decode(generated.completion_ids, skip_special_tokens=True)
        extra = dict(generated.extra)
        values = {
            "prompt_ids": generated.prompt_ids,
            "completion_ids": generated.completion_ids,
            "tool_mask": extra.pop("env_mask", None),
            "completions": completions_as_messages(
                prompts, texts, tokenizer=self.processing_class, completion_ids=generated.completion_ids
            ),
            "logprobs": generated.logprobs,
            "extra_fields": extra,
            "images": None,
            "tool_images": [],
        }
        return tuple(values[name] for name in self._generate_fields)

    # -- loss --------------------------------------------------------------------------------------------------
    def _grad_accum_divisor(self) -> int:
        """Micro-batches of the current optimizer step in training (HF's count), 1 in evaluation."""
        if self._mode() == "eval":
            return 1
        return int(getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps))

    def _finish_loss(
        self, loss: torch.Tensor, aux_loss: torch.Tensor | None, *, divide_by_grad_accum: bool = True
    ) -> torch.Tensor:
        """The end of every online loss (GRPO, RLOO, distillation): the gradient-accumulation divisor, then the MoE
        router's load-balancing term.

        ``loss / GA`` (``divide_by_grad_accum=False`` for a loss already normalised over the whole optimizer step,
        e.g. DAPO's global token mean) ``+ router_aux_loss_coef · aux_loss / GA`` when the policy outputs router
        logits (``aux_loss`` is one micro-batch's, hence always divided); ``aux_loss`` is logged, averaged over
        processes. GA is HF's count of micro-batches in the current optimizer step in training, 1 in evaluation.
        """
        divisor = self._grad_accum_divisor()
        if divide_by_grad_accum:
            loss = loss / divisor
        if self.aux_loss_enabled and aux_loss is not None:
            loss = loss + self.args.router_aux_loss_coef * aux_loss / divisor
            self.record_metric("aux_loss", self._gather_mean(aux_loss), mode=self._mode())
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError(f"The {self._trainer_name}Trainer does not support returning outputs.")
        return self._compute_loss(model, inputs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).mean().detach()
        return loss, None, None

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.record_metric("step_time", time.perf_counter() - start, mode="train")
        if self.accelerator.sync_gradients:
            if self.accelerator.device.type == "cpu" and not getattr(self.optimizer, "state", True):
                # Before the first optimizer step (which allocates the Adam moments) the backward's freed scratch
                # goes back to the OS rather than staying resident under them. Later steps skip it: a trim costs
                # 1-2.5 ms, and generation trims once per step anyway.
                release_freed_host_memory()
            self._on_optimizer_step()
        return loss

    def _on_optimizer_step(self) -> None:
        """Called after the last micro-batch of each optimizer step (adaptive controllers update here)."""

    def _record_policy_metrics(
        self, entropies: torch.Tensor, mask: torch.Tensor, objective_stats: dict[str, torch.Tensor], mode: str
    ) -> None:
        """``entropy`` and, for clipping objectives, ``clip_ratio/*``, reduced as TRL does.

        Means are over every valid token of every process (Σ x·m / Σ m; one value per sequence at sequence level);
        ``low_min`` / ``high_max`` are the min / max over the gathered per-sequence fractions (NaN for an empty
        completion, skipped).
        """
        self.record_metric("entropy", self._global_masked_mean(entropies.detach(), mask), mode=mode)
        if "is_low_clipped" not in objective_stats:
            return
        means, per_sequence = [], []
        weights = mask.float()
        for key in ("is_low_clipped", "is_high_clipped", "is_region_clipped"):
            x = objective_stats[key].detach().float()
            if x.dim() >= 2 and x.shape[-1] == 1 and weights.shape[-1] != 1:  # sequence level: one per sequence
                per_sequence.append(x.squeeze(-1))
                means.append(self._global_masked_mean(x.squeeze(-1), torch.ones_like(x.squeeze(-1))))
            else:
                per_sequence.append((x * weights).sum(-1) / weights.sum(-1))
                means.append(self._global_masked_mean(x, weights))
        low, high = (self._gather_rows(v) for v in per_sequence[:2])
        values = clip_ratio_metrics(*(torch.tensor([m]) for m in means), low_per_sequence=low, high_per_sequence=high)
        for name, value in values.items():
            self.record_metric(name, value, mode=mode)

    def _global_masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        """Σ values·mask / max(Σ mask, 1) over every process (TRL's ``global_masked_mean``)."""
        mask = mask.float()
        totals = torch.stack([(values.float() * mask).sum(), mask.sum()]).to(self.accelerator.device)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        return float(totals[0] / totals[1].clamp(min=1.0))

    def _gather_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (one per row) from every process, NaN-padded to equal lengths first."""
        values = values.detach().float().to(self.accelerator.device)
        if self.accelerator.num_processes == 1:
            return values
        values = self.accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
        return self.accelerator.gather(values)

    def _gather_mean(self, value: torch.Tensor) -> float:
        """Mean over processes of a per-process scalar (NaN-aware)."""
        return mean_over_processes(self.accelerator, value)

    # -- logging -----------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        table, self._pending_completions = self._pending_completions, None
        if table is None or not self.args.log_completions or not self.accelerator.is_main_process:
            return
        step = self.state.global_step
        print_completions_table(table, step, self.args.num_completions_to_print, self.args.log_unique_prompts)
        write_completions_parquet(table, self.args.output_dir, step, self.args.log_unique_prompts)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _extra_checkpoint_state(self) -> dict[str, Any]:
        """``{file name: JSON-serialisable state}`` written into each checkpoint (controllers)."""
        return {}

    def _load_extra_checkpoint_state(self, states: dict[str, Any]) -> None:
        """Restore what ``_extra_checkpoint_state`` wrote (only the files that exist are passed)."""

    def _save_checkpoint_extras(self, output_dir: str) -> None:
        super()._save_checkpoint_extras(output_dir)
        if not self.args.should_save:
            return
        for name, state in self._extra_checkpoint_state().items():
            tmp = os.path.join(output_dir, f".{name}.tmp")
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, os.path.join(output_dir, name))

    def _load_resume_state(self, checkpoint: str) -> None:
        super()._load_resume_state(checkpoint)
        states = {}
        for name in self._extra_checkpoint_state():
            path = os.path.join(checkpoint, name)
            if os.path.isfile(path):
                with open(path) as f:
                    states[name] = json.load(f)
        self._load_extra_checkpoint_state(states)

    def resume_state_dict(self) -> dict[str, Any]:
        """Adds the rollout buffer (its step counter and, mid-round, the remaining micro-batches; its shuffle draws
        from the global torch RNG, which the checkpoint's ``rng_state.pth`` restores) and
        the generation backend's own state when it has one (the ``vllm_server`` request-seed counter)."""
        state = {**super().resume_state_dict(), "rollout_buffer": self.buffer.state_dict()}
        backend = self._stateful_backend()
        if backend is not None:
            state["generation_backend"] = backend.state_dict()
        return state

    def load_resume_state_dict(self, state: dict[str, Any]) -> None:
        super().load_resume_state_dict(state)
        if "rollout_buffer" in state:
            self.buffer.load_state_dict(state["rollout_buffer"], device=self.accelerator.device)
        backend = self._stateful_backend()
        if backend is not None and "generation_backend" in state:
            backend.load_state_dict(state["generation_backend"])

    def _inner_backend(self) -> Any:
        """The generation backend under any tool-loop wrapper (``ToolCallingBackend.inner``)."""
        backend = getattr(self, "backend", None)
        while getattr(backend, "inner", None) is not None:
            backend = backend.inner
        return backend

    def _stateful_backend(self) -> Any:
        """The generation backend if it has resume state (``state_dict``, not a module's), else None."""
        backend = self._inner_backend()
        if isinstance(backend, torch.nn.Module) or not callable(getattr(backend, "state_dict", None)):
            return None
        return backend
