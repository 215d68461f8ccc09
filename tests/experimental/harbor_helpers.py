"""Shared pieces of the Harbor tests: the example suite's path, a task-directory builder, the bubblewrap skip."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from posttrain.rewards.sandbox import sandbox_capabilities

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_TASKS = ROOT / "examples" / "harbor_tasks"
HARNESSES = ROOT / "examples" / "harbor_harnesses.py"
TASK_NAMES = ["count-errors", "fix-mean", "hello-file", "rename-photos", "write-config"]

_CAPS = sandbox_capabilities()
needs_bwrap = pytest.mark.skipif(
    _CAPS["isolation"] != "bwrap", reason=f"bubblewrap sandbox unavailable: {_CAPS['reason']}"
)


def make_task(
    root: Path,
    name: str,
    test_sh: str,
    *,
    instruction: str = "Do the thing.",
    toml: str = 'version = "1.0"\n',
    dockerfile: str | None = None,
    files: dict[str, str] | None = None,
    test_files: dict[str, str] | None = None,
) -> Path:
    """A Harbor task directory under ``root``: ``files`` go to ``environment/``, ``test_files`` to ``tests/``."""
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text(instruction)
    (task / "task.toml").write_text(toml)
    (task / "tests" / "test.sh").write_text(textwrap.dedent(test_sh).lstrip())
    os.chmod(task / "tests" / "test.sh", 0o755)
    if dockerfile is not None:
        (task / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile).lstrip())
    for rel, text in (files or {}).items():
        (task / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / "environment" / rel).write_text(text)
    for rel, text in (test_files or {}).items():
        (task / "tests" / rel).write_text(text)
    return task


def solution(task_name: str) -> str:
    """The example task's reference solution (its ``solution/solve.sh``)."""
    return (EXAMPLE_TASKS / task_name / "solution" / "solve.sh").read_text()
