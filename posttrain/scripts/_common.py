"""What the training scripts share: the parser, model-loading kwargs, dataset splits, rewards, progress, train+save.

Each ``posttrain/scripts/<verb>.py`` is TRL's script of the same name: ``make_parser(subparsers=None, prog=...)``
returns a
``TrlParser`` over ``(ScriptArguments, <X>Config, ModelConfig, DatasetMixtureConfig)`` and ``main(script_args,
training_args, model_args, dataset_args)`` trains. The pieces they have in common live here so the scripts stay a
short recipe.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from posttrain.cli.configs import ModelConfig, get_peft_config
from posttrain.cli.parser import ConfigError, TrlParser

logger = logging.getLogger("posttrain.scripts")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every option; description and epilog keep their line breaks."""


def _epilog() -> str:
    from posttrain.cli.launch import bundled_accelerate_configs

    presets = ", ".join(bundled_accelerate_configs())
    return (
        "launch options:\n"
        "  Every `accelerate launch` option is accepted and passed through, e.g. --num_processes N,\n"
        "  --config_file PATH, --num_machines M, --machine_rank R, --main_process_ip IP, --main_process_port P,\n"
        "  --mixed_precision {no,fp16,bf16,fp8}, --gpu_ids, --cpu (see `accelerate launch --help`).\n"
        f"  --accelerate_config NAME|PATH  a bundled accelerate config ({presets}) or a file.\n"
        "  One process trains in this process; several run under torchrun (CPU, gloo) or accelerate launch (GPU).\n"
        "  A --config YAML recipe may set any option above, including launch options and an `env:` mapping.\n"
        "  --debug (without a value) prints full tracebacks instead of one-paragraph errors."
    )


def make_trl_parser(
    prog: str | None,
    dataclass_types: tuple,
    description: str | None = None,
    subparsers: argparse._SubParsersAction | None = None,
    name: str | None = None,
) -> TrlParser:
    """The ``TrlParser`` a script's ``make_parser`` returns (help with defaults and the launch options).

    As TRL's scripts: with ``subparsers`` (an ``add_subparsers(parser_class=TrlParser)`` action), the parser is added
    to it as the subcommand ``name`` (so a parent parser's ``--config`` defaults reach it) instead of standing alone.
    """
    options = dict(description=description, epilog=_epilog(), formatter_class=_HelpFormatter)
    if subparsers is not None:
        if name is None:
            raise ValueError("make_trl_parser(subparsers=...) needs the subcommand name.")
        return subparsers.add_parser(
            name, help=f"Run the {name} training script", dataclass_types=dataclass_types, **options
        )
    return TrlParser(dataclass_types, prog=prog, **options)


def require_model(model_args: ModelConfig) -> str:
    """``model_name_or_path``, which every script needs."""
    if not model_args.model_name_or_path:
        raise ConfigError("--model_name_or_path is required: a hub id or a local model folder.")
    return model_args.model_name_or_path


def apply_model_args(training_args: Any, model_args: ModelConfig) -> None:
    """Put ``ModelConfig``'s loading options into ``training_args.model_init_kwargs`` (as TRL's scripts do).

    ``trust_remote_code`` comes from ``training_args`` (TRL 1.16 keeps it on the trainer config). Keys the recipe
    already set in ``model_init_kwargs`` win over those derived from ``ModelConfig``.
    """
    kwargs = model_args.model_init_kwargs(trust_remote_code=getattr(training_args, "trust_remote_code", False))
    explicit = getattr(training_args, "model_init_kwargs", None) or {}
    training_args.model_init_kwargs = {**kwargs, **explicit}


def _split(dataset: Any, split: str, option: str, hint: str) -> Any:
    if not hasattr(dataset, "keys"):  # a single Dataset (e.g. a split was already selected)
        return dataset
    if split not in dataset:
        raise ConfigError(
            f"The dataset has no split {split!r} (--{option}); it has {sorted(dataset.keys())}. {hint}".strip()
        )
    return dataset[split]


