"""Entry point: ``python -m benchmarks run|compare|table|prepare|list|fidelity``.

    python -m benchmarks run --trainer grpo --model tiny [--config grpo_beta] [--steps N] [--warmup N]
    python -m benchmarks run --config grpo_realistic --impl trl          # the same workload with TRL
    python -m benchmarks run --config grpo_realistic --profile prof.txt  # torch.profiler table of one step
    python -m benchmarks compare --configs grpo grpo@small sft_packed --runs 5 [--model bigvocab] [--out results.jsonl]
    python -m benchmarks table results.jsonl                            # markdown table of the ratios
    python -m benchmarks list
    python -m benchmarks fidelity [--only dpo/ kto/] [--md benchmarks/FIDELITY.md]  # step-by-step equality with TRL

``run`` prints one JSON line (see benchmarks/README.md for the fields). ``compare`` runs posttrain and TRL in
alternating fresh processes (ABBA order per round, so drift of a shared machine cancels) and prints every run's line
plus one summary line per workload with the posttrain/TRL ratios of median step CPU time (and wall time) and peak RSS
above baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks import common
from benchmarks.workloads import DEFAULT_FOR_TRAINER, WORKLOADS, get_workload

TRL_PYTHON = common.BENCH_DIR / ".venv-trl" / "bin" / "python"

# posttrain's timed methods: generation (the backend call, without prompt rendering), the reward scorer, the no-grad
# old/reference log-prob passes, and the training loss forward (compute_loss). Backward + optimizer + the rest is
# the step time minus these.
POSTTRAIN_PHASES: common.PhaseTargets = [
    ("trainer.pipeline", "generate", "generation"),
    ("trainer.pipeline", "score", "rewards"),
    ("trainer.pipeline", "logps_in_chunks", "logprobs_nograd"),
    ("trainer", "compute_loss", "loss_forward"),
]


def posttrain_trainer_classes() -> dict[str, tuple[type, type]]:
    import posttrain

    return {
        "grpo": (posttrain.GRPOConfig, posttrain.GRPOTrainer),
        "rloo": (posttrain.RLOOConfig, posttrain.RLOOTrainer),
        "sft": (posttrain.SFTConfig, posttrain.SFTTrainer),
        "dpo": (posttrain.DPOConfig, posttrain.DPOTrainer),
        "kto": (posttrain.KTOConfig, posttrain.KTOTrainer),
        "reward": (posttrain.RewardConfig, posttrain.RewardTrainer),
    }


def _workload_from_args(args: argparse.Namespace):
    if args.config is None:
        if args.trainer is None:
            raise SystemExit("Give --trainer (grpo|rloo|sft|dpo|kto|reward) or --config (see `list`).")
        return get_workload(DEFAULT_FOR_TRAINER[args.trainer])
    workload = get_workload(args.config)
    if args.trainer is not None and args.trainer != workload.trainer:
        raise SystemExit(
            f"--config {workload.name} is a {workload.trainer} workload but --trainer is {args.trainer}; drop "
            "--trainer or pick a matching --config."
        )
    return workload


def prepare_model(workload, model: str, cache_dir: str | None) -> str:
    """The saved model for ``workload`` on ``model``, built in a child process when missing.

    A child process keeps the build (and a warm start's training) out of the measuring process's peak RSS.
    """
    path = common.model_dir(model, workload.task, warm_start=workload.warm_start, cache_dir=cache_dir)
    if (path / "config.json").is_file():
        return str(path)
    cmd = [sys.executable, "-m", "benchmarks", "prepare", "--config", workload.name, "--model", model]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    subprocess.run(cmd, check=True, cwd=common.REPO_ROOT)
    return str(path)


# -- run ---------------------------------------------------------------------------------------------------------
def _parse_overrides(items: list[str]) -> dict[str, Any]:
    try:
        return common.parse_overrides(items)
    except ValueError as error:
        raise SystemExit(str(error)) from None


def cmd_run(args: argparse.Namespace) -> dict[str, Any]:
    workload = _workload_from_args(args)
    model = args.model or workload.model
    steps = args.steps if args.steps is not None else workload.steps
    warmup = args.warmup if args.warmup is not None else workload.warmup
    model_path = prepare_model(workload, model, args.cache_dir)
    if args.both and args.impl == "trl":
        return run_trl(workload.name, model, model_path, steps, warmup, args.threads, args.profile, args.both)
    if args.set or args.both:
        if args.impl == "trl" and args.set:
            raise SystemExit("--set overrides posttrain's config only; drop it with --impl trl (--both: both sides).")
        workload = dataclasses.replace(workload, args={**workload.args, **_parse_overrides(args.set + args.both)})
    if args.impl == "trl":
        return run_trl(workload.name, model, model_path, steps, warmup, args.threads, args.profile)
    common.env_setup(args.threads)
    try:
        from peft import LoraConfig
    except ImportError:
        LoraConfig = None
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as out:
        record = common.execute(
            "posttrain",
            workload,
            model_path,
            trainer_classes=posttrain_trainer_classes(),
            phase_targets=POSTTRAIN_PHASES,
            steps=steps,
            warmup=warmup,
            model_name=model,
            output_dir=out,
            lora_config_cls=LoraConfig,
            profile_path=args.profile,
        )
    if args.both:
        record["overrides"] = _parse_overrides(args.both)
    common.emit(record)
    return record


def run_trl(
    config: str,
    model: str,
    model_path: str,
    steps: int,
    warmup: int,
    threads: int,
    profile: str | None,
    both: list[str] | None = None,
) -> dict[str, Any]:
    if not TRL_PYTHON.exists():
        raise SystemExit(f"No TRL venv at {TRL_PYTHON.parent.parent}; create it with: bash benchmarks/setup_trl.sh")
    cmd = [str(TRL_PYTHON), "-m", "benchmarks.trl_runner", "--config", config, "--model-path", model_path]
    cmd += ["--model-name", model, "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    if profile:
        cmd += ["--profile", profile]
    for item in both or []:
        cmd += ["--set", item]
    record = _child(cmd)
    common.emit(record)
    return record


def _child(cmd: list[str]) -> dict[str, Any]:
    """Run a runner in a fresh process (its own peak RSS) and return its JSON record."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run(cmd, cwd=common.REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return common.parse_record(done.stdout)


# -- compare -----------------------------------------------------------------------------------------------------
def _posttrain_cmd(
    config: str,
    model: str,
    steps: int,
    warmup: int,
    threads: int,
    cache_dir: str | None,
    both: list[str] | None = None,
) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks", "run", "--config", config, "--model", model]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    for item in both or []:
        cmd += ["--both", item]
    return cmd


def summarize(config: str, model: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios posttrain/TRL: of the medians over runs, and the median of per-round (interleaved) ratios."""
    by_impl = {impl: [r for r in records if r["impl"] == impl] for impl in ("posttrain", "trl")}
    out: dict[str, Any] = {"summary": True, "config": config, "model": model, "runs": len(by_impl["trl"])}
    # With num_iterations > 1 steps alternate between generating and reusing a batch: the median of such a bimodal
    # list is meaningless, the mean over whole cycles is not.
    cycles = config in WORKLOADS and WORKLOADS[config].args.get("num_iterations", 1) > 1
    statistic = "mean" if cycles else "median"
    out["step_statistic"] = statistic
    for key, name in (
        (f"{statistic}_step_cpu_s", "time"),  # CPU time: robust to the load of a shared machine
        (f"{statistic}_step_s", "wall_time"),
        ("peak_rss_mib", "peak_rss"),
        ("peak_rss_above_interpreter_mib", "rss_interp"),
        ("peak_rss_above_model_mib", "rss_model"),
        ("adam_floor_mib", "adam_floor"),
        ("model_param_mib", "model_param"),
        ("tokens_per_s", "tokens_per_s"),
    ):
        values = {impl: [r[key] for r in rs if r.get(key) is not None] for impl, rs in by_impl.items()}
        if not values["posttrain"] or not values["trl"]:
            continue
        med = {impl: statistics.median(v) for impl, v in values.items()}
        out[f"{name}_posttrain"] = round(med["posttrain"], 5)
        out[f"{name}_trl"] = round(med["trl"], 5)
        if med["trl"] > 0:
            out[f"{name}_ratio"] = round(med["posttrain"] / med["trl"], 3)
        paired = [p / t for p, t in zip(values["posttrain"], values["trl"]) if t > 0]
        if paired:
            out[f"{name}_ratio_paired_median"] = round(statistics.median(paired), 3)
    for impl, rs in by_impl.items():
        shares = [r["generation_share"] for r in rs if r.get("generation_share") is not None]
        if shares:
            out[f"generation_share_{impl}"] = round(statistics.median(shares), 3)
        losses = [r["final_loss"] for r in rs if r.get("final_loss") is not None]
        if losses:
            out[f"final_loss_{impl}"] = round(statistics.median(losses), 5)
        for key in common.TRACKED_METRICS[:2]:  # completion lengths: both sides sampled comparable workloads
            values = [r[key] for r in rs if r.get(key) is not None]
            if values:
                out[f"{key}_{impl}"] = round(statistics.median(values), 3)
    out["load_avg_1m"] = [r.get("load_avg_1m") for r in records]
    return out


def cmd_compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not TRL_PYTHON.exists():
        raise SystemExit(f"No TRL venv at {TRL_PYTHON.parent.parent}; create it with: bash benchmarks/setup_trl.sh")
    pairs = []
    for spec in args.configs:
        config, _, spec_model = spec.partition("@")
        workload = get_workload(config)
        if spec_model and spec_model not in common.MODEL_SPECS:
            raise SystemExit(f"Unknown model in {spec!r}. Valid: {', '.join(common.MODEL_SPECS)}.")
        model = spec_model or args.model or workload.model
        steps = args.steps if args.steps is not None else workload.steps
        warmup = args.warmup if args.warmup is not None else workload.warmup
        pairs.append((workload, model, steps, warmup, prepare_model(workload, model, args.cache_dir)))
    out_file = open(args.out, "a") if args.out else None  # noqa: SIM115 (kept open across the whole comparison)
    records: dict[tuple[str, str], list[dict[str, Any]]] = {(w.name, m): [] for w, m, *_ in pairs}
    summaries = []
    try:
        for round_index in range(args.runs):
            for workload, model, steps, warmup, path in pairs:
                posttrain_cmd = _posttrain_cmd(
                    workload.name, model, steps, warmup, args.threads, args.cache_dir, args.both
                )
                trl_cmd = [str(TRL_PYTHON), "-m", "benchmarks.trl_runner", "--config", workload.name]
                trl_cmd += ["--model-path", path, "--model-name", model, "--steps", str(steps)]
                trl_cmd += ["--warmup", str(warmup), "--threads", str(args.threads)]
                for item in args.both:
                    trl_cmd += ["--set", item]
                order = [("posttrain", posttrain_cmd), ("trl", trl_cmd)]
                if round_index % 2 == 1:  # ABBA: alternate who goes first
                    order.reverse()
                for impl, cmd in order:
                    try:
                        record = _child(cmd)
                    except RuntimeError as error:  # e.g. the checkout changed under a long comparison: keep going
                        failure = {"error": str(error)[-2000:], "impl": impl, "config": workload.name}
                        common.emit({**failure, "model": model, "round": round_index})
                        continue
                    record["round"] = round_index
                    records[(workload.name, model)].append(record)
                    common.emit(record)
                    if out_file:
                        out_file.write(json.dumps(record) + "\n")
                        out_file.flush()
        for workload, model, *_ in pairs:
            summary = summarize(workload.name, model, records[(workload.name, model)])
            if args.both:
                summary["overrides"] = _parse_overrides(args.both)
            summaries.append(summary)
            common.emit(summary)
            if out_file:
                out_file.write(json.dumps(summary) + "\n")
    finally:
        if out_file:
            out_file.close()
    return summaries


# -- table -------------------------------------------------------------------------------------------------------
def cmd_table(args: argparse.Namespace) -> None:
    """Markdown table of posttrain/TRL ratios from ``compare --out`` files (summaries recomputed from the runs)."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in args.files:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if not record.get("summary") and not record.get("error"):
                    config = record["config"]
                    for key, value in sorted(record.get("overrides", {}).items()):  # --both runs: own rows
                        config += f" {key}={json.dumps(value)}"
                    runs.setdefault((config, record["model"]), []).append(record)
    print(
        "| config | model | runs | wall s/step posttrain | TRL | **wall ratio** | paired | CPU s/step posttrain | TRL "
        "| CPU ratio | peak RSS above interpreter posttrain / TRL (MiB) | **ratio** | above loaded model posttrain / "
        "TRL (MiB) | ratio | posttrain (model + above it) / fp32 Adam floor (MiB) | above trainer build (MiB) ratio | gen. share posttrain / "
        "TRL | mean completion length posttrain / TRL | load avg (1 min) |"
    )
    print("| --- " * 19 + "|")
    for (config, model), records in runs.items():
        s = summarize(config, model, records)

        def get(key: str, fmt: str = "{:.3f}", s: dict[str, Any] = s) -> str:
            return fmt.format(s[key]) if s.get(key) is not None else "–"

        def pair(key: str, fmt: str = "{:.0f}") -> str:
            return f"{get(key + '_posttrain', fmt)} / {get(key + '_trl', fmt)}"

        # training state as the Adam floor counts it: the weights plus everything the run added above them
        floor = "–"
        if s.get("rss_model_posttrain") is not None and s.get("adam_floor_posttrain"):
            held = s["rss_model_posttrain"] + s.get("model_param_posttrain", 0.0)
            floor = f"{held / s['adam_floor_posttrain']:.2f} (floor {s['adam_floor_posttrain']:.1f})"
        loads = [x for x in s["load_avg_1m"] if x is not None]
        load = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "–"
        print(
            f"| {config} | {model} | {s['runs']} | {get('wall_time_posttrain')} | {get('wall_time_trl')} | "
            f"**{get('wall_time_ratio', '{:.2f}')}** | {get('wall_time_ratio_paired_median', '{:.2f}')} | "
            f"{get('time_posttrain')} | {get('time_trl')} | {get('time_ratio', '{:.2f}')} | "
            f"{pair('rss_interp')} | **{get('rss_interp_ratio', '{:.2f}')}** | {pair('rss_model')} | "
            f"{get('rss_model_ratio', '{:.2f}')} | {floor} | {get('peak_rss_ratio', '{:.2f}')} | "
            f"{pair('generation_share', '{:.2f}')} | {pair('completions/mean_length', '{:.1f}')} | {load} |"
        )


# -- fidelity ----------------------------------------------------------------------------------------------------
def cmd_fidelity(args: argparse.Namespace) -> list[Any]:
    """Every selected scenario with posttrain and with TRL (one child process each), compared step by step."""
    from benchmarks import fidelity

    if not TRL_PYTHON.exists():
        raise SystemExit(f"No TRL venv at {TRL_PYTHON.parent.parent}; create it with: bash benchmarks/setup_trl.sh")
    scenarios = fidelity.select(args.only)
    if args.steps is not None:
        scenarios = [dataclasses.replace(s, steps=args.steps) for s in scenarios]
        fidelity.SCENARIOS.update({s.name: s for s in scenarios})
    if not scenarios:
        raise SystemExit(f"No scenario matches {args.only}; names: {', '.join(fidelity.SCENARIOS)}")
    common.env_setup(1)
    causal = common.ensure_model("tiny", "causal-lm", cache_dir=args.cache_dir)
    seqcls = common.ensure_model("tiny", "sequence-classification", cache_dir=args.cache_dir)
    qwen3 = fidelity.ensure_qwen3_copy(causal)
    no_newline = fidelity.ensure_no_newline_copy(causal)
    # Teachers (GKD, distillation): the tiny causal LM after a few supervised steps, so teacher != student.
    teacher = common.ensure_model("tiny", "causal-lm", warm_start="varied_eos", cache_dir=args.cache_dir)
    # Tiny VLMs (vlm/ scenarios), saved only when a selected scenario needs one
    families = sorted({s.task[len("vlm-") :] for s in scenarios if s.task.startswith("vlm-")})
    vlms = {family: fidelity.ensure_tiny_vlm(causal, family) for family in families}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        names = os.path.join(tmp, "names.txt")
        with open(names, "w") as f:
            f.write("\n".join(s.name for s in scenarios))
        steps_flag = [] if args.steps is None else ["--steps", str(args.steps)]
        for impl, python in (("posttrain", sys.executable), ("trl", str(TRL_PYTHON))):
            out = os.path.join(tmp, f"{impl}.json")
            cmd = [python, "-m", "benchmarks.fidelity_runner", "--impl", impl, "--names-file", names]
            cmd += ["--causal", causal, "--seqcls", seqcls, "--qwen3", qwen3, "--no-newline", no_newline]
            cmd += ["--teacher", teacher, "--out", out, *steps_flag]
            if vlms:
                cmd += ["--vlm", *(f"{family}={path}" for family, path in vlms.items())]
            env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
            if impl == "trl":
                env.pop("PYTHONPATH", None)
            else:
                env["PYTHONPATH"] = str(common.REPO_ROOT)
            done = subprocess.run(cmd, cwd=common.REPO_ROOT, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{impl} runner failed ({done.returncode}):\n{done.stderr[-4000:]}")
            with open(out) as f:
                results[impl] = json.load(f)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(results, f)
    comparisons = [
        fidelity.compare(s.name, results["posttrain"][s.name], results["trl"][s.name], keys=s.compare_keys)
        for s in scenarios
    ]
    table = fidelity.markdown_table(comparisons, fidelity.KNOWN_DIFFERENCES)
    print(table)
    counts = {status: sum(c.status == status for c in comparisons) for status in ("equal", "differs", "error")}
    counts["known"] = sum(fidelity.known_difference(c) is not None for c in comparisons)
    print(f"\n{counts['equal']} equal, {counts['differs']} differ, {counts['error']} errors "
          f"({counts['known']} of them understood, see the table; of {len(comparisons)}; "
          f"rel. tolerance {fidelity.REL_TOL})")
    if args.md:
        fidelity.write_markdown(args.md, table, counts, results["posttrain"].get("_versions"),
                                results["trl"].get("_versions"), rerun=args.only)
    return comparisons


# -- prepare / list ----------------------------------------------------------------------------------------------
def cmd_prepare(args: argparse.Namespace) -> None:
    workload = get_workload(args.config)
    common.env_setup(threads=max(1, os.cpu_count() or 1))
    path = common.ensure_model(
        args.model or workload.model, workload.task, warm_start=workload.warm_start, cache_dir=args.cache_dir
    )
    print(path, file=sys.stderr)


def cmd_list(args: argparse.Namespace) -> None:
    for w in WORKLOADS.values():
        print(f"{w.name:16s} {w.trainer:7s} model={w.model:8s} steps={w.steps} warmup={w.warmup}  {w.description}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", choices=list(common.MODEL_SPECS), default=None, help="Default: the workload's.")
        p.add_argument("--steps", type=int, default=None, help="Timed optimizer steps (default: the workload's).")
        p.add_argument("--warmup", type=int, default=None, help="Untimed optimizer steps first.")
        p.add_argument("--threads", type=int, default=1, help="torch threads (1 for stable timings).")
        p.add_argument("--cache-dir", default=None, help=f"Saved models (default {common.DEFAULT_CACHE_DIR}).")
        p.add_argument(
            "--both",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="Override a config field (TRL's name) for posttrain AND TRL, e.g. --both gradient_checkpointing=false "
            "(repeatable; recorded as `overrides`).",
        )

    run = sub.add_parser("run", help="One run, one JSON line.")
    run.add_argument("--trainer", choices=list(DEFAULT_FOR_TRAINER), default=None)
    run.add_argument("--config", choices=list(WORKLOADS), default=None, help="Workload (default: the trainer's).")
    run.add_argument("--impl", choices=["posttrain", "trl"], default="posttrain")
    run.add_argument("--profile", default=None, help="Profile one step after warm-up; write the table here.")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a posttrain config field for an A/B run, e.g. --set shared_prompt_forward=false (repeatable).",
    )
    common_flags(run)
    run.set_defaults(func=cmd_run)

    compare = sub.add_parser("compare", help="posttrain vs TRL, interleaved runs, ratio summary.")
    compare.add_argument(
        "--configs", nargs="+", required=True, help="Workloads, each optionally @model (grpo@small); see `list`."
    )
    compare.add_argument("--runs", type=int, default=5, help="Runs per library and workload (>= 5 for RESULTS.md).")
    compare.add_argument("--out", default=None, help="Append every JSON line to this file too.")
    common_flags(compare)
    compare.set_defaults(func=cmd_compare)

    prepare = sub.add_parser("prepare", help="Build and save (cache) the model of a workload.")
    prepare.add_argument("--config", choices=list(WORKLOADS), required=True)
    prepare.add_argument("--model", choices=list(common.MODEL_SPECS), default=None)
    prepare.add_argument("--cache-dir", default=None)
    prepare.set_defaults(func=cmd_prepare)

    table = sub.add_parser("table", help="Markdown ratio table from `compare --out` JSONL files.")
    table.add_argument("files", nargs="+")
    table.set_defaults(func=cmd_table)

    fid = sub.add_parser("fidelity", help="Step-by-step equality of posttrain and TRL on deterministic scenarios.")
    fid.add_argument("--only", nargs="*", default=None, help="Scenario name substrings (e.g. dpo/ kto/kto).")
    fid.add_argument("--steps", type=int, default=None, help="Optimizer steps per scenario (default: its own, 3).")
    fid.add_argument("--md", default=None, help="Write the result table to this markdown file (FIDELITY.md).")
    fid.add_argument("--save", default=None, help="Write both sides' raw per-step logs to this JSON file.")
    fid.add_argument("--cache-dir", default=None)
    fid.set_defaults(func=cmd_fidelity)

    lister = sub.add_parser("list", help="The workloads.")
    lister.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
