"""``posttrain grpo``: Group Relative Policy Optimization with ``GRPOTrainer`` (TRL's ``trl grpo`` script).

Rewards come from ``--reward_funcs`` (registry names such as ``accuracy_reward``, ``think_format_reward``,
``get_soft_overlong_punishment``; ``name(key=value)`` for factories; or a dotted path ``my_rewards.my_func`` imported
from the current directory) and/or ``--reward_model_name_or_path`` (a sequence classifier, scored first).

Examples:
    posttrain grpo --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward think_format_reward
    posttrain grpo --config examples/grpo.yaml --num_processes 8
    python -m posttrain.scripts.grpo --config examples/grpo.yaml      # the worker entry point, always one process

``reward_script`` builds this layout (``make_parser``, ``main``, ``cli``) for every reward-driven verb (``rloo``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from posttrain.cli.configs import GRPOScriptArguments, ModelConfig
from posttrain.scripts._common import build_and_train, make_trl_parser, reward_funcs_from_args


def reward_script(verb: str, script_args_class: type, method: str, doc: str | None) -> tuple[Callable, ...]:
    """``(make_parser, main, cli)`` of ``posttrain <verb>`` for the trainer ``posttrain.trainers.<verb>``.

    ``method`` is the class-name prefix (``"GRPO"`` → ``GRPOConfig`` / ``GRPOTrainer``); the trainer module is
    imported only when a parser or a run needs it (a missing trainer gives the CLI's one-line error).
    """

    def trainer_attr(suffix: str) -> Any:
        return getattr(importlib.import_module(f"posttrain.trainers.{verb}"), f"{method}{suffix}")

    def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = f"posttrain {verb}"):
        from posttrain.data.loading import DatasetMixtureConfig

        classes = (script_args_class, trainer_attr("Config"), ModelConfig, DatasetMixtureConfig)
        return make_trl_parser(prog, classes, doc, subparsers, verb)

    def main(script_args, training_args, model_args, dataset_args=None) -> None:
        reward_funcs = reward_funcs_from_args(verb, script_args)
        trainer_class = trainer_attr("Trainer")
        build_and_train(
            verb, trainer_class, script_args, training_args, model_args, dataset_args, reward_funcs=reward_funcs
        )

    def cli(argv: list[str]) -> int:
        from posttrain.cli.run import run_training_command

        return run_training_command(verb, argv)

    make_parser.__doc__ = (
        f"``TrlParser`` over ``({script_args_class.__name__}, {method}Config, ModelConfig, DatasetMixtureConfig)``."
    )
    main.__doc__ = f"Resolve the rewards, load the prompts, train with {method} and save."
    cli.__doc__ = f"``posttrain {verb} ARGS``: validate, then train here or launch the workers."
    return make_parser, main, cli


make_parser, main, cli = reward_script("grpo", GRPOScriptArguments, "GRPO", __doc__)

if __name__ == "__main__":
    from posttrain.cli.run import run_script

    sys.exit(run_script("grpo"))
