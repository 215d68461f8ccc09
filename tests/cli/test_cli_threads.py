"""The `posttrain` command's thread environment: OpenMP worker threads sleep when idle instead of spinning."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest

cli_main = importlib.import_module("posttrain.cli.main")  # the module (posttrain.cli.main is also a function)


@pytest.fixture
def probe(monkeypatch):
    """A sub-command that records OMP_WAIT_POLICY as the sub-command sees it."""
    seen: list[str | None] = []
    module = types.ModuleType("_posttrain_thread_probe")
    module.run = lambda argv: seen.append(os.environ.get("OMP_WAIT_POLICY")) or 0
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli_main.COMMANDS, "probe", (f"{module.__name__}:run", "test probe"))
    return seen


def test_sub_commands_run_with_a_passive_openmp_wait_policy(probe, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli_main.main(["probe"]) == 0
    assert probe == ["PASSIVE"]


def test_a_wait_policy_the_user_set_is_kept(probe, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cli_main.main(["probe"]) == 0
    assert probe == ["ACTIVE"]


def test_the_policy_is_set_before_torch_loads_openmp():
    # OpenMP reads OMP_WAIT_POLICY once, when torch loads it: main() sets it, then the sub-command imports torch.
    # That holds only while importing the entry point does not import torch.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, posttrain.cli.main; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert "torch" not in loaded
