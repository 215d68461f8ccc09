"""Every module under posttrain/core/ imports without pulling in transformers, accelerate, datasets or vllm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import posttrain

CORE_DIR = Path(posttrain.__file__).resolve().parent / "core"
HEAVY = ["transformers", "accelerate", "datasets", "vllm", "peft", "trl"]


def test_core_modules_import_only_torch():
    modules = sorted(f"posttrain.core.{p.stem}" for p in CORE_DIR.glob("*.py") if p.stem != "__init__")
    assert "posttrain.core.logprobs" in modules  # the glob found the package
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, f'posttrain.core imported {heavy}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
