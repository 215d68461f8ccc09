"""The experimental trainers' tests reuse the stable trainers' helpers (tests/trainers/trainer_helpers.py) and run
with the experimental notice silenced (its own tests check it)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

_TRAINERS = str(Path(__file__).resolve().parents[1] / "trainers")
if _TRAINERS not in sys.path:
    sys.path.insert(0, _TRAINERS)

from distill_helpers import abc_teacher_path, merged_teacher_path  # noqa: E402, F401  (distillation-family teachers)


@pytest.fixture(scope="module")
def served_url(tiny_model_path):
    """A `posttrain serve` app on loopback holding the tiny model (the self-distillation trainers' served teacher)."""
    pytest.importorskip("fastapi")
    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.engine import PosttrainEngine

    with serve_in_thread(PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")) as url:
        yield url


@pytest.fixture()
def no_leaked_children():
    """Fail a test that leaves a child process (the async trainers' rollout workers) behind, killing it first so
    one bug does not cascade."""
    yield
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
        child.join(5)
    assert not children, f"leaked processes: {children}"
