"""Shared fixtures for the data-layer tests: the offline tiny tokenizer and message builders."""

import pytest

from posttrain.data import tokenization
from posttrain.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _reset_warn_once():
    # tokenization warns once per process; tests that check the warning need a clean slate
    tokenization._WARNED.clear()
    tokenization._CHECKED_TEMPLATES.clear()
    yield


@pytest.fixture(scope="session", autouse=True)
def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    yield
