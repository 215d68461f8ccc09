"""Entry point of the ``posttrain`` command.

Sub-commands are looked up in ``COMMANDS`` (name → "module:function" plus a one-line help) and imported only when
run, so ``posttrain --help`` and ``posttrain --version`` do not import torch. Training verbs point at
``posttrain.scripts.<verb>:cli``; their options come from the script's ``TrlParser`` (``posttrain <verb> --help``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# verb -> (module:function taking the argv list after the verb and returning an exit code, help line)
COMMANDS: dict[str, tuple[str, str]] = {
    "sft": ("posttrain.scripts.sft:cli", "Supervised fine-tuning (SFTTrainer)."),
    "dpo": ("posttrain.scripts.dpo:cli", "Direct Preference Optimization (DPOTrainer)."),
    "kto": ("posttrain.scripts.kto:cli", "Kahneman-Tversky Optimization (KTOTrainer)."),
    "reward": ("posttrain.scripts.reward:cli", "Train a reward model (RewardTrainer)."),
    "grpo": ("posttrain.scripts.grpo:cli", "Group Relative Policy Optimization (GRPOTrainer)."),
    "rloo": ("posttrain.scripts.rloo:cli", "REINFORCE Leave-One-Out (RLOOTrainer)."),
    "distillation": (
        "posttrain.scripts.distillation:cli",
        "On-policy distillation of a teacher into a student (DistillationTrainer).",
    ),
    "serve": (
        "posttrain.cli.serve:serve_cli",
        "Serve a model for generation (/v1/completions, /v1/chat/completions, weight updates) for vllm_mode='server'.",
    ),
    "vllm-serve": ("posttrain.cli.serve:vllm_serve_cli", "TRL's `trl vllm-serve` flags: the generation server."),
    "demo": ("posttrain.demo.run:main", "Offline end-to-end demo: SFT then GRPO on a tiny model (--task arithmetic | agent), with a report."),
    "env": ("posttrain.cli.main:_run_env", "Print versions, devices and the accelerate config for bug reports."),
    "report": ("posttrain.cli.main:_run_report", "Write the HTML training report for an output directory."),
}


def _run_env(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="posttrain env", description=COMMANDS["env"][1])
    parser.parse_args(argv)
    from posttrain.env_info import print_env

    print_env()
    return 0


def _run_report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="posttrain report",
        description="Draw the metric plots and write OUTPUT_DIR/report/index.html from OUTPUT_DIR/metrics.jsonl.",
    )
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="A training output directory.")
    parser.add_argument("--title", default=None, help="Report title (default: 'posttrain training report').")
    args = parser.parse_args(argv)
    from posttrain.cli.run import guarded

    def work() -> int:
        from posttrain.report import write_report

        if not os.path.isdir(args.output_dir):
            raise FileNotFoundError(f"{args.output_dir!r} is not a directory; pass a training output_dir.")
        print(write_report(args.output_dir, title=args.title))
        return 0

    return guarded("posttrain report", work)


def build_parser() -> argparse.ArgumentParser:
    from posttrain._version import __version__

    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-train language models (SFT, DPO, KTO, reward modelling, GRPO, RLOO, distillation) with "
        "TRL's API. Run `posttrain COMMAND --help` for a command's options.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_line) in COMMANDS.items():
        sub.add_parser(name, help=help_line, add_help=False)
    return parser


# Set for every sub-command unless the user set them. OpenMP's default lets a worker thread spin for a while after
# each parallel region before it sleeps; torch's CPU kernels open one region per op, so on small models the workers
# spin nearly all the time: CPU time ~2x wall on an idle 2-core machine, and on a busy one the spinning threads take
# the cores from the thread with work (benchmarks/RESULTS.md, "Loaded machines"). PASSIVE makes a waiting thread
# sleep at once. Same threads, same work split, so results are unchanged. Read when torch loads its OpenMP runtime:
# it has no effect on a process that imported torch before this runs.
DEFAULT_THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _default_thread_env() -> None:
    for key, value in DEFAULT_THREAD_ENV.items():
        os.environ.setdefault(key, value)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)  # handles --help / --version / unknown commands
        if args.command is None:
            parser.print_help()
        return 0
    _default_thread_env()
    target, _ = COMMANDS[argv[0]]
    module_name, func_name = target.split(":")
    return int(getattr(importlib.import_module(module_name), func_name)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
