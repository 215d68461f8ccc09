"""What every posttrain trainer shares: TRL's config defaults, metric accumulation, model resolution, atomic saves.

``BaseConfig`` overrides ``transformers.TrainingArguments`` defaults the way TRL's configs do (``logging_steps=10``,
``gradient_checkpointing=True``, ``bf16`` resolved automatically). One deliberate difference: TRL resolves
``bf16=None`` to ``True`` everywhere; posttrain resolves it to ``True`` only where the accelerator supports bf16
(a CUDA GPU with bf16), so the first run on a laptop CPU trains in float32 instead of slow emulated bf16.

``BaseTrainer`` turns the user's ``args`` into the trainer's config (``resolve_args``: None → TRL's default
``{model_name}-{SUFFIX}`` output folder, a plain ``TrainingArguments`` → converted), accumulates per-step metrics in
``self._metrics[mode]`` and averages them (ignoring NaN) at each ``log()``, with ``eval_`` prefixes in evaluation,
and writes saved models atomically. It also carries the reliability layer every trainer inherits (helpers in
``posttrain.reliability``):

- crash-safe checkpoints: each ``checkpoint-N`` is staged in ``tmp-checkpoint-N`` and renamed into place only when
  complete; ``resume_from_checkpoint=True`` finds the newest complete one; rotation never deletes the newest;
- exact resume: besides HF's model/optimizer/scheduler/RNG/data position, each process saves
  ``posttrain_state_{process}.pt`` from ``resume_state_dict()``, which trainers extend with their own state;
- the numerics guard (``nan_policy``): a NaN/inf loss or gradient norm skips the step (default: training goes on as
  with TRL, weights stay finite) and counts it in ``numerics/skipped_steps``, or stops training with a report of the
  step and the batch (``"stop"``);
- generic up-front checks at ``train()``: writable output_dir, non-empty train dataset, batch arithmetic, a
  tokenizer that can pad, a valid checkpoint to resume from.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from posttrain.legacy import LegacyConfigAttributes, LegacyKwargsMeta
from posttrain.models.loading import model_name
from posttrain.reliability import checkpointing, validation
from posttrain.reliability.numerics import NAN_POLICIES, NumericsGuard

RESUME_STATE_FILE = "posttrain_state_{process_index}.pt"
MAX_CACHED_EVAL_DATASETS = 16  # evaluate(eval_dataset=...) keeps this many prepared datasets (oldest dropped first)


def _bf16_supported() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


PAD_TO_MULTIPLE_OF_HELP = (
    "Pad each batch's length up to a multiple of this. 'auto' (TRL's default): 128 on AWS Neuron (Trainium), which "
    "compiles once per input shape, no padding elsewhere."
)


def resolve_pad_to_multiple_of(value: int | str | None) -> int | None:
    """TRL's ``pad_to_multiple_of``: ``"auto"`` → 128 on AWS Neuron (one compilation per shape), else None; the
    strings ``"none"``/``"null"`` → None; a number given as a string (the command line) → that int."""
    if not isinstance(value, str):
        return value
    if value == "auto":
        import importlib.util

        return 128 if importlib.util.find_spec("torch_neuronx") is not None else None
    if value.lower() in ("none", "null", ""):
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"pad_to_multiple_of must be a positive int, 'auto' or None, got {value!r}.") from None
    if number < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int, 'auto' or None, got {value!r}.")
    return number


@dataclass
class BaseConfig(LegacyConfigAttributes, TrainingArguments, metaclass=LegacyKwargsMeta):
    """TrainingArguments with TRL's shared overrides. Subclasses set their own ``learning_rate`` default.

    Keys older TRL / transformers releases used (``max_seq_length``, ``warmup_ratio``, ``use_liger``,
    ``overwrite_output_dir``, ``max_prompt_length``) are mapped by :mod:`posttrain.legacy` with a ``FutureWarning``.
    """

    logging_steps: float = field(
        default=10,
        metadata={"help": "Log every X update steps (int), or a ratio of total training steps if in [0, 1)."},
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={"help": "Recompute activations in backward to save memory at the cost of a slower step."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Train in bfloat16 mixed precision. None: on where the accelerator supports bf16 (CUDA with "
            "bf16), off on CPU."
        },
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string (JSON string allowed)."},
    )

    write_report: bool | None = field(
        default=None,
        metadata={
            "help": "posttrain only: write PNG plots and report/index.html into output_dir when training ends. None: "
            "on, unless the environment variable POSTTRAIN_NO_REPORT=1 is set."
        },
    )

    nan_policy: str | None = field(
        default=None,
        metadata={
            "help": "posttrain only: what to do when a loss or the gradient norm is NaN/inf. 'skip': drop that "
            "optimizer step (no parameter update; the LR schedule still advances), warn, and count it in "
            "`numerics/skipped_steps`, so training goes on as with TRL but the weights stay finite. 'stop': raise "
            "an error naming the step and the batch (saved under output_dir/numerics). None (default): 'skip', or "
            "'stop' under DeepSpeed (its engine owns the optimizer step).",
            "choices": list(NAN_POLICIES),
        },
    )

    def __post_init__(self):
        # TRL's (and our) name is `gradient_checkpointing`; transformers 5 renamed it `activation_checkpointing` and
        # warns on every config built with the old name. Map it ourselves unless the new name was set explicitly.
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if getattr(self, new, None) is None and getattr(self, old, None) is not None:
                setattr(self, new, getattr(self, old))
        if self.nan_policy is not None and self.nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy={self.nan_policy!r} is not valid; use one of {list(NAN_POLICIES)}.")
        if isinstance(getattr(self, "pad_to_multiple_of", None), str):
            self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _accelerator_available():
            # torchrun on a CPU-only machine: without use_cpu, HF/accelerate set up no DDP (MULTI_CPU needs it) and
            # every process would silently train its own copy of the model on the full batch.
            self.use_cpu = True
        if self.write_report is None:
            self.write_report = os.environ.get("POSTTRAIN_NO_REPORT", "0") in ("0", "", "false", "False")
        if self.bf16 is None:
            self.bf16 = (not self.fp16) and _bf16_supported()
        if isinstance(self.model_init_kwargs, str):
            import json

            try:
                self.model_init_kwargs = json.loads(self.model_init_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"model_init_kwargs must be a dict or a JSON object string, got {self.model_init_kwargs!r}."
                ) from err
        super().__post_init__()


class ConfigAttribute:
    """A trainer attribute that TRL copies from the config in its constructor (``self.beta = args.beta``), which
    subclasses written for TRL read (e.g. the DPO customization guide's ``self.beta``).

    posttrain reads its settings from ``self.args``, so this attribute reads the config field (optionally
    transformed, e.g. ``epsilon_low`` from ``epsilon``) and assigning it sets that field, so that a subclass's
    ``self.beta = 0.2`` takes effect wherever posttrain reads ``args.beta``."""

    def __init__(self, field: str | None = None, read: Any = None, *, writable: bool = True):
        self.field = field
        self.read = read  # (trainer, value) -> what TRL's attribute holds; None: the value itself
        self.writable = writable  # False: derived from the field (assigning would not mean the same)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.field = self.field or name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        args = trainer.__dict__.get("args")
        if args is None:  # before HF's constructor has set args
            raise AttributeError(
                f"{owner.__name__ if owner else 'trainer'}.{self.name} is read from args, not set yet"
            )
        value = getattr(args, self.field)
        return value if self.read is None else self.read(trainer, value)

    def __set__(self, trainer: Any, value: Any) -> None:
        args = trainer.__dict__.get("args")
        if args is None or not self.writable:
            raise AttributeError(
                f"{type(trainer).__name__}.{self.name} is read from the config field args.{self.field}; set that "
                "field instead."
            )
        setattr(args, self.field, value)


def router_aux_loss_coef_attribute(trainer: Any, value: float | None) -> float:
    """TRL's ``router_aux_loss_coef`` attribute: the config's value, or the model's own coefficient when None."""
    if value is not None:
        return value
    from posttrain.models.unwrap import unwrap_base_model

    config = getattr(unwrap_base_model(trainer.model), "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return float(getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0)


def nanmean_or_none(values: list[float]) -> float | None:
    """Average of the finite values (NaN ignored); None when nothing finite remains."""
    finite = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(finite) / len(finite) if finite else None


@contextlib.contextmanager
def _naming_corrupt_files(checkpoint: str | None, stage: str):
    """Re-raise a failure to read ``stage`` from ``checkpoint`` as a ``CorruptCheckpointError`` that names the damaged
    file and the previous checkpoint. Failures with intact files (e.g. a model that does not match the checkpoint)
    pass through unchanged."""
    try:
        yield
    except Exception as err:  # torch, safetensors, pickle and zip errors have no common base
        if checkpoint is None or isinstance(err, checkpointing.CorruptCheckpointError):
            raise
        if not checkpointing.damaged_files(checkpoint, stage):
            raise
        raise checkpointing.corrupt_checkpoint_error(checkpoint, stage, err) from err


class BaseTrainer(Trainer):
    """``transformers.Trainer`` plus what all posttrain trainers share: metric accumulation, atomic saves,
    crash-safe checkpoints with exact resume (``resume_state_dict`` hooks), the numerics guard and up-front checks.
    """

    _tag_names: list[str] = ["posttrain"]

    def __init__(self, *args, **kwargs):
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        # evaluate(eval_dataset=raw): id(raw) -> (raw, prepared); raw is kept so that its id cannot be reused
        self._prepared_eval_datasets: dict[int, tuple[Any, Any]] = {}
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and getattr(training_args, "should_save", True):
            # HF's __init__ creates output_dir; fail first with an error that names the option and the fix.
            validation.check_output_dir_writable(training_args.output_dir)
        super().__init__(*args, **kwargs)
        if hasattr(self.model, "add_model_tags"):  # TRL: the trainer's tags on the model (hub model card)
            self.model.add_model_tags(self._tag_names)
        nan_policy = getattr(self.args, "nan_policy", None)
        if nan_policy is None:  # training goes on past a non-finite step, as with TRL (the step itself is dropped)
            nan_policy = "stop" if self.is_deepspeed_enabled else "skip"
        if nan_policy == "skip" and self.is_deepspeed_enabled:
            raise ValueError(
                "nan_policy='skip' is not supported with DeepSpeed (its engine owns the gradients and the optimizer "
                "step); use nan_policy='stop'."
            )
        self._check_distributed_setup()
        self._numerics = NumericsGuard(
            nan_policy,
            dump_dir=os.path.join(self.args.output_dir, "numerics") if self.args.output_dir else None,
            process_index=self.args.process_index,
        )
        from posttrain.callbacks import MetricsLoggerCallback, ReportCallback

        self.add_callback(MetricsLoggerCallback())
        if getattr(self.args, "write_report", False):
            self.add_callback(ReportCallback(trainer_name=self._report_name()))

    @staticmethod
    def resolve_args(args: Any, model: Any, config_class: type[TrainingArguments], suffix: str) -> Any:
        """The trainer's config from what the user passed as ``args``.

        - an instance of ``config_class``: returned as is;
        - None: ``config_class(output_dir=f"{model_name}-{suffix}")`` (TRL's default output folder, e.g.
          ``Qwen2-0.5B-DPO``);
        - any other ``TrainingArguments`` (plain, or another trainer's config): converted, keeping the values of
          the fields ``config_class`` also has; the method's own fields take their defaults.

        Raises TypeError for anything else, naming ``config_class``.
        """
        if args is None:
            return config_class(output_dir=f"{model_name(model)}-{suffix}")
        if isinstance(args, config_class):
            return args
        if not isinstance(args, TrainingArguments):
            raise TypeError(
                f"args must be {config_class.__name__}, transformers.TrainingArguments or None, got "
                f"{type(args).__name__}."
            )
        names = {f.name for f in dataclasses.fields(config_class) if f.init}
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and f.name in names}
        if dataclasses.is_dataclass(values.get("accelerator_config")):
            # A copy: trainers adjust accelerator_config (IterableDataset) and must not change the caller's args.
            values["accelerator_config"] = copy.copy(values["accelerator_config"])
        return config_class(**values)

    def _check_distributed_setup(self) -> None:
        """Refuse to run N independent copies: a launcher started several processes but HF set up no DDP."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return
        launched = dist.get_world_size()
        if launched > 1 and self.args.world_size == 1:
            raise ValueError(
                f"{launched} processes were launched (torch.distributed is initialized) but the Trainer runs "
                "without data parallelism, so each process would train its own copy of the model. On a CPU-only "
                "machine set use_cpu=True (or ACCELERATE_USE_CPU=true) so accelerate uses MULTI_CPU (gloo); on "
                "GPUs launch with `accelerate launch` or torchrun so that each process gets its own device."
            )

    def _report_name(self) -> str | None:
        """Which report panels fit this trainer (``"sft"``, ``"grpo"``...); None lets the report guess."""
        tags = [t for t in self._tag_names if t not in ("posttrain", "trl")]
        return {"reward-trainer": "reward"}.get(tags[0], tags[0]) if tags else None

    # -- metrics -------------------------------------------------------------------------------------------------
    def _mode(self) -> str:
        return "train" if self.model is not None and self.model.training else "eval"

    def record_metric(
        self, name: str, value: float | torch.Tensor, mode: str | None = None, *, replace: bool = False
    ) -> None:
        """Add one value of ``name`` to the current logging window (the one way every trainer records a metric).

        ``replace``: the window keeps only this value (running totals such as ``num_tokens``)."""
        if isinstance(value, torch.Tensor):
            value = value.detach().float().mean().item() if value.numel() else float("nan")
        window = self._metrics[mode or self._mode()]
        if replace:
            window[name] = [float(value)]
        else:
            window[name].append(float(value))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = self._mode()
        averaged = {name: nanmean_or_none(vals) for name, vals in self._metrics[mode].items()}
        if mode == "eval":
            averaged = {f"eval_{k}": v for k, v in averaged.items()}
        elif self._numerics.policy == "skip" and self._numerics.skipped_steps:  # TRL's metrics only, until a skip
            averaged["numerics/skipped_steps"] = self._numerics.skipped_steps
        logs.update(averaged)  # in place, as TRL: evaluate() returns this dict, eval_rewards/... included
        self._metrics[mode].clear()
        super().log(logs, start_time)

    # -- evaluation datasets -------------------------------------------------------------------------------------
    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """One evaluation dataset prepared exactly as the constructor prepares ``eval_dataset`` (validated,
        tokenized, packed...). Trainers that prepare their datasets set ``self._eval_preparer`` (a function of
        ``(dataset, name)``) in their constructor, before the datasets are prepared; without one it is unchanged."""
        preparer = getattr(self, "_eval_preparer", None)
        return dataset if preparer is None else preparer(dataset, name)

    def _is_prepared_eval_dataset(self, dataset: Any) -> bool:
        """Whether ``dataset`` is one this trainer prepared (from the constructor or an earlier ``evaluate``)."""
        own = self.eval_dataset
        known = list(own.values()) if isinstance(own, dict) else [own]
        known += [prepared for _, prepared in self._prepared_eval_datasets.values()]
        return any(dataset is d for d in known)

    def _prepared_eval_split(self, dataset: Any, name: str) -> Any:
        """``dataset`` prepared for evaluation once (cached by identity); datasets already prepared pass as they are."""
        if self._is_prepared_eval_dataset(dataset):
            return dataset
        cached = self._prepared_eval_datasets.get(id(dataset))
        if cached is not None and cached[0] is dataset:
            return cached[1]
        arg = "eval_dataset" if name == "eval" else f"eval_dataset[{name.split('/', 1)[1]!r}]"
        validation.check_dataset_type(dataset, arg)
        validation.check_not_empty(dataset, arg)
        prepared = self._prepare_eval_dataset(dataset, name)
        if len(self._prepared_eval_datasets) >= MAX_CACHED_EVAL_DATASETS:  # a loop over new objects stays bounded
            del self._prepared_eval_datasets[next(iter(self._prepared_eval_datasets))]
        self._prepared_eval_datasets[id(dataset)] = (dataset, prepared)
        return prepared

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """HF's ``evaluate``; a dataset given here is prepared exactly as the constructor prepares ``eval_dataset``
        (as TRL): a ``Dataset``, an ``IterableDataset``, or a dict of them (``DatasetDict``, ``IterableDatasetDict``),
        evaluated per split with HF's ``{metric_key_prefix}_{name}_`` prefixes. Prepared datasets are cached, so
        evaluating the same object again does not prepare it again; a string names one of the constructor's sets."""
        if eval_dataset is None or isinstance(eval_dataset, str):
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        if isinstance(eval_dataset, dict):
            # one evaluation per split here: handing the dict to HF would re-enter this method per split
            metrics: dict[str, float] = {}
            for key, split in eval_dataset.items():
                prepared = self._prepared_eval_split(split, f"eval/{key}")
                metrics.update(
                    super().evaluate(prepared, ignore_keys=ignore_keys, metric_key_prefix=f"{metric_key_prefix}_{key}")
                )
            return metrics
        prepared = self._prepared_eval_split(eval_dataset, "eval")
        return super().evaluate(prepared, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    # -- saving --------------------------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write the model and tokenizer to a temporary folder, then move each file into place.

        A crash mid-save leaves either the previous file or the complete new one, never a half-written file.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return super()._save(output_dir, state_dict)
        os.makedirs(output_dir, exist_ok=True)
        tmp_dir = tempfile.mkdtemp(prefix=".tmp-save-", dir=output_dir)
        try:
            super()._save(tmp_dir, state_dict)
            for name in os.listdir(tmp_dir):
                src, dst = os.path.join(tmp_dir, name), os.path.join(output_dir, name)
                if os.path.isdir(src):
                    if os.path.isdir(dst):
                        shutil.rmtree(dst)
                    os.replace(src, dst)
                else:
                    os.replace(src, dst)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    # -- model card ----------------------------------------------------------------------------------------------
    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ) -> None:
        """Write a draft model card, ``README.md`` in ``args.output_dir`` (TRL's signature and behaviour).

        Training scripts call it directly (``trainer.create_model_card(dataset_name=..., tags=[...])``, as open-r1
        and alignment-handbook do) and ``push_to_hub(dataset_name=...)`` forwards its keyword arguments here. The
        card's metadata names the base model (when it is a hub id, not a local folder), the dataset, the library
        and the tags: the caller's plus the trainer's own. Only the main process writes.
        """
        if not self.is_world_process_zero():
            return
        from huggingface_hub import ModelCard, ModelCardData

        config = getattr(self.model, "config", None)
        base_model = getattr(config, "_name_or_path", None) or None
        if base_model is not None and os.path.isdir(base_model):
            base_model = None
        tag_set = {tags} if isinstance(tags, str) else set(tags or ())
        tag_set.update(self._tag_names)
        if "JOB_ID" in os.environ:
            tag_set.add("hf_jobs")
        trainer = type(self).__name__
        data = ModelCardData(
            base_model=base_model,
            datasets=dataset_name,
            library_name="transformers",
            model_name=model_name or self.hub_model_id or os.path.basename(os.path.normpath(self.args.output_dir)),
            tags=sorted(tag_set),
        )
        trained_on = f" on [{dataset_name}](https://huggingface.co/datasets/{dataset_name})" if dataset_name else ""
        started_from = (
            f"a fine-tuned version of [{base_model}](https://huggingface.co/{base_model})"
            if base_model
            else "a fine-tuned model"
        )
        content = (
            f"---\n{data.to_yaml()}\n---\n\n# Model Card for {data.model_name}\n\n"
            f"This model is {started_from}{trained_on}, trained with posttrain's `{trainer}` (TRL's API).\n\n"
            "## Training procedure\n\n"
            f"- trainer: `{trainer}`\n- global steps: {self.state.global_step}\n"
        )
        ModelCard(content).save(os.path.join(self.args.output_dir, "README.md"))

    # -- up-front checks and resume ------------------------------------------------------------------------------
    def validate_before_training(self) -> None:
        """Generic checks run at the start of ``train()`` (trainers add their own in ``__init__``).

        Raises ValueError/TypeError naming the option and the fix: unwritable output_dir, missing or empty train
        dataset, non-positive batch sizes, a drop-last loader that drops every row, a tokenizer that cannot pad.
        """
        validation.check_train_dataset(self.train_dataset, type(self).__name__)
        validation.check_batch_arithmetic(self.args, self.train_dataset)
        validation.check_tokenizer(self.processing_class)
        validation.check_output_dir_writable(self.args.output_dir)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs):
        """HF ``Trainer.train`` after the up-front checks, resolving ``resume_from_checkpoint`` crash-safely.

        ``resume_from_checkpoint=True`` resumes from the newest *complete* ``checkpoint-N`` in ``output_dir``
        (``tmp-checkpoint-N`` staging folders left by a crash are ignored and removed); a path must be a complete
        checkpoint. posttrain's per-process resume state (``resume_state_dict``) is restored before training.
        """
        self.validate_before_training()
        checkpoint = checkpointing.resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if self.args.should_save:
            checkpointing.remove_stale_staging(self.args.output_dir)
        if checkpoint is not None:
            self._load_resume_state(checkpoint)
        return super().train(resume_from_checkpoint=checkpoint, trial=trial, **kwargs)

    def resume_state_dict(self) -> dict[str, Any]:
        """This process's state that a resumed run needs beyond model/optimizer/scheduler/RNG/``trainer_state``.

        Saved with ``torch.save`` into ``posttrain_state_{process_index}.pt`` in every checkpoint and loaded with
        ``weights_only=True``: keep to tensors, numbers, strings and lists/dicts of them. Subclasses extend it::

            def resume_state_dict(self):
                return {**super().resume_state_dict(), "controller": self.controller.state_dict()}
        """
        return {"numerics": self._numerics.state_dict()}

    def load_resume_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``resume_state_dict`` returned (subclasses call ``super()`` and read their own keys)."""
        if "numerics" in state:
            self._numerics.load_state_dict(state["numerics"])

    def _resume_state_path(self, folder: str) -> str:
        return os.path.join(folder, RESUME_STATE_FILE.format(process_index=self.args.process_index))

    def _load_resume_state(self, checkpoint: str) -> None:
        path = self._resume_state_path(checkpoint)
        if os.path.isfile(path):  # checkpoints written by other tools have none: HF's state is still restored
            with _naming_corrupt_files(checkpoint, "posttrain resume state"):
                state = torch.load(path, map_location="cpu", weights_only=True)
            self.load_resume_state_dict(state)

    # HF's resume loaders: a damaged file fails with an error that names the checkpoint, the file and the fix.
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        with _naming_corrupt_files(resume_from_checkpoint, "model"):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        with _naming_corrupt_files(checkpoint, "optimizer and scheduler"):
            return super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint):
        with _naming_corrupt_files(checkpoint, "RNG state"):
            return super()._load_rng_state(checkpoint)

    def _load_scaler(self, checkpoint):
        with _naming_corrupt_files(checkpoint, "gradient scaler"):
            return super()._load_scaler(checkpoint)

    # -- numerics guard ------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._numerics.observe_loss(loss, inputs)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        # HF calls this right before optimizer.step() on every optimizer step, with the pre-clip total norm.
        grad_norm = super()._get_grad_norm(model, grad_norm)
        self._numerics.check_step(
            grad_norm,
            step=self.state.global_step + 1,
            parameters=model.parameters,
            reduce_any=self._reduce_any if self.accelerator.num_processes > 1 else None,
        )
        return grad_norm

    def _reduce_any(self, flag: bool) -> bool:
        """True on every process if ``flag`` is True on any process (keeps stop/skip decisions in lockstep)."""
        value = torch.tensor([1.0 if flag else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(value, reduction="sum").item() > 0)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        """HF's checkpoint contents, staged in ``tmp-checkpoint-N`` and renamed to ``checkpoint-N`` when complete.

        Order: model → optimizer/scheduler/scaler → RNG (per process) → posttrain resume state (per process) →
        ``trainer_state.json`` → flush → rename (main process) → push/rotate. A process killed at any point leaves
        the previous checkpoints untouched and at most a ``tmp-checkpoint-N`` folder, which discovery ignores.
        """
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        tmp_dir = checkpointing.staging_dir(final_dir)
        if self.args.should_save:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            os.makedirs(tmp_dir, exist_ok=True)
        self.accelerator.wait_for_everyone()  # the staging folder exists (and is empty) before anyone writes

        self.save_model(tmp_dir, _internal_call=True)
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            best_step = self.state.best_global_step
            if best_step:
                best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
                if best_step == self.state.global_step or os.path.exists(best_dir):
                    self.state.best_model_checkpoint = best_dir
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(tmp_dir)
            self._save_scaler(tmp_dir)
            self._save_rng_state(tmp_dir)
        self._save_checkpoint_extras(tmp_dir)
        if self.args.should_save:
            for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
            self.state.save_to_json(os.path.join(tmp_dir, checkpointing.TRAINER_STATE_FILE))
        self.accelerator.wait_for_everyone()  # every process has written its files
        if self.args.should_save:
            checkpointing.publish_checkpoint(tmp_dir, final_dir)
        self.accelerator.wait_for_everyone()  # checkpoint-N is in place for every process

        if self.args.push_to_hub:
            self._push_from_checkpoint(final_dir)
        if self.args.should_save:
            checkpointing.rotate_checkpoints(
                run_dir, self.args.save_total_limit, keep=(final_dir, self.state.best_model_checkpoint)
            )

    def _save_checkpoint_extras(self, output_dir: str) -> None:
        """Write this process's extra checkpoint files into the staging folder (runs on every process).

        The default writes ``resume_state_dict()``; trainers with files of their own override this and call
        ``super()`` so that everything lands in the folder before it is published.
        """
        torch.save(self.resume_state_dict(), self._resume_state_path(output_dir))
