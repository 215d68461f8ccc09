"""``posttrain reward``: reward modelling with ``RewardTrainer`` (TRL's ``trl reward`` script).

The model is loaded as a sequence classifier with one output (the reward). With ``--use_peft`` pass
``--lora_task_type SEQ_CLS`` so the score head is trained and saved with the adapter.

Examples:
    posttrain reward --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized
    posttrain reward --config examples/reward.yaml
    python -m posttrain.scripts.reward --config examples/reward.yaml      # the worker entry point, one process
"""

from __future__ import annotations

import argparse
import sys

from posttrain.cli.configs import ModelConfig, ScriptArguments
from posttrain.scripts._common import build_and_train, logger, make_trl_parser


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = "posttrain reward"):
    """``TrlParser`` over ``(ScriptArguments, RewardConfig, ModelConfig, DatasetMixtureConfig)``."""
    from posttrain.data.loading import DatasetMixtureConfig
    from posttrain.trainers.reward import RewardConfig

    return make_trl_parser(
        prog, (ScriptArguments, RewardConfig, ModelConfig, DatasetMixtureConfig), __doc__, subparsers, "reward"
    )


def main(script_args, training_args, model_args, dataset_args=None) -> None:
    """Train a Bradley-Terry reward model on a preference dataset."""
    from posttrain.trainers.reward import RewardTrainer

    if model_args.use_peft and model_args.lora_task_type != "SEQ_CLS":
        logger.warning(
            "--use_peft with lora_task_type=%r: a reward model needs --lora_task_type SEQ_CLS, otherwise the score "
            "head is neither trained nor saved with the adapter.",
            model_args.lora_task_type,
        )
    build_and_train("reward", RewardTrainer, script_args, training_args, model_args, dataset_args)


def cli(argv: list[str]) -> int:
    """``posttrain reward ARGS``: validate, then train here or launch the workers."""
    from posttrain.cli.run import run_training_command

    return run_training_command("reward", argv)


if __name__ == "__main__":
    from posttrain.cli.run import run_script

    sys.exit(run_script("reward"))
