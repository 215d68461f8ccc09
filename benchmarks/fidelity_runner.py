"""Run fidelity scenarios with one library and write their per-step logs as JSON (one process per library).

    python -m benchmarks.fidelity_runner --impl posttrain --names-file names.txt --causal DIR --seqcls DIR --out x.json
    benchmarks/.venv-trl/bin/python -m benchmarks.fidelity_runner --impl trl ...

The TRL side never imports posttrain (checked at the end); the posttrain side never imports trl.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from benchmarks import common, fidelity


class _TrainerClasses(dict):
    """``{trainer: (Config, Trainer)}``; an experimental trainer's module (``<impl>.experimental.<name>``) is imported
    on first use only, so a run of the stable scenarios never imports it."""

    def __init__(self, impl: str):
        super().__init__()
        self.impl = impl

    def __missing__(self, name: str) -> tuple[type, type]:
        import importlib

        module, config, trainer = fidelity.EXPERIMENTAL[name]
        mod = importlib.import_module(f"{self.impl}.experimental.{module}")
        self[name] = (getattr(mod, config), getattr(mod, trainer))
        return self[name]


def trainer_classes(impl: str) -> dict[str, tuple[type, type]]:
    lib = __import__(impl)
    classes = _TrainerClasses(impl)
    classes.update({
        "sft": (lib.SFTConfig, lib.SFTTrainer),
        "dpo": (lib.DPOConfig, lib.DPOTrainer),
        "kto": (lib.KTOConfig, lib.KTOTrainer),
        "reward": (lib.RewardConfig, lib.RewardTrainer),
        "grpo": (lib.GRPOConfig, lib.GRPOTrainer),
        "rloo": (lib.RLOOConfig, lib.RLOOTrainer),
    })  # fmt: skip
    return classes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["posttrain", "trl"], required=True)
    parser.add_argument("--names-file", required=True, help="One scenario name per line.")
    parser.add_argument("--causal", required=True, help="Saved tiny causal LM directory.")
    parser.add_argument("--seqcls", required=True, help="Saved tiny sequence classifier directory.")
    parser.add_argument("--qwen3", required=True, help="The tiny causal LM with a Qwen3 chat template.")
    parser.add_argument("--no-newline", required=True, help="The tiny causal LM, no newline after an assistant turn.")
    parser.add_argument("--teacher", required=True, help="A different tiny causal LM (same tokenizer): teachers.")
    parser.add_argument("--vlm", nargs="*", default=[], metavar="FAMILY=DIR", help="Saved tiny VLMs (vlm/ scenarios).")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=None, help="Override every scenario's optimizer steps.")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    common.env_setup(1)
    with open(args.names_file) as f:
        names = [line.strip() for line in f if line.strip()]
    scenarios = [fidelity.SCENARIOS[n] for n in names]
    if args.steps is not None:
        scenarios = [dataclasses.replace(s, steps=args.steps) for s in scenarios]
    paths = {
        "causal-lm": args.causal,
        "sequence-classification": args.seqcls,
        "causal-lm-qwen3": args.qwen3,
        "causal-lm-no-newline": args.no_newline,
        "teacher": args.teacher,
    }
    for item in args.vlm:
        family, _, path = item.partition("=")
        paths[f"vlm-{family}"] = path
    results = fidelity.run_many(scenarios, paths, trainer_classes(args.impl))
    other = "posttrain" if args.impl == "trl" else "trl"
    if other in sys.modules:
        raise RuntimeError(f"The {args.impl} fidelity runner imported {other}; the comparison would not be clean.")
    results["_versions"] = common.versions(args.impl)
    with open(args.out, "w") as f:
        f.write(fidelity.dumps(results))


if __name__ == "__main__":
    main()
