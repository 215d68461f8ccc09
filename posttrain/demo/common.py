"""What both demos share (``posttrain demo`` and ``posttrain demo --task agent``): the recipes folder, writing the
generated data, running a stage through the ``posttrain <verb>`` code path, printing the before/after table, and the shared part of
``summary.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path

RECIPES = Path(__file__).resolve().parent / "recipes"


def _write_jsonl(path: Path, dataset) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for row in dataset:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return str(path)


def _stage(verb: str, argv: list[str]) -> None:
    from posttrain.cli.run import run_training_command

    code = run_training_command(verb, argv)
    if code != 0:
        raise SystemExit(f"posttrain demo: the {verb} stage failed (exit code {code}); see the message above.")


def _print_table(
    metrics: dict[str, dict[str, tuple[float, float]]], gains: dict, verdict: str, n_eval: int | str
) -> None:
    """Print the before/after table; ``n_eval`` is the held-out problem count, or the whole title as a string."""
    from rich.console import Console
    from rich.table import Table

    title = n_eval if isinstance(n_eval, str) else None
    table = Table(
        title=title or f"posttrain demo: {n_eval} held-out problems (operand pairs never seen in training), ± s.e."
    )
    table.add_column("metric")
    for stage in metrics:
        table.add_column(stage, justify="right")
    table.add_column("change (paired)", justify="right")
    first = next(iter(metrics.values()))
    for name in first:
        cells = [f"{metrics[stage][name][0]:.3f} ± {metrics[stage][name][1]:.3f}" for stage in metrics]
        if "tokens" in name:
            cells = [f"{metrics[stage][name][0]:.1f}" for stage in metrics]
        gain = gains.get(name)
        table.add_row(name, *cells, f"{gain[0]:+.3f} ± {gain[1]:.3f}" if gain else "")
    console = Console(width=max(Console().width, 104))
    console.print(table)
    console.print(verdict)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def demo_summary(
    *,
    mode: str,
    seed: int,
    timings: dict,
    n_eval: int,
    n_samples: int,
    after_sft,
    after_grpo,
    metrics: dict[str, dict[str, tuple[float, float]]],
    gains: dict[str, tuple[float, float]],
    verdict: str,
    out: Path,
    extra: dict | None = None,
) -> dict:
    """The ``summary.json`` fields both demos share, plus the demo's own ``extra`` ones (its task, headline gains).

    ``after_sft`` / ``after_grpo`` are the stages' evaluation results (anything with ``row()``: ``{metric: mean}``);
    ``metrics`` is ``{"after SFT": {metric: (mean, s.e.)}, "after GRPO": {...}}`` and ``gains`` ``{metric: (paired
    change, s.e.)}``. ``timings`` must already hold ``total_wall_s``. The report page is added by the caller once it
    is written (``summary["report"]``).
    """
    return {
        **(extra or {}),
        "mode": mode,
        "seed": seed,
        "seconds": timings["total_wall_s"],
        "timings": timings,
        "torch_threads": _torch_threads(),
        "eval_problems": n_eval,
        "eval_samples_per_problem": n_samples,
        "after_sft": after_sft.row(),
        "after_grpo": after_grpo.row(),
        "standard_errors": {
            stage: {k: se for k, (_, se) in metrics[name].items()}
            for stage, name in (("after_sft", "after SFT"), ("after_grpo", "after GRPO"))
        },
        "gains": {k: {"mean": g, "standard_error": se} for k, (g, se) in gains.items()},
        "verdict": verdict,
        "stage_reports": {stage: str(out / stage / "report" / "index.html") for stage in ("sft", "grpo")},
    }


def finish_demo(tag: str, summary: dict, out: Path) -> None:
    """Write ``out/summary.json`` and print the closing line (times, report and summary paths)."""
    timings = summary["timings"]
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    print(
        f"[{tag}] finished in {timings['total_wall_s']:.0f} s wall / {timings['total_cpu_s']:.0f} s CPU "
        f"(SFT {timings.get('sft_wall_s', 0):.0f} s, GRPO {timings['grpo_wall_s']:.0f} s, evaluation "
        f"{timings['eval_sft_wall_s'] + timings['eval_grpo_wall_s']:.0f} s). Report: {summary['report']}; "
        f"summary: {out / 'summary.json'}",
        flush=True,
    )
