"""``posttrain sft``: supervised fine-tuning with ``SFTTrainer`` (TRL's ``trl sft`` script).

Examples:
    posttrain sft --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara --output_dir Qwen2.5-0.5B-SFT
    posttrain sft --config examples/sft.yaml --num_processes 4
    python -m posttrain.scripts.sft --config examples/sft.yaml      # the worker entry point, always one process
"""

from __future__ import annotations

import argparse
import sys

from posttrain.cli.configs import ModelConfig, ScriptArguments
from posttrain.scripts._common import build_and_train, make_trl_parser


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = "posttrain sft"):
    """``TrlParser`` over ``(ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig)``."""
    from posttrain.data.loading import DatasetMixtureConfig
    from posttrain.trainers.sft import SFTConfig

    return make_trl_parser(
        prog, (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig), __doc__, subparsers, "sft"
    )


def main(script_args, training_args, model_args, dataset_args=None) -> None:
    """Load the dataset, build ``SFTTrainer`` from the model path, train and save to ``output_dir``."""
    from posttrain.trainers.sft import SFTTrainer

    build_and_train("sft", SFTTrainer, script_args, training_args, model_args, dataset_args)


def cli(argv: list[str]) -> int:
    """``posttrain sft ARGS``: validate, then train here or launch the workers."""
    from posttrain.cli.run import run_training_command

    return run_training_command("sft", argv)


if __name__ == "__main__":
    from posttrain.cli.run import run_script

    sys.exit(run_script("sft"))
