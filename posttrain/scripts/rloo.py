"""``posttrain rloo``: REINFORCE Leave-One-Out with ``RLOOTrainer`` (TRL's ``trl rloo`` script).

Rewards are given as for ``posttrain grpo``: ``--reward_funcs`` names / dotted paths and/or
``--reward_model_name_or_path``.

Examples:
    posttrain rloo --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward
    posttrain rloo --config examples/rloo.yaml --num_processes 4
    python -m posttrain.scripts.rloo --config examples/rloo.yaml      # the worker entry point, always one process
"""

from __future__ import annotations

import sys

from posttrain.cli.configs import ModelConfig, RLOOScriptArguments
from posttrain.scripts._common import build_and_train, make_trl_parser, reward_funcs_from_args


def make_parser(prog: str | None = "posttrain rloo"):
    """``TrlParser`` over ``(RLOOScriptArguments, RLOOConfig, ModelConfig, DatasetMixtureConfig)``."""
    from posttrain.data.loading import DatasetMixtureConfig
    from posttrain.trainers.rloo import RLOOConfig

    return make_trl_parser(prog, (RLOOScriptArguments, RLOOConfig, ModelConfig, DatasetMixtureConfig), __doc__)


def main(script_args, training_args, model_args, dataset_args=None) -> None:
    """Resolve the rewards, load the prompts, train with RLOO and save."""
    from posttrain.trainers.rloo import RLOOTrainer

    reward_funcs = reward_funcs_from_args("rloo", script_args)
    build_and_train(
        "rloo", RLOOTrainer, script_args, training_args, model_args, dataset_args, reward_funcs=reward_funcs
    )


def cli(argv: list[str]) -> int:
    """``posttrain rloo ARGS``: validate, then train here or launch the workers."""
    from posttrain.cli.run import run_training_command

    return run_training_command("rloo", argv)


if __name__ == "__main__":
    from posttrain.cli.run import run_script

    sys.exit(run_script("rloo"))
