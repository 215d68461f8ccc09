"""``posttrain grpo``: Group Relative Policy Optimization with ``GRPOTrainer`` (TRL's ``trl grpo`` script).

Rewards come from ``--reward_funcs`` (registry names such as ``accuracy_reward``, ``think_format_reward``,
``get_soft_overlong_punishment``; ``name(key=value)`` for factories; or a dotted path ``my_rewards.my_func`` imported
from the current directory) and/or ``--reward_model_name_or_path`` (a sequence classifier, scored first).

Examples:
    posttrain grpo --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward think_format_reward
    posttrain grpo --config examples/grpo.yaml --num_processes 8
    python -m posttrain.scripts.grpo --config examples/grpo.yaml      # the worker entry point, always one process
"""

from __future__ import annotations

import sys

from posttrain.cli.configs import GRPOScriptArguments, ModelConfig
from posttrain.scripts._common import build_and_train, make_trl_parser, reward_funcs_from_args


def make_parser(prog: str | None = "posttrain grpo"):
    """``TrlParser`` over ``(GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig)``."""
    from posttrain.data.loading import DatasetMixtureConfig
    from posttrain.trainers.grpo import GRPOConfig

    return make_trl_parser(prog, (GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig), __doc__)


def main(script_args, training_args, model_args, dataset_args=None) -> None:
    """Resolve the rewards, load the prompts, train with GRPO and save."""
    from posttrain.trainers.grpo import GRPOTrainer

    reward_funcs = reward_funcs_from_args("grpo", script_args)
    build_and_train(
        "grpo", GRPOTrainer, script_args, training_args, model_args, dataset_args, reward_funcs=reward_funcs
    )


def cli(argv: list[str]) -> int:
    """``posttrain grpo ARGS``: validate, then train here or launch the workers."""
    from posttrain.cli.run import run_training_command

    return run_training_command("grpo", argv)


if __name__ == "__main__":
    from posttrain.cli.run import run_script

    sys.exit(run_script("grpo"))
