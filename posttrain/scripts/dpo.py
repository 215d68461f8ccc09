"""``posttrain dpo``: Direct Preference Optimization with ``DPOTrainer`` (TRL's ``trl dpo`` script).

Examples:
    posttrain dpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized
    posttrain dpo --config examples/dpo.yaml --accelerate_config zero2
    python -m posttrain.scripts.dpo --config examples/dpo.yaml      # the worker entry point, always one process
"""

from __future__ import annotations

import argparse
import sys

from posttrain.cli.configs import ModelConfig, ScriptArguments
from posttrain.scripts._common import apply_model_args, build_and_train, make_trl_parser, require_model


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = "posttrain dpo"):
    """``TrlParser`` over ``(ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig)``."""
    from posttrain.data.loading import DatasetMixtureConfig
    from posttrain.trainers.dpo import DPOConfig

    return make_trl_parser(
        prog, (ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig), __doc__, subparsers, "dpo"
    )


def main(script_args, training_args, model_args, dataset_args=None) -> None:
    """Train with DPO. The reference is a frozen copy of the model, or (with ``--use_peft``) the adapter-free base."""
    from posttrain.trainers.dpo import DPOTrainer

    model = None
    if script_args.ignore_bias_buffers:
        import torch

        from posttrain.models.loading import create_model_from_path

        apply_model_args(training_args, model_args)
        model = create_model_from_path(require_model(model_args), **training_args.model_init_kwargs)
        # DDP cannot broadcast boolean buffers (e.g. causal masks some models register); tell it to skip them
        model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in model.named_buffers() if buffer.dtype == torch.bool
        ]
    build_and_train("dpo", DPOTrainer, script_args, training_args, model_args, dataset_args, model=model)


def cli(argv: list[str]) -> int:
    """``posttrain dpo ARGS``: validate, then train here or launch the workers."""
    from posttrain.cli.run import run_training_command

    return run_training_command("dpo", argv)


if __name__ == "__main__":
    from posttrain.cli.run import run_script

    sys.exit(run_script("dpo"))
