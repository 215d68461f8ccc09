"""Fixtures for the command-line tests: environment isolation, an in-process runner, tiny data files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch, tmp_path_factory):
    """Undo environment changes made by runs (recipe `env:` blocks, launch variables) and hide any user-level
    default accelerate config, which would otherwise change how many processes a run starts."""
    import accelerate.commands.config as accelerate_config

    saved = dict(os.environ)
    missing = tmp_path_factory.mktemp("no-accelerate-config") / "default_config.yaml"
    monkeypatch.setattr(accelerate_config, "default_config_file", str(missing))
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture()
def run_cli(capsys):
    """Run ``posttrain ARGS`` in this process; return (exit code, stdout, stderr)."""
    from posttrain.cli.main import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # --help / --version
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture()
def write_jsonl():
    """``write_jsonl(path, rows) -> str``."""
    return _write_jsonl


@pytest.fixture()
def sft_jsonl(tmp_path) -> str:
    rows = [
        {"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": str(i + 1)}]}
        for i in range(8)
    ]
    return _write_jsonl(tmp_path / "sft.jsonl", rows)


@pytest.fixture()
def prompts_jsonl(tmp_path) -> str:
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1?"}], "solution": f"${i + 1}$"} for i in range(8)]
    return _write_jsonl(tmp_path / "prompts.jsonl", rows)


@pytest.fixture()
def read_metrics():
    """``read_metrics(output_dir) -> list[dict]`` from ``metrics.jsonl``."""

    def read(output_dir) -> list[dict]:
        path = Path(output_dir) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    return read


@pytest.fixture()
def repo_root() -> Path:
    return REPO_ROOT
