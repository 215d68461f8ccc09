"""Shared fixtures: offline tiny models saved once per session, deterministic seeds, offline hub."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


def pytest_collection_modifyitems(config, items):
    """Move ``run_first`` tests (one run of several minutes, e.g. the full agent demo) to the front, keeping every
    other test in its order. Under ``pytest -n 2`` the first tests are handed out first, so the long one runs beside
    the rest of the suite instead of alone at its end (it did: the suite's wall time went from ~11 to ~20 minutes).
    The order is the same in every xdist worker (a stable sort of the same collection)."""
    items.sort(key=lambda item: item.get_closest_marker("run_first") is None)


def pytest_configure(config):
    # The suite runs with one worker per core (pytest -n 2); tiny matmuls are much faster single-threaded than
    # with two workers each spawning threads over the same two cores.
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    import random

    import torch

    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A saved tiny Qwen2 causal LM + byte-level tokenizer (loadable by path)."""
    from posttrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    from posttrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_reward_model_path(tmp_path_factory) -> str:
    """A saved tiny Qwen2 sequence classifier with one label."""
    from posttrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-rm"), arch="qwen2", task="sequence-classification")


@pytest.fixture()
def tiny_tokenizer():
    from posttrain.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


# Trainer tests don't need the end-of-training HTML report; tests/report turns it back on explicitly.
os.environ.setdefault("POSTTRAIN_NO_REPORT", "1")


@pytest.fixture()
def sandbox_lock():
    """Serialise tests that start sandboxed programs, across pytest-xdist workers and concurrent runs.

    The sandbox tests check host-wide state (no process left under a sandbox uid, no sandbox temp dir left), which
    another worker's sandbox run would disturb.
    """
    import fcntl
    import tempfile

    path = os.path.join(tempfile.gettempdir(), "posttrain-sandbox-tests.lock")
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
