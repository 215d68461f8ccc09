"""What both demos share (``posttrain demo`` and ``posttrain demo --task agent``): the recipes folder, writing the
generated data, running a stage through the ``posttrain <verb>`` code path, and printing the before/after table."""

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
