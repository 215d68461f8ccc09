"""The online-RL trainer base shared by GRPO, RLOO and on-policy distillation.

``OnlineRLConfig`` holds the fields GRPOConfig and RLOOConfig share (TRL's names and defaults: data, generation,
vLLM, reference/KL, batch arithmetic, logging) plus posttrain's ``generation_backend``. ``OnlineTrainerBase`` wires
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
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from posttrain.data.dataset_ops import configure_streaming
from posttrain.distributed import mean_over_processes
from posttrain.generation.base import SamplingConfig
from posttrain.generation.host_memory import release_freed_host_memory
from posttrain.models.completion_scoring import completion_token_stats
from posttrain.models.forward import TokenStats
from posttrain.models.loading import (
    create_model_from_path,
    disable_dropout_in_model,
    resolve_model,
    resolve_processing_class,
    resolve_router_aux_loss_coef,
)
from posttrain.models.reference import SyncRefModelCallback, create_reference_policy
from posttrain.models.unwrap import unwrap_base_model
from posttrain.reliability.validation import check_datasets, check_text_only
from posttrain.rollout.buffer import RolloutBatch, RolloutBuffer
from posttrain.rollout.completions_log import print_completions_table, write_completions_parquet
from posttrain.rollout.metrics import clip_ratio_metrics
from posttrain.rollout.pipeline import ImportanceSamplingSettings, RolloutPipeline, RolloutSettings
from posttrain.rollout.sampler import (
    RepeatSampler,
    check_eval_batch,
    repeat_iterable_dataset,
    resolve_generation_batch,
)
from posttrain.trainers.base import PAD_TO_MULTIPLE_OF_HELP, BaseConfig, BaseTrainer

GENERATION_BACKENDS = ("posttrain", "transformers")
logger = logging.getLogger(__name__)


@dataclass
class OnlineRLConfig(BaseConfig):
    """Fields shared by ``GRPOConfig`` and ``RLOOConfig`` (TRL's names and defaults)."""

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    remove_unused_columns: bool | None = field(
        default=False,
        metadata={"help": "Keep only the 'prompt' column. Keep False when reward functions read other columns."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow models/tokenizers with custom code (also for reward models and their tokenizers)."},
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the MoE load-balancing loss (models with `output_router_logits`); no-op else. None: "
            "the model's own `router_aux_loss_coef`."
        },
    )
    disable_dropout: bool = field(default=False, metadata={"help": "Disable dropout in the policy and reference."})
    # -- data ----------------------------------------------------------------------------------------------------
    num_generations: int | None = field(
        default=8,
        metadata={"help": "Completions sampled per prompt (G, >= 2). The generation batch must hold whole groups."},
    )
    num_generations_eval: int | None = field(
        default=None, metadata={"help": "Completions per prompt during evaluation; None = `num_generations`."}
    )
    max_completion_length: int | None = field(default=512, metadata={"help": "Maximum generated tokens."})
    ds3_gather_for_generation: bool = field(
        default=True, metadata={"help": "DeepSpeed ZeRO-3: gather the policy weights for generation."}
    )
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the training prompts."})
    shared_prompt_forward: bool = field(
        default=True,
        metadata={
            "help": "posttrain: score a micro-batch's completions with each distinct prompt encoded once (a tree "
            "attention mask; same loss and gradients as the plain forward, fewer tokens). Used with sdpa/eager "
            "attention when it is estimated to save work; False always runs one [prompt | completion] row each."
        },
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": PAD_TO_MULTIPLE_OF_HELP},
    )
    # -- generation ----------------------------------------------------------------------------------------------
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generation round over all processes. None = per_device_train_batch_size × "
            "num_processes × steps_per_generation. Mutually exclusive with `steps_per_generation`."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-steps served by one generation round; None = gradient_accumulation_steps. Mutually "
            "exclusive with `generation_batch_size`."
        },
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (also divides the logits)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass in (0, 1]; 1.0 = off."})
    top_k: int = field(default=0, metadata={"help": "Top-k filtering; 0 = off."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p filtering in [0, 1]; None = off."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty; 1.0 = off."})
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra generation arguments, merged last (they override the fields above)."}
    )
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments for every `apply_chat_template` call."}
    )
    cache_implementation: str | None = field(
        default=None, metadata={"help": "KV-cache implementation for the 'transformers' generation backend."}
    )
    generation_backend: str = field(
        default="posttrain",
        metadata={
            "help": "Generation backend when use_vllm=False and no rollout_func is given: 'posttrain' (default: "
            "posttrain's group sampler — each prompt prefilled once, KV cache shared by its G completions, finished "
            "rows dropped, sampling log-probs returned) or 'transformers' (`model.generate`, as TRL).",
            "choices": list(GENERATION_BACKENDS),
        },
    )
    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={
            "help": "TRL's transformers continuous batching. posttrain generates with the 'transformers' backend "
            "instead (same sampling), with a warning."
        },
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "Kwargs for `ContinuousBatchingConfig` (unused, see above)."}
    )
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "Deprecated: use `use_transformers_continuous_batching`."}
    )
    # -- vLLM ----------------------------------------------------------------------------------------------------
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Generate outside the training loop: vllm_mode='server' (a `posttrain serve` / `vllm serve` "
            "process, weights pushed to it; `pip install posttrain[serve]`) or 'colocate' (vLLM in this process; "
            "`pip install posttrain[vllm]` and a CUDA GPU)."
        },
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "'colocate' (vLLM in-process, GPU) or 'server' (HTTP generation server)."},
    )
    vllm_model_impl: str = field(default="vllm", metadata={"help": "'vllm' or 'transformers' model implementation."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "Regex-constrained decoding."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "Server URL (overrides host/port)."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port."})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait for the server at start-up, then ConnectionError."}
    )
    vllm_group_port: int = field(default=51216, metadata={"help": "Port of the weight-update group."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "Colocate: GPU memory fraction."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "Colocate: context window."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "Colocate: tensor parallel size."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Colocate: sleep between rollouts."})
    # -- training ------------------------------------------------------------------------------------------------
    beta: float = field(
        default=0.0, metadata={"help": "KL coefficient. 0.0 loads no reference model (less memory, faster)."}
    )
    num_iterations: int = field(default=1, metadata={"help": "Optimisation passes per generated batch (μ)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping bound ε (ratio ≥ 1 − ε)."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping bound ε_high; None = `epsilon` (DAPO recommends 0.28)."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; None = all 1.0."}
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Exclude completions that hit max_completion_length from the loss (DAPO)."}
    )
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: mix the policy into the reference every `ref_model_sync_steps`."}
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO α: ref ← α·θ + (1 − α)·ref."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO τ: steps between reference syncs."})
    # -- logging -------------------------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "At each logging step, print the last generation batch with rich and write it to "
            "output_dir/completions/completions_{step:05d}.parquet."
        },
    )
    log_multimodal: bool = field(default=True, metadata={"help": "Include images in logged tables."})
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Rows printed by `log_completions` (None = all)."}
    )
    log_unique_prompts: bool = field(default=False, metadata={"help": "Log each prompt once in the table."})

    _trainer_name = "GRPO"
    # Dict fields that also accept a JSON string (command line / YAML), as TRL's configs.
    _VALID_DICT_FIELDS = [
        *TrainingArguments._VALID_DICT_FIELDS,
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
        "transformers_continuous_batching_config",
    ]

    # Why auto_find_batch_size cannot work; "{name}" is the trainer's name.
    _AUTO_BATCH_SIZE_ERROR = (
        "auto_find_batch_size=True is not supported by {name}: changing the batch size would break the prompt "
        "groups (num_generations completions per prompt). Set the batch size explicitly."
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_online_options()
        self._resolve_batch_plan()

    def _check_online_options(self) -> None:
        """Checks every online trainer shares: generation backend, vLLM mode, fixed batch size, no CP/SP."""
        if self.use_transformers_paged:
            warnings.warn(
                "use_transformers_paged is deprecated; use use_transformers_continuous_batching.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching = True
        if self.generation_backend not in GENERATION_BACKENDS:
            raise ValueError(
                f"Unknown generation_backend {self.generation_backend!r}. Valid values: "
                f"{', '.join(GENERATION_BACKENDS)} (use use_vllm=True for vLLM)."
            )
        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {self.vllm_mode!r}.")
        if self.auto_find_batch_size:
            raise ValueError(self._AUTO_BATCH_SIZE_ERROR.format(name=self._trainer_name))
        pc = self.parallelism_config
        if pc is not None and (getattr(pc, "cp_size", 1) > 1 or getattr(pc, "sp_size", 1) > 1):
            raise ValueError(
                f"Context/sequence parallelism is not supported by {self._trainer_name}; remove cp_size/sp_size "
                "from parallelism_config."
            )

    def _resolve_batch_plan(self) -> None:
        """GRPO/RLOO batch rules: whole groups of ``num_generations >= 2`` per generation round (TRL's arithmetic)."""
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}.")
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be a positive integer, got {self.max_completion_length}.")
        plan = resolve_generation_batch(
            per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            num_generations=self.num_generations,
            world_size=self.world_size,
            generation_batch_size=self.generation_batch_size,
            steps_per_generation=self.steps_per_generation,
            trainer_name=self._trainer_name,
        )
        self.generation_batch_size = plan.generation_batch_size
        self.steps_per_generation = plan.steps_per_generation
        if self.do_eval and str(getattr(self.eval_strategy, "value", self.eval_strategy)) != "no":
            check_eval_batch(
                self.per_device_eval_batch_size, self.world_size, self.num_generations_eval or self.num_generations
            )


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
    loss_is_scaled_for_ga = True
    # Score completions under π / temperature (GRPO/RLOO: the sampling distribution); False scores under π itself
    # (TRL's Online DPO and A2PO take log_softmax of the raw logits whatever the sampling temperature).
    scores_at_sampling_temperature = True

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
        model, processing_class = self._setup_policy(model, args, processing_class, peft_config, quantization_config)
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
        """Text only; a stream gets the shared streaming set-up (``configure_streaming``). Returns the length (None:
        stream)."""
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
        self.backend = self._make_backend(rollout_func)
        if self.agent is not None:
            self.backend = self.agent.wrap(self.backend)
        self._make_rollout()
        # seed=None: the shuffle draws from the global torch RNG, as TRL's (see posttrain.rollout.buffer)
        self.buffer = RolloutBuffer(args.steps_per_generation, args.num_iterations, seed=None)
        self._last_synced_step = -1
        self._pending_completions = None

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
            raise ValueError(f"{self._trainer_name}Trainer needs a train_dataset with a 'prompt' column.")
        if isinstance(environment_factory, dict):
            raise ValueError(
                "train_dataset is required with a dict environment_factory: every row needs an 'environment' "
                "column naming its environment."
            )
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError(
                "Without a train_dataset (the environment provides the task) set max_steps to a positive number."
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
            return get_backend(f"vllm_{args.vllm_mode}", model, self.processing_class, args=args)
        name = args.generation_backend
        if args.use_transformers_continuous_batching:
            warnings.warn(
                "use_transformers_continuous_batching: posttrain generates with the 'transformers' backend "
                "(model.generate) instead; set generation_backend='posttrain' for shared-prefix group sampling.",
                stacklevel=3,
            )
            name = "transformers"
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
            keep_completions=args.log_completions,
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
        return self.accelerator.prepare(loader)

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
        batch = self.pipeline.run(
            rows,
            mode=mode,
            device=self.accelerator.device,
            trainer_state=self.state,
            record_metric=self._record(mode),
        )
        if self.pipeline.last_completions is not None:
            self._pending_completions = self.pipeline.last_completions
        return batch

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
