"""``posttrain distillation``: on-policy knowledge distillation with ``DistillationTrainer`` (``trl distillation``).

The student is ``--model_name_or_path``; the teacher is ``--teacher_model_name_or_path`` (a ``DistillationConfig``
field), loaded with the same revision/dtype/attention options unless ``teacher_model_init_kwargs`` says otherwise.

Examples:
    posttrain distillation --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --teacher_model_name_or_path Qwen/Qwen2.5-7B-Instruct --dataset_name trl-lib/DeepMath-103K
    posttrain distillation --config examples/distillation.yaml
    python -m posttrain.scripts.distillation --config examples/distillation.yaml   # worker entry point, one process
"""

from __future__ import annotations

import argparse
import sys

from posttrain.cli.configs import DistillationScriptArguments, ModelConfig
from posttrain.cli.parser import ConfigError
from posttrain.scripts._common import apply_model_args, build_and_train, make_trl_parser


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = "posttrain distillation"):
    """``TrlParser`` over ``(DistillationScriptArguments, DistillationConfig, ModelConfig, DatasetMixtureConfig)``."""
    from posttrain.data.loading import DatasetMixtureConfig
    from posttrain.trainers.distillation import DistillationConfig

    return make_trl_parser(
        prog,
        (DistillationScriptArguments, DistillationConfig, ModelConfig, DatasetMixtureConfig),
        __doc__,
        subparsers,
        "distillation",
    )


def main(script_args, training_args, model_args, dataset_args=None) -> None:
    """Load the prompts, distil the teacher into the student on the student's own samples, save."""
    from posttrain.trainers.distillation import DistillationTrainer

    teacher = getattr(training_args, "teacher_model_name_or_path", None)
    if not teacher:
        raise ConfigError("--teacher_model_name_or_path is required: a hub id or a local model folder.")
    apply_model_args(training_args, model_args)
    if getattr(training_args, "teacher_model_init_kwargs", None) is None:
        # the teacher loads like the student (dtype, attention) but never quantized, at its own revision
        teacher_kwargs = {k: v for k, v in training_args.model_init_kwargs.items() if k != "quantization_config"}
        teacher_kwargs.pop("device_map", None)
        teacher_kwargs["revision"] = getattr(training_args, "teacher_model_revision", None) or "main"
        training_args.teacher_model_init_kwargs = teacher_kwargs
    build_and_train(
        "distillation",
        DistillationTrainer,
        script_args,
        training_args,
        model_args,
        dataset_args,
        teacher_model=teacher,
    )


def cli(argv: list[str]) -> int:
    """``posttrain distillation ARGS``: validate, then train here or launch the workers."""
    from posttrain.cli.run import run_training_command

    return run_training_command("distillation", argv)


if __name__ == "__main__":
    from posttrain.cli.run import run_script

    sys.exit(run_script("distillation"))
