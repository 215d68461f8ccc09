"""Hand-computed values of the self-distillation losses (SDFT / SDPO): top-k (renormalised and with a tail bucket),
full-logit and sampled-token, TRL's importance-sampling clipping and the sequence-mean aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.self_distillation import (
    DISTILLATION_MODES,
    apply_importance_sampling_clipping,
    compute_divergence,
    compute_full_logit_self_distillation_loss,
    compute_sampled_token_self_distillation_loss,
    compute_self_distillation_per_token_loss,
    compute_topk_self_distillation_loss,
    sampled_token_self_distillation_loss_from_logps,
    self_distillation_loss,
)


def _logits(*probs):
    """(1, V) logits whose softmax is ``probs`` (float64)."""
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


# Student (0.5, 0.3, 0.2): its top-2 support is {0, 1}. Teacher (0.1, 0.6, 0.3): the teacher's own top-2 would be
# {1, 2}, so a wrong support choice changes the numbers.
S, T = (0.5, 0.3, 0.2), (0.1, 0.6, 0.3)
S2, T2 = (0.5 / 0.8, 0.3 / 0.8), (0.1 / 0.7, 0.6 / 0.7)  # renormalised over {0, 1}


def _jsd(p, q, alpha):
    m = [(1 - alpha) * a + alpha * b for a, b in zip(p, q)]
    return alpha * _kl(q, m) + (1 - alpha) * _kl(p, m)


@pytest.mark.parametrize(
    "alpha, expected",
    [(0.0, _kl(T, S)), (1.0, _kl(S, T)), (0.5, _jsd(S, T, 0.5)), (0.25, _jsd(S, T, 0.25))],
)
def test_divergence_endpoints_and_mixture(alpha, expected):
    out = compute_divergence(_logits(*S).log_softmax(-1), _logits(*T).log_softmax(-1), alpha)
    assert out.shape == (1,)
    assert out.item() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("alpha, expected", [(0.0, _kl(T2, S2)), (1.0, _kl(S2, T2)), (0.5, _jsd(S2, T2, 0.5))])
def test_topk_renormalised_on_the_students_support(alpha, expected):
    out = compute_topk_self_distillation_loss(
        _logits(*S), _logits(*T), distillation_topk=2, distillation_alpha=alpha, distillation_add_tail=False
    )
    assert out.item() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_topk_with_tail_bucket(alpha):
    # Support {0, 1} plus the tail: student (0.5, 0.3, 0.2), teacher (0.1, 0.6, 0.3) — with V = 3 and k = 2 the tail
    # is exactly token 2, so the value equals the full-vocabulary divergence.
    expected = {0.0: _kl(T, S), 1.0: _kl(S, T), 0.5: _jsd(S, T, 0.5)}[alpha]
    out = compute_topk_self_distillation_loss(
        _logits(*S), _logits(*T), distillation_topk=2, distillation_alpha=alpha, distillation_add_tail=True
    )
    assert out.item() == pytest.approx(expected, rel=1e-7)
    full = compute_full_logit_self_distillation_loss(_logits(*S), _logits(*T), distillation_alpha=alpha)
    assert full.item() == pytest.approx(expected, rel=1e-9)


def test_topk_with_tail_on_four_tokens():
    # Student (0.4, 0.3, 0.2, 0.1) → support {0, 1}; teacher (0.1, 0.2, 0.3, 0.4). Buckets: S (0.4, 0.3, 0.3),
    # T (0.1, 0.2, 0.7); reverse KL.
    out = compute_topk_self_distillation_loss(
        _logits(0.4, 0.3, 0.2, 0.1), _logits(0.1, 0.2, 0.3, 0.4), distillation_topk=2, distillation_alpha=1.0,
        distillation_add_tail=True,
    )  # fmt: skip
    assert out.item() == pytest.approx(_kl((0.4, 0.3, 0.3), (0.1, 0.2, 0.7)), rel=1e-7)


def test_topk_batched_shapes_and_gradient_reaches_the_student_only():
    torch.manual_seed(0)
    student = torch.randn(2, 3, 7, requires_grad=True)
    teacher = torch.randn(2, 3, 7)
    out = compute_topk_self_distillation_loss(student, teacher, distillation_topk=3, distillation_alpha=0.5)
    assert out.shape == (2, 3)
    assert (out >= 0).all()
    out.sum().backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    # k >= V is the full vocabulary (renormalising a full distribution changes nothing).
    full = compute_full_logit_self_distillation_loss(student, teacher, distillation_alpha=0.5)
    big_k = compute_topk_self_distillation_loss(student, teacher, distillation_topk=100, distillation_alpha=0.5)
    torch.testing.assert_close(big_k, full)


def test_identical_distributions_give_zero():
    logits = torch.randn(2, 4, 5)
    for mode in DISTILLATION_MODES:
        alpha = 1.0 if mode == "sampled_token" else 0.5
        ids = logits.argmax(-1)
        out = compute_self_distillation_per_token_loss(
            logits, logits.clone(), ids, distillation_mode=mode, distillation_alpha=alpha, distillation_topk=2
        )
        torch.testing.assert_close(out, torch.zeros(2, 4))


def test_sampled_token_value_and_gradient():
    # log π_S = log 0.5, log π_T = log 0.8: value (ln .5 − ln .8)·ln .5; d/d log π_S = ln .5 − ln .8 (ratio detached).
    s = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[math.log(0.8)]], dtype=torch.float64)
    out = sampled_token_self_distillation_loss_from_logps(s, t)
    assert out.item() == pytest.approx((math.log(0.5) - math.log(0.8)) * math.log(0.5), rel=1e-12)
    out.sum().backward()
    assert s.grad.item() == pytest.approx(math.log(0.5) - math.log(0.8), rel=1e-12)


def test_sampled_token_from_logits_reads_the_sampled_ids():
    student = torch.stack([_logits(*S)[0], _logits(0.2, 0.2, 0.6)[0]])[None]  # (1, 2, 3)
    teacher = torch.stack([_logits(*T)[0], _logits(0.5, 0.25, 0.25)[0]])[None]
    ids = torch.tensor([[1, 2]])
    out = compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)
    expected = [(math.log(0.3) - math.log(0.6)) * math.log(0.3), (math.log(0.6) - math.log(0.25)) * math.log(0.6)]
    assert out.shape == (1, 2)
    assert out[0].tolist() == pytest.approx(expected, rel=1e-6)


def test_sampled_token_is_reverse_kl_only():
    with pytest.raises(ValueError, match="alpha=1.0"):
        compute_sampled_token_self_distillation_loss(
            torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), distillation_alpha=0.5
        )


def test_importance_sampling_clipping_caps_the_ratio_and_detaches_it():
    loss = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64, requires_grad=True)
    student = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.4)]], dtype=torch.float64)
    out = apply_importance_sampling_clipping(loss, student, old, 2.0)
    # ratios 1, 3 → capped at 2, 0.5 (only capped from above)
    assert out[0].tolist() == pytest.approx([1.0, 4.0, 1.5], rel=1e-12)
    out.sum().backward()
    assert loss.grad[0].tolist() == pytest.approx([1.0, 2.0, 0.5], rel=1e-12)
    assert student.grad is None  # the ratio carries no gradient


def test_importance_sampling_log_ratio_is_clamped():
    out = apply_importance_sampling_clipping(
        torch.ones(1, 1), torch.tensor([[-100.0]]), torch.tensor([[0.0]]), 2.0
    )
    assert out.item() == pytest.approx(math.exp(-20.0), rel=1e-5)


def test_sequence_mean_token_mean_aggregation():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert self_distillation_loss(per_token, mask).item() == pytest.approx((1.5 + 4.0) / 2)


def test_dispatch_errors_name_the_valid_modes():
    with pytest.raises(ValueError, match="sampled_token.*full_logits.*topk_logits"):
        compute_self_distillation_per_token_loss(torch.zeros(1, 2), torch.zeros(1, 2), distillation_mode="kl")
    with pytest.raises(ValueError, match="distillation_topk"):
        compute_self_distillation_per_token_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), distillation_mode="topk_logits", distillation_topk=None
        )
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        compute_full_logit_self_distillation_loss(torch.zeros(1, 2), torch.zeros(1, 2), distillation_alpha=1.5)