def load_datasets(script_args: Any, training_args: Any, dataset_args: Any = None) -> tuple[Any, Any]:
    """The train split and (when ``eval_strategy`` is not ``"no"``) the eval split, as TRL's scripts pick them.

    A ``datasets:`` mixture wins over ``dataset_name`` (with a warning when both are given); neither is an error.
    """
    from posttrain.data.loading import get_dataset, load_dataset_from_spec

    mixture = dataset_args if dataset_args is not None and getattr(dataset_args, "datasets", None) else None
    if mixture is not None:
        if script_args.dataset_name:
            logger.warning(
                "Both `datasets` (a mixture) and `dataset_name` are given; training on the mixture and ignoring "
                "dataset_name=%r.",
                script_args.dataset_name,
            )
        dataset = get_dataset(mixture)
    elif script_args.dataset_name:
        dataset = load_dataset_from_spec(
            script_args.dataset_name, config=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ConfigError(
            "No dataset given: pass --dataset_name (a hub name or a local json/jsonl/csv/parquet file or folder), "
            "or list sources under `datasets:` in the --config YAML."
        )
    train = _split(dataset, script_args.dataset_train_split, "dataset_train_split", "")
    strategy = getattr(training_args, "eval_strategy", "no")
    eval_dataset = None
    if getattr(strategy, "value", strategy) != "no":
        eval_dataset = _split(
            dataset,
            script_args.dataset_test_split,
            "dataset_test_split",
            "Name an existing split with --dataset_test_split, set `test_split_size` on a `datasets:` mixture, or "
            "turn evaluation off with --eval_strategy no.",
        )
    return train, eval_dataset


def reward_funcs_from_args(verb: str, script_args: Any) -> list[Any]:
    """Reward sources for GRPO/RLOO: the reward model first (as TRL), then ``--reward_funcs`` resolved by name."""
    from posttrain.rewards.registry import resolve_reward_funcs

    funcs: list[Any] = []
    if script_args.reward_model_name_or_path:
        funcs.append(script_args.reward_model_name_or_path)
    funcs += resolve_reward_funcs(script_args.reward_funcs)
    if not funcs:
        raise ConfigError(
            f"`posttrain {verb}` needs at least one reward: --reward_funcs NAME [NAME ...] (registry names such as "
            "accuracy_reward, think_format_reward, or a dotted path my_rewards.my_func) and/or "
            "--reward_model_name_or_path PATH."
        )
    return funcs


def use_rich_progress(trainer: Any) -> None:
    """Replace transformers' tqdm bar / printer with ``RichProgressCallback`` (plain lines when not a terminal)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from posttrain.callbacks import RichProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(RichProgressCallback())


def announce(verb: str, training_args: Any, message: str) -> None:
    """One line per process: ``[posttrain sft] process 1/2 (MULTI_CPU, cpu): message``."""
    state = getattr(training_args, "distributed_state", None)
    kind = getattr(getattr(state, "distributed_type", None), "value", "NO")
    print(
        f"[posttrain {verb}] process {training_args.process_index + 1}/{training_args.world_size} "
        f"({kind}, {training_args.device}): {message}",
        file=sys.stdout,
        flush=True,
    )


def train_and_save(verb: str, trainer: Any, training_args: Any, script_args: Any) -> None:
    """Train (resuming when ``resume_from_checkpoint`` is set), save to ``output_dir``, push when asked."""
    use_rich_progress(trainer)
    announce(verb, training_args, f"training {type(trainer.model).__name__}")
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        # transformers' model card names the dataset with `dataset=` (TRL's trainers call it dataset_name)
        trainer.push_to_hub(**({"dataset": script_args.dataset_name} if script_args.dataset_name else {}))
    announce(
        verb,
        training_args,
        f"training finished after {trainer.state.global_step} steps; model saved to {training_args.output_dir}",
    )
    release_process_group()


def release_process_group() -> None:
    """After a script's last collective: wait for every process, then destroy the process group, so its gloo/NCCL
    threads are joined before the interpreter exits (left to exit-time destructors, a worker can abort with
    "terminate called without an active exception" after training finished)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def build_and_train(
    verb: str,
    trainer_cls: type,
    script_args: Any,
    training_args: Any,
    model_args: ModelConfig,
    dataset_args: Any = None,
    *,
    model: Any = None,
    **trainer_kwargs: Any,
) -> Any:
    """The body every script shares: loading kwargs from ``ModelConfig``, the dataset splits, the trainer, training.

    Args:
        verb: Command name, for messages.
        trainer_cls: ``SFTTrainer``, ``DPOTrainer``, ...
        model: The model to train (default: ``model_args.model_name_or_path``, loaded by the trainer).
        **trainer_kwargs: Extra trainer arguments (``reward_funcs``, ``teacher_model``...).

    Returns:
        The trainer, after training and saving.
    """
    model = require_model(model_args) if model is None else model
    apply_model_args(training_args, model_args)  # idempotent: a script may have applied it already
    train_dataset, eval_dataset = load_datasets(script_args, training_args, dataset_args)
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
        **trainer_kwargs,
    )
    train_and_save(verb, trainer, training_args, script_args)
    return trainer
