"""posttrain.distributed.sum_over_processes: the identity on one process, an elementwise sum (detached, back on the
caller's device) over several; the 2-process sum itself runs under torchrun in tests/experimental/test_multiprocess.py."""

from __future__ import annotations

import torch

from posttrain.distributed import sum_over_processes


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
