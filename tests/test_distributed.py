"""posttrain.distributed.sum_over_processes: the identity on one process, an elementwise sum (detached, back on the
caller's device) over several; the 2-process sum itself runs under torchrun in tests/experimental/test_multiprocess.py."""

from __future__ import annotations

import pytest
import torch

from posttrain.distributed import gather_row_masked_mean, sum_over_processes


class _TwoProcesses:
    """An accelerator stand-in for 2 processes whose peer holds ``peer``: ``reduce`` adds it."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, peer: torch.Tensor):
        self.peer = peer
        self.calls = []

    def reduce(self, tensor, reduction="mean"):
        self.calls.append(reduction)
        return tensor.clone() + self.peer


def test_identity_on_one_process():
    x = torch.tensor([1.0, 2.0])
    assert sum_over_processes(None, x) is x
    assert sum_over_processes(type("One", (), {"num_processes": 1})(), x) is x


def test_sums_elementwise_over_processes_and_detaches():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    acc = _TwoProcesses(torch.tensor([10.0, 20.0]))
    total = sum_over_processes(acc, x)
    assert acc.calls == ["sum"]
    torch.testing.assert_close(total, torch.tensor([11.0, 22.0]))
    assert not total.requires_grad and x.grad is None


class _ShortLastBatch:
    """2 processes on a last batch of 3 rows: the peer holds 1 real row and 1 repeat (its row sums and counts given
    by hand); ``gather_for_metrics`` concatenates both processes' rows and drops the repeat."""

    num_processes = 2
    peer_rows = torch.tensor([[4.0, 2.0], [999.0, 3.0]])  # (Σ values·mask, Σ mask) per row; row 2 is the repeat

    def gather_for_metrics(self, rows):
        return torch.cat([rows, self.peer_rows])[:3]


def test_gather_row_masked_mean_leaves_out_the_repeated_rows():
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # (1 + 3 + 5 + 4) / (2 + 1 + 2): the peer's repeated row (999 over 3 tokens) is not counted
    assert gather_row_masked_mean(_ShortLastBatch(), values, mask) == pytest.approx(13.0 / 5.0)
    # on one process (gather_for_metrics = identity) it is the plain masked mean
    one = type("One", (), {"gather_for_metrics": staticmethod(lambda rows: rows)})()
    assert gather_row_masked_mean(one, values, mask) == 3.0
    assert gather_row_masked_mean(one, values, torch.zeros_like(mask)) != gather_row_masked_mean(one, values, mask)
