"""``OnlineRLConfig``: the configuration fields GRPOConfig, RLOOConfig and the other online trainers share.

TRL's names and defaults for data, generation, vLLM, reference/KL, batch arithmetic and logging, plus posttrain's
``generation_backend``. It lives apart from the trainer base (``posttrain.trainers.online``, which re-exports it)
so that module stays within the design's size cap; ``OnlineRLConfig._resolve_batch_plan`` turns the batch fields
into the generation plan (``posttrain.rollout.sampler.resolve_generation_batch``), and a trainer without that
arithmetic (distillation) replaces it while keeping the shared checks of ``_check_online_options``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from transformers import TrainingArguments

from posttrain.rollout.sampler import check_eval_batch, resolve_generation_batch
from posttrain.trainers.base import PAD_TO_MULTIPLE_OF_HELP, BaseConfig

GENERATION_BACKENDS = ("posttrain", "transformers")


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
    keep_routing: bool = field(
        default=False,
        metadata={
            "help": "posttrain (not a TRL field): MoE routing replay for a mixture-of-experts policy (Qwen2-MoE, "
            "Qwen3-MoE, Mixtral, ...). The group sampler records each token's top-k experts per layer and every "
            "training-side forward (π_old, π_ref, the policy and its gradient-checkpoint recompute) routes each "
            "token to those experts, with gate weights recomputed from the current router logits over them (the "
            "router keeps its gradient; the load-balancing aux loss is unchanged). Removes the sampler-vs-trainer "
            "mismatch that different expert choices cause. Needs posttrain's group sampler: "
            "generation_backend='posttrain' in-process, or server mode against `posttrain serve` (its posttrain "
            "engine returns the routing; not vLLM, rollout_func or tool loops); an error for a dense model."
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
    keep_sampling_mask: bool = field(
        default=False,
        metadata={
            "help": "posttrain (issue 40): with top_k / top_p / min_p, the sampler records each token's kept support "
            "(at most 16 ids, else a logit threshold) and the trainer computes every log-prob (policy, old, "
            "reference), the entropy and the KL over that support, so the policy trained is the one that sampled "
            "(on-policy ratio exactly 1). Reported by the 'posttrain' backend and `posttrain serve`; tokens without "
            "it (vLLM, rollout_func, 'transformers') use the full softmax. False: TRL's full softmax."
        },
    )
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
    vllm_server_base_urls: list[str] | None = field(
        default=None,
        metadata={
            "help": "posttrain (not a TRL field): several generation servers for vllm_mode='server'. Each round's "
            "groups are split into one chunk per listed server (all completions of a group in one chunk), weights "
            "are pushed to every server, and a server that dies or stalls is dropped with a warning and its chunks "
            "re-issued to the others. Leave vllm_server_base_url unset when using it. None = one server."
        },
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port."})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait for the server at start-up, then ConnectionError."}
    )
    request_timeout: float | None = field(
        default=600.0,
        metadata={
            "help": "posttrain (server mode; TRL's AsyncGRPO name): seconds one generation request or one weight-push "
            "request to the server may take, retries of 429/503 answers and reset connections included; then "
            "ServerTimeoutError naming the server, the request and the wait. None = no limit."
        },
    )
    vllm_server_health_check_interval: float | None = field(
        default=10.0,
        metadata={
            "help": "posttrain (server mode): once a request has been in flight this many seconds, probe the "
            "server's /health every this many seconds; a probe without answer (server stopped, frozen or cut off) "
            "ends the request with ServerTimeoutError well before request_timeout. None = no probe."
        },
    )
    vllm_group_port: int = field(default=51216, metadata={"help": "Port of the weight-update group."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "Colocate: GPU memory fraction."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "Colocate: context window."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "Colocate: tensor parallel size."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Colocate: sleep between rollouts."})
    vllm_weight_sync_probe: bool = field(
        default=False,
        metadata={
            "help": "Server mode: after every weight push, sample a few fixed-prompt tokens on the server and compare "
            "their log-probs with the trainer's; a difference above vllm_weight_sync_probe_atol raises "
            "WeightSyncError (the server is not serving the pushed weights). Costs one short request and forward."
        },
    )
    vllm_weight_sync_probe_atol: float = field(
        default=0.02,
        metadata={"help": "Largest |server - trainer| log-prob difference the probe accepts (raise it for a bf16 server)."},
    )
    vllm_sync_adapter_only: bool = field(
        default=False,
        metadata={
            "help": "posttrain (server mode, PEFT LoRA policy): push only the LoRA adapter tensors and config (MBs "
            "instead of the whole model) on every weight sync; a `posttrain serve` server (posttrain engine) applies "
            "them to its base with PEFT. Against vLLM / `trl vllm-serve` the merged weights are pushed instead "
            "(with a warning). Off by default: the merged push works with every server and adapter type."
        },
    )
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
        if self.keep_sampling_mask and not (self.top_k or self.top_p < 1.0 or self.min_p is not None):
            warnings.warn(
                "keep_sampling_mask=True has no effect without top_k, top_p < 1 or min_p: nothing is truncated, so "
                "the sampling support is the full vocabulary.",
                UserWarning,
                stacklevel=3,
            )
        if self.generation_backend not in GENERATION_BACKENDS:
            raise ValueError(
                f"Unknown generation_backend {self.generation_backend!r}. Valid values: "
                f"{', '.join(GENERATION_BACKENDS)} (use use_vllm=True for vLLM)."
            )
        if self.keep_routing and (
            (self.use_vllm and self.vllm_mode != "server") or (not self.use_vllm and self.generation_backend != "posttrain")
        ):
            raise ValueError(
                "keep_routing=True records the MoE routing in posttrain's group sampler: generate in-process with "
                "generation_backend='posttrain' (use_vllm=False), or through a `posttrain serve` server "
                "(use_vllm=True, vllm_mode='server'); vLLM in colocate mode does not return it. Or set "
                "keep_routing=False."
            )
        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {self.vllm_mode!r}.")
        if self.auto_find_batch_size:
            raise ValueError(self._AUTO_BATCH_SIZE_ERROR.format(name=self._trainer_name))
        for name in ("request_timeout", "vllm_server_health_check_interval"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds (or None for no limit), got {value}.")
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
