"""Hand-computed values of the sparse-support (teacher top-k) divergence with and without the tail bucket, and of
the IW-OPD prefix weights and loss."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.distill import add_tail_bucket, iw_opd_loss, iw_opd_weights, sparse_support_divergence


def _lp(*values):
    return torch.tensor([[math.log(v) for v in values]], dtype=torch.float64)


def test_tail_bucket_holds_the_rest_of_the_mass():
    log_probs, mask = add_tail_bucket(_lp(0.5, 0.2), torch.tensor([[True, True]]))
    assert torch.allclose(log_probs.exp(), torch.tensor([[0.5, 0.2, 0.3]], dtype=torch.float64))
    assert mask.tolist() == [[True, True, True]]


@pytest.mark.parametrize(
    "beta, expected",
    [
        (0.0, 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)),  # KL(T||S) over {top-1, tail}
        (1.0, 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)),  # KL(S||T)
        (
            0.5,
            0.5 * (0.8 * math.log(0.8 / 0.65) + 0.2 * math.log(0.2 / 0.35))
            + 0.5 * (0.5 * math.log(0.5 / 0.65) + 0.5 * math.log(0.5 / 0.35)),
        ),
    ],
)
def test_top1_with_tail(beta, expected):
    out = sparse_support_divergence(_lp(0.5), _lp(0.8), torch.tensor([[True]]), beta=beta, add_tail=True)
    assert out.item() == pytest.approx(expected, rel=1e-9)


def test_renormalised_without_tail_and_masked_entries_ignored():
    out = sparse_support_divergence(_lp(0.3, 0.1), _lp(0.2, 0.2), torch.tensor([[True, True]]), beta=0.0, add_tail=False)
    assert out.item() == pytest.approx(0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25), rel=1e-9)
    # the second entry is outside the support: both sides renormalise to 1 on the first -> 0 divergence
    masked = sparse_support_divergence(_lp(0.3, 0.1), _lp(0.2, 0.9), torch.tensor([[True, False]]), beta=0.5, add_tail=False)
    assert masked.item() == pytest.approx(0.0, abs=1e-12)
    # with a tail, the masked entry's mass belongs to the tail: {0.3, 0.7} vs {0.2, 0.8}
    tail = sparse_support_divergence(_lp(0.3, 0.1), _lp(0.2, 0.9), torch.tensor([[True, False]]), beta=0.0)
    assert tail.item() == pytest.approx(0.2 * math.log(0.2 / 0.3) + 0.8 * math.log(0.8 / 0.7), rel=1e-9)


def test_sparse_gradient_flows_to_student_only_and_is_finite():
    student = _lp(0.5, 0.1).requires_grad_(True)
    out = sparse_support_divergence(student, _lp(0.6, 0.3), torch.tensor([[True, False]]), beta=0.5)
    out.sum().backward()
    assert torch.isfinite(student.grad).all() and student.grad[0, 1] == 0


def test_iw_opd_weights_and_loss_by_hand():
    student = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-0.5, -2.5, -3.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    # a = [0.5, -0.5, 0, (masked)]; |a| total 1; prefix [0, .5, 1] -> w = 1 + 0.5 (1 - prefix) = [1.5, 1.25, 1.0]
    weights = iw_opd_weights(teacher - student.detach(), mask, gamma=0.5)
    assert weights[0, :3].tolist() == pytest.approx([1.5, 1.25, 1.0])
    loss, adv, w = iw_opd_loss(student, teacher, mask, gamma=0.5)
    assert adv[0, :3].tolist() == pytest.approx([0.75, -0.625, 0.0])
    assert loss[0].tolist() == pytest.approx([0.75, -1.25, 0.0, 0.0])
    loss.sum().backward()
    assert student.grad[0].tolist() == pytest.approx([-0.75, 0.625, 0.0, 0.0])  # d(-w a s)/ds, a detached


def test_iw_opd_rollout_logprobs_and_zero_gamma():
    student = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    rollout = torch.tensor([[-2.0, -1.0]], dtype=torch.float64)
    teacher = torch.tensor([[-1.0, -3.0]], dtype=torch.float64)
    # a = teacher - rollout = [1, -2]; |a| total 3; prefix [0, 1] -> w = [2, 1 + (1 - 1/3)] with gamma = 1
    _, adv, w = iw_opd_loss(student, teacher, torch.ones(1, 2), gamma=1.0, rollout_logprobs=rollout)
    assert w[0].tolist() == pytest.approx([2.0, 5.0 / 3.0])
    assert adv[0].tolist() == pytest.approx([2.0, -10.0 / 3.0])
    _, adv0, w0 = iw_opd_loss(student, teacher, torch.ones(1, 2), gamma=0.0, rollout_logprobs=rollout)
    assert w0.tolist() == [[1.0, 1.0]] and adv0[0].tolist() == pytest.approx([1.0, -2.0])


@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_sparse_gradient_is_finite_with_entries_outside_the_support(beta, add_tail):
    """A masked entry (a duplicate of the support, e.g. teacher top-1 == sampled token) must not turn the gradient
    into NaN; without the tail the renormalisation used to spread −inf − (−inf) over the whole row."""
    student = _lp(0.3, 0.1).requires_grad_(True)
    out = sparse_support_divergence(student, _lp(0.2, 0.2), torch.tensor([[True, False]]), beta=beta, add_tail=add_tail)
    (grad,) = torch.autograd.grad(out.sum(), student)
    assert torch.isfinite(grad).all() and grad[0, 1] == 0
    if not add_tail:  # one entry left: both renormalise to 1
        assert out.item() == 0.0 and grad[0, 0] == 0
