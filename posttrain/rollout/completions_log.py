"""``log_completions``: print a sample of the last generation batch with rich, and write it to parquet.

The table has TRL's columns: ``step``, ``prompt``, ``completion``, one column per reward function, any columns that
reward functions added with ``log_extra``, and ``advantage``. Files go to
``output_dir/completions/completions_{step:05d}.parquet``.
"""

from __future__ import annotations

import os
from typing import Any

from posttrain.rollout.pipeline import CompletionsTable


def _rows(table: CompletionsTable, unique_prompts: bool) -> list[dict[str, Any]]:
    columns = table.columns
    n = len(table)
    rows = [{k: v[i] for k, v in columns.items()} for i in range(n)]
    if unique_prompts:
        seen: set[str] = set()
        kept = []
        for row in rows:
            key = str(row.get("prompt"))
            if key not in seen:
                seen.add(key)
                kept.append(row)
        rows = kept
    return rows


def print_completions_table(
    table: CompletionsTable, step: int, num_to_print: int | None = None, unique_prompts: bool = False
) -> None:
    """Print (prompt, completion, rewards, advantage) rows with rich (TRL's ``print_prompt_completions_sample``)."""
    from rich.console import Console
    from rich.table import Table

    rows = _rows(table, unique_prompts)
    if num_to_print is not None:
        rows = rows[:num_to_print]
    if not rows:
        return
    rich_table = Table(title=f"Step {step}", show_lines=True, expand=False)
    for name in rows[0]:
        rich_table.add_column(name, overflow="fold")
    for row in rows:
        rich_table.add_row(*(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()))
    Console().print(rich_table)


def write_completions_parquet(
    table: CompletionsTable, output_dir: str | os.PathLike, step: int, unique_prompts: bool = False
) -> str:
    """Write the table to ``output_dir/completions/completions_{step:05d}.parquet``; returns the path."""
    import pandas as pd

    rows = _rows(table, unique_prompts)
    frame = pd.DataFrame([{"step": step, **row} for row in rows])
    for column in frame.columns:  # conversational prompts/completions are lists of dicts: store them as text
        if frame[column].dtype == object and any(isinstance(v, (list, dict)) for v in frame[column]):
            frame[column] = frame[column].astype(str)
    folder = os.path.join(output_dir, "completions")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"completions_{step:05d}.parquet")
    tmp = path + ".tmp"
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)
    return path
