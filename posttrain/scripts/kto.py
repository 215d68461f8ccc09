"""``posttrain kto``: Kahneman-Tversky Optimization with ``KTOTrainer`` (TRL's ``trl kto`` script).

Examples:
    posttrain kto --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/kto-mix-14k
    posttrain kto --config examples/kto.yaml --num_processes 2
    python -m posttrain.scripts.kto --config examples/kto.yaml      # the worker entry point, always one process
"""

from __future__ import annotations

import argparse
import sys

from posttrain.cli.configs import ModelConfig, ScriptArguments
from posttrain.scripts._common import build_and_train, make_trl_parser


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = "posttrain kto"):
    """``TrlParser`` over ``(ScriptArguments, KTOConfig, ModelConfig, DatasetMixtureConfig)``."""
    from posttrain.data.loading import DatasetMixtureConfig
    from posttrain.trainers.kto import KTOConfig

    return make_trl_parser(
        prog, (ScriptArguments, KTOConfig, ModelConfig, DatasetMixtureConfig), __doc__, subparsers, "kto"
    )


def main(script_args, training_args, model_args, dataset_args=None) -> None:
    """Train with KTO on an unpaired (``prompt``/``completion``/``label``) or paired preference dataset."""
    from posttrain.trainers.kto import KTOTrainer

    build_and_train("kto", KTOTrainer, script_args, training_args, model_args, dataset_args)


def cli(argv: list[str]) -> int:
    """``posttrain kto ARGS``: validate, then train here or launch the workers."""
    from posttrain.cli.run import run_training_command

    return run_training_command("kto", argv)


if __name__ == "__main__":
    from posttrain.cli.run import run_script

    sys.exit(run_script("kto"))
