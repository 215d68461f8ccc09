"""Entry point of the ``posttrain`` command.

Sub-commands are looked up in ``COMMANDS`` (name → "module:function" plus a one-line help) and imported only when
run, so ``posttrain --help`` and ``posttrain --version`` do not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> (module:function taking argv list and returning an exit code, help line)
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("posttrain.cli.main:_run_env", "Print versions and devices for bug reports."),
}


def _run_env(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="posttrain env", description=COMMANDS["env"][1])
    parser.parse_args(argv)
    from posttrain.cli.env import print_env

    print_env()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from posttrain._version import __version__

    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-train language models (SFT, DPO, KTO, reward modelling, GRPO, RLOO) with TRL's API.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_line) in COMMANDS.items():
        sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)  # handles --help / --version / unknown commands
        if args.command is None:
            parser.print_help()
        return 0
    target, _ = COMMANDS[argv[0]]
    module_name, func_name = target.split(":")
    return int(getattr(importlib.import_module(module_name), func_name)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
