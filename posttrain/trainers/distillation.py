"""DistillationTrainer / DistillationConfig: on-policy knowledge distillation with TRL's API.

Generalized Knowledge Distillation (GKD; Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes", https://huggingface.co/papers/2306.13649) on the shared online-RL machinery
(``trainers/online.py``): the same prompt sampler, generation backends, rollout buffer, step metrics, completions
log and checkpoint/resume handling as GRPO and RLOO. What distillation changes:

- the round (``rollout.distillation.DistillationRollout``): each gradient-accumulation slice is on-policy with probability
  ``lmbda`` (student samples from the generation backend); the others use the dataset's completions, or teacher
  samples with ``seq_kd`` (sequence-level KD). With prompt-only data everything is on-policy. No rewards, no
  advantages, no reference model;
- the loss: the generalized Jensen–Shannon divergence between the student's and the teacher's next-token
  distributions at every completion token (β = 0 forward KL, β = 1 reverse KL, logits divided by ``temperature``),
  computed from last hidden states in chunks of tokens (``core.distill.chunked_generalized_jsd``) so that neither
  model's ``(B, T, V)`` logits are built; summed over tokens and divided by the number of completion tokens of the
  whole optimizer step over all processes (TRL's normalisation, so gradient accumulation and data parallelism
  leave the loss unchanged).

Metrics (TRL's names): ``loss`` (the divergence per token), ``distillation_loss`` (the same per micro-batch),
``entropy`` (student, at the completion tokens), ``completions/*`` (sampled completions), ``num_tokens``,
``step_time``; ``aux_loss`` for MoE students; ``timing/*`` (the round's stages, ``rollout.distillation.STAGES``).

Deliberate differences from TRL: heads of different sizes that both cover the tokenizer are accepted (see
``models/vocabulary.py``); evaluation scores student samples when ``lmbda > 0`` and dataset (or, with ``seq_kd``, teacher)
completions when ``lmbda = 0``; teacher-server / top-k losses live in ``posttrain.experimental.server_distillation``;
Liger and VLMs are not supported. ``tools=`` (with ``max_tool_calling_iterations``) runs on-policy samples through
the agents' tool loop as GRPO does: tool-result tokens stay in both models' context but carry no loss.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from posttrain.distributed import gather_masked_mean, sum_over_processes
from posttrain.models.completion_scoring import choose_shared_prompt_layout, completion_inputs
from posttrain.models.distillation_scoring import score_distillation_completions, token_divergence
from posttrain.models.loading import (
    create_model_from_path,
    load_processing_class,
)
from posttrain.models.reference import ReferencePolicy
from posttrain.models.vocabulary import check_shared_vocabulary, model_vocab_size
from posttrain.reliability.validation import check_datasets
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.distillation import DistillationRollout
from posttrain.trainers.online import OnlineRLConfig, OnlineTrainerBase

# OnlineRLConfig fields that belong to GRPO/RLOO's policy-gradient loss: setting them here would silently do nothing.
_POLICY_GRADIENT_FIELDS = (
    "reward_weights",
    "epsilon",
    "epsilon_high",
    "sync_ref_model",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
)


@dataclass
class DistillationConfig(OnlineRLConfig):
    """Configuration of :class:`DistillationTrainer`: TRL's ``DistillationConfig`` fields and defaults (plus GKD's
    ``lmbda`` and ``seq_kd``).

    The generation fields (``use_vllm``/``vllm_*``, ``generation_backend``, ``generation_kwargs``, ``min_p``,
    ``repetition_penalty``, ``chat_template_kwargs``), ``num_iterations``, ``mask_truncated_completions`` and the
    logging fields are the shared online-RL ones (``OnlineRLConfig``). ``generation_batch_size`` keeps TRL's
    distillation meaning (unique prompts per process per optimizer step) and ``steps_per_generation`` is always
    ``gradient_accumulation_steps``: one generation round per optimizer step.
    """

    # -- model -----------------------------------------------------------------------------------------------------
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum prompt + completion tokens; prompts are cut to leave room."}
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Maximum prompt tokens (cut on the tokenizer's truncation side, left by default). None: "
            "max_length - max_completion_length."
        },
    )
    disable_dropout: bool = field(default=False, metadata={"help": "Disable dropout in the student."})
    # -- distillation ------------------------------------------------------------------------------------------------
    temperature: float = field(
        default=1.0,
        metadata={"help": "Sampling temperature, also dividing both models' logits in the loss."},
    )
    lmbda: float = field(
        default=1.0,
        metadata={
            "help": "Probability that a gradient-accumulation slice is on-policy (student samples). 0.0 = dataset "
            "completions only (supervised KD), 1.0 = fully on-policy. Prompt-only data is always on-policy."
        },
    )
    beta: float = field(
        default=1.0,
        metadata={
            "help": "Generalized JSD interpolation: 0.0 = forward KL(teacher||student), 0.5 = JSD, 1.0 = reverse "
            "KL(student||teacher)."
        },
    )
    seq_kd: bool = field(
        default=False,
        metadata={
            "help": "Sequence-level KD: off-policy slices use completions sampled from the teacher instead of the "
            "dataset's (GKD's seq_kd)."
        },
    )
    # -- teacher -----------------------------------------------------------------------------------------------------
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Teacher hub id or local path (used when no teacher_model is passed)."}
    )
    teacher_model_revision: str | None = field(
        default=None, metadata={"help": "Revision of the teacher model (branch, tag or commit)."}
    )
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for the teacher's `from_pretrained` (JSON string allowed)."},
    )
    # -- generation --------------------------------------------------------------------------------------------------
    num_generations: int | None = field(
        default=1, metadata={"help": "Completions sampled per prompt on on-policy slices."}
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Unique prompts per process per optimizer step. None: per_device_train_batch_size × "
            "gradient_accumulation_steps / num_generations (the only valid value)."
        },
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass for on-policy generation; 1.0 = off."})
    top_k: int = field(default=0, metadata={"help": "Top-k filtering for on-policy generation; 0 = off."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Host of the student vLLM server."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Port of the student vLLM server."})
    vllm_sync_frequency: int = field(
        default=1, metadata={"help": "Optimizer steps between weight syncs to the generation backend."}
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Most rounds of tool calls per on-policy completion (with tools=); None = until the budget is "
            "spent."
        },
    )
    # -- logging -----------------------------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "Every `log_completions_steps` steps, print a sample of (prompt, completion, source) with rich "
            "and write output_dir/completions/completions_{step:05d}.parquet."
        },
    )
    log_completions_steps: int = field(
        default=100, metadata={"help": "Steps between completion logs (only with log_completions)."}
    )

    _trainer_name = "Distillation"
    _VALID_DICT_FIELDS = [*OnlineRLConfig._VALID_DICT_FIELDS, "teacher_model_init_kwargs"]
    _AUTO_BATCH_SIZE_ERROR = (
        "auto_find_batch_size=True is not supported by {name}: the generation round is tied to the batch size. "
        "Set per_device_train_batch_size explicitly."
    )

    def __post_init__(self):
        for name in _POLICY_GRADIENT_FIELDS:
            default = next(f.default for f in dataclasses.fields(OnlineRLConfig) if f.name == name)
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is a GRPO/RLOO option with no effect on distillation; remove it."
                )
        super().__post_init__()  # TrainingArguments, the shared online checks, then _resolve_batch_plan below

    def _resolve_batch_plan(self) -> None:
        """TRL's distillation rules, not GRPO's: ``num_generations >= 1``, ``generation_batch_size`` in prompts."""
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"lmbda must be in [0.0, 1.0], got {self.lmbda}.")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be a positive integer, got {self.max_completion_length}.")
        if self.max_length is not None and self.max_completion_length >= self.max_length:
            raise ValueError(
                f"max_completion_length ({self.max_completion_length}) must be smaller than max_length "
                f"({self.max_length}) to leave room for the prompt."
            )
        if self.max_prompt_length is None and self.max_length is not None:
            self.max_prompt_length = self.max_length - self.max_completion_length
        if self.num_generations is None or self.num_generations < 1:
            raise ValueError(f"num_generations must be at least 1, got {self.num_generations}.")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}.")
        for name in ("vllm_sync_frequency", "log_completions_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        local_rows = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.generation_batch_size is None:
            self.generation_batch_size = local_rows // self.num_generations
        if self.generation_batch_size < 1:
            raise ValueError(f"generation_batch_size must be at least 1, got {self.generation_batch_size}.")
        if self.generation_batch_size * self.num_generations != local_rows:
            raise ValueError(
                "generation_batch_size * num_generations must equal per_device_train_batch_size * "
                f"gradient_accumulation_steps. Got {self.generation_batch_size} * {self.num_generations} != "
                f"{self.per_device_train_batch_size} * {self.gradient_accumulation_steps}."
            )
        if self.steps_per_generation not in (None, self.gradient_accumulation_steps):
            raise ValueError(
                f"steps_per_generation={self.steps_per_generation}: distillation generates once per optimizer step "
                "(steps_per_generation = gradient_accumulation_steps); remove it."
            )
        self.steps_per_generation = self.gradient_accumulation_steps
        if self.num_generations > 1 and self.lmbda < 1.0:
            warnings.warn(
                f"num_generations={self.num_generations} with lmbda={self.lmbda} means off-policy batches include "
                f"{self.num_generations} copies of each sample. Consider lmbda=1.0 when num_generations > 1.",
                UserWarning,
                stacklevel=4,
            )


def distillation_scoring_inputs(model: torch.nn.Module, inputs: RolloutBatch, shared_prompt_forward: bool) -> tuple:
    """``score_distillation_completions`` arguments for ``model``: the shared-prompt layout when it saves work for
    this model (``shared_prompt_forward``; each distinct prompt encoded once), else ``[prompt | completion]`` rows.
    Both give the loss tokens in the same order, so student and teacher may differ in which one they use."""
    targets = (inputs["completion_ids"], inputs["completion_mask"])
    layout = choose_shared_prompt_layout(model, inputs) if shared_prompt_forward else None
    if layout is not None:
        predictors = layout.predictor_index(inputs["completion_mask"])
        return layout.input_ids, layout.attention_mask, layout.position_ids, *targets, predictors
    input_ids, attention_mask, position_ids, _ = completion_inputs(inputs)
    return input_ids, attention_mask, position_ids, *targets


def loss_chunk_size_for(vocab_rows: int, configured: int | None = None) -> int:
    """Tokens per chunk of a chunked divergence / log-prob pass: ``configured`` when set, else about 2**24 logits
    (64 MiB in float32) per chunk, between 16 and 1024 tokens (see ``DistillationTrainer._loss_chunk_size``)."""
    if configured is not None:
        return int(configured)
    return min(1024, max(16, 2**24 // vocab_rows))


class DistillationLoss(Protocol):
    """A distillation trainer's loss strategy: ``loss(trainer, model, inputs) -> scalar`` for one micro-batch.

    ``DistillationTrainer._compute_loss`` is the one ``_compute_loss`` of every distillation trainer; what differs
    between them (the exact full-vocabulary divergence here; the sparse / IW-OPD / served-teacher supports and ULD
    of the experimental trainers) is the strategy in their ``loss_strategy``. A strategy reads the trainer's
    helpers (``_scoring_inputs``, ``_token_normaliser``, ``_record_token_means``, ``_loss_chunk_size``,
    ``_finish_loss``) and keeps no state of its own, so one instance may serve every trainer of a class.
    """

    def __call__(self, trainer: DistillationTrainer, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor: ...


class FullVocabularyDivergence:
    """The exact generalized JSD over the shared vocabulary against a local teacher (TRL's DistillationTrainer)."""

    def __call__(self, trainer: DistillationTrainer, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        """Σ_tokens D_β(p_S‖p_T) / (completion tokens of the optimizer step over all processes / processes).

        In evaluation the divisor is the micro-batch's own token count (the mean divergence per token).
        """
        args = trainer.args
        mode = trainer._mode()
        student = score_distillation_completions(model, *trainer._scoring_inputs(model, inputs))
        with torch.no_grad():
            teacher = score_distillation_completions(
                trainer.teacher_model, *trainer._scoring_inputs(trainer.teacher_model, inputs)
            )
        divergence, entropy = token_divergence(
            student,
            teacher,
            vocab_rows=trainer.vocab_rows,
            beta=args.beta,
            temperature=trainer._loss_temperature(),
            chunk_size=trainer._loss_chunk_size(),
        )  # (N,) each
        # DDP averages gradients (and evaluation averages losses) over processes: dividing by the per-process share
        # of the global token count makes them those of the global token mean (TRL's num_items_in_batch rule).
        loss = divergence.sum() / trainer._token_normaliser(inputs, divergence, mode).clamp(min=1.0)
        if divergence.numel() == 0:
            # Every token masked (e.g. mask_truncated_completions): a zero loss that still reaches every parameter,
            # so backward and DDP's gradient hooks run as usual.
            loss = loss + 0.0 * sum(p.sum() for p in model.parameters() if p.requires_grad)
        loss = trainer._finish_loss(loss, student.aux_loss, divide_by_grad_accum=False)  # normalised over the step
        trainer._record_token_means(mode, distillation_loss=divergence, entropy=entropy)
        return loss


class DistillationTrainer(OnlineTrainerBase):
    """On-policy distillation of a teacher into a student with TRL's constructor, config and metrics.

    Args:
        model: The student: hub id / local path (loaded with ``args.model_init_kwargs``, float32 by default), a
            ``PreTrainedModel`` causal LM, or a ``PeftModel``.
        teacher_model: The teacher: hub id / local path (loaded with ``args.teacher_model_init_kwargs`` at
            ``args.teacher_model_revision``) or a model; None → ``args.teacher_model_name_or_path``. It is frozen and
            kept in eval mode, may be larger than the student, and must share its tokenizer vocabulary.
        args: :class:`DistillationConfig`; None → defaults with ``output_dir=f"{model_name}-Distillation"``.
        data_collator: Not supported (the rollout builds the batches); must be None.
        train_dataset: Prompt-only (``"prompt"``) or prompt-completion (``"prompt"``, ``"completion"``) rows, text
            or messages, or GKD's conversational ``"messages"`` (the last assistant turn is the completion).
            Completions are used by off-policy slices (``lmbda < 1``).
        eval_dataset: Same format.
        processing_class: The student's tokenizer (left padding and truncation are set); None → loaded from it.
        compute_metrics / preprocess_logits_for_metrics: Not supported (no logits are returned); must be None.
        callbacks / optimizers: As ``transformers.Trainer``.
        quantization_config: A ``transformers`` quantization config used when the student is a string.
        peft_config: Wraps the student (LoRA). A LoRA on ``lm_head`` works but uses the full-logits path.
        tools: Python functions the student may call during on-policy generation (conversational prompts; the chat
            template must render tools). Tool results are masked out of the loss.
    """

    config_class = DistillationConfig
    _trainer_name = "Distillation"
    _tag_names = ["posttrain", "distillation"]
    # How dataset rows are cut (DistillationRollout's dataset_truncation): each TRL trainer's collator rule
    dataset_truncation = "completion_budget"
    # Tokens per chunk of the divergence (None: chosen from the vocabulary, see `_loss_chunk_size`).
    loss_chunk_size: int | None = None
    # The per-micro-batch loss (a stateless DistillationLoss; the experimental trainers set their own).
    loss_strategy: DistillationLoss = FullVocabularyDivergence()

    def __init__(
        self,
        model: str | torch.nn.Module,
        teacher_model: str | torch.nn.Module | None = None,
        args: DistillationConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list | None = None,
        data_collator: Any = None,
        compute_metrics: Any = None,
        preprocess_logits_for_metrics: Any = None,
    ):
        for name, value in (
            ("data_collator", data_collator),
            ("compute_metrics", compute_metrics),
            ("preprocess_logits_for_metrics", preprocess_logits_for_metrics),
        ):
            if value is not None:
                raise ValueError(
                    f"DistillationTrainer does not support {name}: batches are built by the rollout (prompts, "
                    "generated or dataset completions) and no logits are returned. Pass None."
                )
        if isinstance(teacher_model, torch.nn.Module) and teacher_model is model:
            raise ValueError("teacher_model is the student model itself; pass a separate (frozen) teacher.")
        args = self.resolve_args(args, model, self.config_class, self._trainer_name)
        check_datasets(train_dataset, eval_dataset)
        if train_dataset is None:
            raise ValueError("DistillationTrainer needs a train_dataset with a 'prompt' column.")
        model, processing_class = self._setup_policy(model, args, processing_class, peft_config, quantization_config)
        teacher, teacher_tokenizer = self._load_teacher(teacher_model, args)  # (None, None): a served teacher
        self.vocab_rows = self._check_vocabulary(processing_class, teacher_tokenizer, model, teacher)
        n_rows = self._configure_train_dataset(train_dataset, args)
        # GKD trains a dataset smaller than one optimizer step as one short step (TRL's plain dataloader)
        if (
            n_rows is not None
            and n_rows < args.generation_batch_size * args.world_size
            and not (self._round_per_window(args) and args.num_iterations == 1)
        ):
            raise ValueError(
                f"train_dataset has {n_rows} prompts but one optimizer step needs generation_batch_size "
                f"× processes = {args.generation_batch_size} × {args.world_size}; add prompts or lower "
                "per_device_train_batch_size / gradient_accumulation_steps."
            )
        columns = getattr(train_dataset, "column_names", None) or []
        if args.lmbda < 1.0 and not args.seq_kd and columns and not {"completion", "messages"} & set(columns):
            warnings.warn(
                f"lmbda={args.lmbda} but train_dataset has no 'completion' (or 'messages') column: with prompt-only "
                "data every batch is on-policy. Add completions, or set seq_kd=True to distil on teacher samples.",
                UserWarning,
                stacklevel=2,
            )
        # The shared construction steps, without rewards or a reference policy (distillation has neither).
        # Tools (agent training): on-policy samples run the tool loop; tool-result tokens are context, not loss.
        self.agent = self._make_agent(tools, None, None, processing_class, model, args)
        self.reward_funcs = []
        self.reference = ReferencePolicy("none")
        self._init_trainer(model, args, train_dataset, eval_dataset, processing_class, callbacks, optimizers)
        self.teacher_model = None
        if teacher is not None:
            placed = ReferencePolicy("model", model=teacher)
            placed.prepare(self.accelerator)  # device, or a DeepSpeed/FSDP inference engine
            self.teacher_model = placed.model
        self._setup_rollout(None)

    def _make_rollout(self) -> None:
        """``self.rollout``: slices of student samples and dataset (or, with ``seq_kd``, teacher) completions."""
        args = self.args
        teacher_backend = None
        if args.seq_kd:
            from posttrain.generation.registry import get_backend

            # The teacher samples in-process (it is frozen: nothing to sync); vLLM serves only the student.
            name = "transformers" if args.generation_backend == "transformers" else "posttrain"
            if self.sampling.generation_kwargs:  # options of model.generate only, as for the student
                name = "transformers"
            teacher_backend = get_backend(name, self.teacher_model, self.processing_class, return_logprobs=False)
        self.rollout = DistillationRollout(
            tokenizer=self.processing_class,
            student_backend=self.backend,
            teacher_backend=teacher_backend,
            sampling=self.sampling,
            num_generations=args.num_generations,
            lmbda=args.lmbda,
            seq_kd=args.seq_kd,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            dataset_truncation=self.dataset_truncation if args.max_length is not None else "completion_budget",
            max_length=args.max_length,
            pad_to_multiple_of=args.pad_to_multiple_of,
            mask_truncated_completions=args.mask_truncated_completions,
            chat_template_kwargs=args.chat_template_kwargs,
            keep_completions=args.log_completions,
            seed=args.seed,
            accelerator=self.accelerator,
            agent=self.agent,
        )

    # -- construction helpers ----------------------------------------------------------------------------------
    def _uses_teacher_server(self, args: DistillationConfig) -> bool:
        """Whether the teacher is served (no local teacher is loaded; the loss strategy asks the server). Always
        False here; the experimental served-teacher trainers say when theirs is."""
        return False

    def _load_teacher(self, teacher_model: Any, args: DistillationConfig) -> tuple[torch.nn.Module | None, Any]:
        """The frozen, eval-mode teacher and its tokenizer (None when it has none to load); ``(None, None)`` for a
        served teacher (``_uses_teacher_server``)."""
        if self._uses_teacher_server(args):
            if teacher_model is not None:
                raise ValueError(
                    "teacher_model was passed but the teacher is served at teacher_model_server_url; pass one or the "
                    "other."
                )
            return None, None
        if teacher_model is None:
            teacher_model = args.teacher_model_name_or_path
        if teacher_model is None:
            raise ValueError(
                "DistillationTrainer needs a teacher: pass teacher_model= (hub id, local path or model) or set "
                "teacher_model_name_or_path in DistillationConfig."
            )
        init_kwargs = dict(args.teacher_model_init_kwargs or {})
        if isinstance(teacher_model, str):
            if args.trust_remote_code:
                init_kwargs.setdefault("trust_remote_code", True)
            if args.teacher_model_revision is not None:
                init_kwargs.setdefault("revision", args.teacher_model_revision)
            source = teacher_model
            teacher_model = create_model_from_path(teacher_model, **init_kwargs)
        else:
            if init_kwargs:
                raise ValueError(
                    "You passed teacher_model_init_kwargs to the config, but your teacher_model is already "
                    "instantiated. Pass the teacher as a hub id / path, or drop teacher_model_init_kwargs."
                )
            source = getattr(getattr(teacher_model, "config", None), "_name_or_path", None)
        for param in teacher_model.parameters():
            param.requires_grad_(False)
        teacher_model.eval()
        tokenizer = None
        if source and (not os.path.isdir(source) or _has_tokenizer_files(source)):
            try:  # only to compare vocabularies: a teacher saved without its tokenizer is checked by size
                tokenizer = load_processing_class(source)
            except (OSError, ValueError):
                tokenizer = None
        return teacher_model, tokenizer

    @staticmethod
    def _check_vocabulary(tokenizer: Any, teacher_tokenizer: Any, model: Any, teacher: Any) -> int:
        """Rows of both LM heads the divergence compares (the shared tokenizer vocabulary; a served teacher is
        checked against the student's own size)."""
        return check_shared_vocabulary(
            tokenizer,
            teacher_tokenizer,
            model_vocab_size(model),
            model_vocab_size(teacher if teacher is not None else model),
        )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = [
                "prompt", "completion", "messages", "tools", "chat_template_kwargs", "image", "images",
            ]  # fmt: skip

    # -- data path: TRL's distillation batch arithmetic (the sampler and dataloader are the base's) --------------------------------------------------------
    def _prompts_per_round(self) -> int:
        """Unique prompts per generation round over all processes (``generation_batch_size`` is per process)."""
        return self.args.generation_batch_size * self.accelerator.num_processes

    def _generate_and_score(self, rows: list[dict[str, Any]], mode: str) -> RolloutBatch:
        """Build one round (see ``DistillationRollout``): slices of student samples / dataset or teacher completions."""
        step = self.state.global_step
        if step != self._last_synced_step and step % self.args.vllm_sync_frequency == 0:
            self.backend.sync_weights(self.accelerator.unwrap_model(self.model))
            self._last_synced_step = step
        # GKD's rounds (an epoch's short last one included): one slice per per_device_train_batch_size micro-batch
        per_window = mode == "train" and self._round_per_window()
        batch = self.rollout.run(
            rows,
            num_slices=self.args.steps_per_generation if mode == "train" else 1,
            mode=mode,
            device=self.accelerator.device,
            record=self._record(mode),
            slice_size=self.args.per_device_train_batch_size if per_window else None,
        )
        if self.rollout.last_completions is not None:
            self._pending_completions = self.rollout.last_completions
        return batch

    # -- loss --------------------------------------------------------------------------------------------------
    def _scoring_inputs(self, model: torch.nn.Module, inputs: RolloutBatch) -> tuple:
        """``score_distillation_completions`` arguments for ``model`` (:func:`distillation_scoring_inputs`)."""
        return distillation_scoring_inputs(model, inputs, self.args.shared_prompt_forward)

    def _compute_loss(self, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        """The micro-batch's loss: ``self.loss_strategy(self, model, inputs)`` (see :class:`DistillationLoss`)."""
        return self.loss_strategy(self, model, inputs)

    def _loss_temperature(self) -> float:
        """Divides both models' logits in the divergence: the sampling ``temperature`` (TRL's DistillationTrainer)."""
        return self.args.temperature

    def _token_normaliser(self, inputs: RolloutBatch, per_token: torch.Tensor, mode: str) -> torch.Tensor:
        """The loss divisor: the step's (training) or this micro-batch's (evaluation) loss tokens over every
        process, divided by the process count."""
        if mode == "train":
            return inputs["num_items_in_batch"].to(per_token) / self.accelerator.num_processes
        n_tokens = per_token.new_tensor(float(per_token.numel())).reshape(1)
        return sum_over_processes(self.accelerator, n_tokens).reshape(()) / self.accelerator.num_processes

    def _record_token_means(self, mode: str, **per_token: torch.Tensor) -> None:
        """Record each ``(N,)`` per-token tensor's mean over every process's tokens (NaN when none anywhere)."""
        for name, values in per_token.items():
            values = values.detach().float()
            self.record_metric(name, gather_masked_mean(self.accelerator, values, torch.ones_like(values)), mode=mode)

    def _loss_chunk_size(self) -> int:
        """Tokens per chunk: about 2**24 logits (64 MiB in float32) per chunk, between 16 and 1024 tokens.

        The divergence keeps roughly eight chunk × V float32 temporaries alive (both log-softmaxes, the mixture,
        the KL terms), so a fixed budget per chunk bounds its peak memory at ~0.5 GiB whatever the batch size,
        sequence length or vocabulary (152k-row vocabularies: ~110 tokens per chunk).
        """
        return loss_chunk_size_for(self.vocab_rows, self.loss_chunk_size)

    # -- logging and checkpoints -------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        step = self.state.global_step
        if step == 0 or step % self.args.log_completions_steps != 0:
            self._pending_completions = None  # print/write the table only every log_completions_steps steps
        super().log(logs, start_time)

    def resume_state_dict(self) -> dict[str, Any]:
        """Adds the slice-draw RNG of the rollout (which slices are on-policy)."""
        return {**super().resume_state_dict(), "distillation_rollout": self.rollout.state_dict()}

    def load_resume_state_dict(self, state: dict[str, Any]) -> None:
        super().load_resume_state_dict(state)
        if "distillation_rollout" in state:
            self.rollout.load_state_dict(state["distillation_rollout"])


def _has_tokenizer_files(folder: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    return any(os.path.isfile(os.path.join(folder, name)) for name in names)
