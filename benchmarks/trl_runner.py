"""Run one benchmark workload with Hugging Face TRL's trainers (executed by benchmarks/.venv-trl's python).

Same workload, dataset, reward functions, saved model and measurement code as posttrain's runner
(``benchmarks.common.execute``); only the trainer classes and the names of the timed methods differ. Prints one JSON
line. Never imports posttrain (it is not installed in the TRL venv; the working directory only makes ``benchmarks``
importable).

    benchmarks/.venv-trl/bin/python -m benchmarks.trl_runner --config grpo --model-path DIR --model-name tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile

from benchmarks import common

# TRL 1.16's method names: generation without tokenisation, reward functions, the log-prob forward (charged to
# "logprobs_nograd" when called for old/reference log-probs, to "loss_forward" inside compute_loss).
TRL_PHASES: common.PhaseTargets = [
    ("trainer", "_generate_single_turn", "generation"),
    ("trainer", "_calculate_rewards", "rewards"),
    ("trainer", "compute_loss", "loss_forward"),
    ("trainer", "_get_per_token_logps_and_entropies", "logprobs_nograd"),
]


def trl_trainer_classes() -> dict[str, tuple[type, type]]:
    import trl

    return {
        "grpo": (trl.GRPOConfig, trl.GRPOTrainer),
        "rloo": (trl.RLOOConfig, trl.RLOOTrainer),
        "sft": (trl.SFTConfig, trl.SFTTrainer),
        "dpo": (trl.DPOConfig, trl.DPOTrainer),
        "kto": (trl.KTOConfig, trl.KTOTrainer),
        "reward": (trl.RewardConfig, trl.RewardTrainer),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="Workload name (benchmarks.workloads.WORKLOADS).")
    parser.add_argument("--model-path", required=True, help="Saved model directory (made by posttrain's side).")
    parser.add_argument("--model-name", required=True, help="tiny | small | bigvocab (for the record).")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", default=None, help="Write a torch.profiler table of one step here.")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Config field override.")
    args = parser.parse_args(argv)

    common.env_setup(args.threads)
    from benchmarks.workloads import get_workload

    workload = get_workload(args.config)
    if args.set:
        workload = dataclasses.replace(workload, args={**workload.args, **common.parse_overrides(args.set)})
    try:
        from peft import LoraConfig
    except ImportError:
        LoraConfig = None
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        record = common.execute(
            "trl",
            workload,
            args.model_path,
            trainer_classes=trl_trainer_classes(),
            phase_targets=TRL_PHASES,
            steps=args.steps,
            warmup=args.warmup,
            model_name=args.model_name,
            output_dir=out,
            lora_config_cls=LoraConfig,
            profile_path=args.profile,
        )
    if "posttrain" in sys.modules:
        raise RuntimeError("The TRL runner imported posttrain; the comparison would not be clean.")
    if args.set:
        record["overrides"] = common.parse_overrides(args.set)
    common.emit(record)


if __name__ == "__main__":
    main()
