"""Reliability tests: one intra-op thread, so in-process runs are fast and stable on the shared 2-core machine."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
