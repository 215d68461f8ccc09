"""Hand-computed checks for the k1/k2/k3 KL estimators (posttrain.core.kl)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.kl import kl_k1, kl_k2, kl_k3, kl_k3_bias_corrected

LOGP = torch.tensor([[math.log(0.5)]])
REF = torch.tensor([[math.log(0.25)]])


def test_estimators_hand_computed():
    """logp = ln ½, ref = ln ¼: k1 = ln 2 = 0.693147; k2 = ½ (ln 2)² = 0.240227;
    k3 = e^{−ln 2} + ln 2 − 1 = 0.5 + 0.693147 − 1 = 0.193147; bias-corrected with w = 2: 0.386294."""
    assert kl_k1(LOGP, REF).item() == pytest.approx(math.log(2))
    assert kl_k2(LOGP, REF).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(LOGP, REF).item() == pytest.approx(0.5 + math.log(2) - 1)
    w = torch.tensor([[2.0]])
    assert kl_k3_bias_corrected(LOGP, REF, w).item() == pytest.approx(2 * (0.5 + math.log(2) - 1))


def test_k1_can_be_negative_k2_k3_cannot():
    """Sampled token more likely under ref (logp = ln ¼, ref = ln ½): k1 = −ln 2 < 0; k3 = 2 − ln 2 − 1 = 0.306853."""
    assert kl_k1(REF, LOGP).item() == pytest.approx(-math.log(2))
    assert kl_k2(REF, LOGP).item() > 0
    assert kl_k3(REF, LOGP).item() == pytest.approx(1 - math.log(2))


def test_k1_and_k3_are_unbiased_over_the_full_support():
    """For p = [0.7, 0.2, 0.1] (policy) and q = [0.3, 0.3, 0.4] (ref), the p-weighted mean of k1 and of k3 over the
    three tokens equals KL(p‖q) = Σ p ln(p/q) exactly (k3: Σ p (q/p − ln(q/p) − 1) = Σq − 1 + KL = KL)."""
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    kl = (p * (p / q).log()).sum()
    assert (p * kl_k1(p.log(), q.log())).sum().item() == pytest.approx(kl.item())
    assert (p * kl_k3(p.log(), q.log())).sum().item() == pytest.approx(kl.item())


def test_k3_zero_with_zero_gradient_at_equality():
    """k3(x, x) = 0 and d k3 / d logp = 1 − e^{ref − logp} = 0 there (a minimum)."""
    logp = torch.tensor([-1.3, -0.2], requires_grad=True)
    kl = kl_k3(logp, logp.detach())
    assert kl.tolist() == [0.0, 0.0]
    kl.sum().backward()
    assert logp.grad.tolist() == [0.0, 0.0]


def test_bias_corrected_keeps_gradient_through_weight():
    """d(k3·w)/dw = k3: the importance weight stays in the graph, as in TRL."""
    w = torch.tensor([[1.5]], requires_grad=True)
    kl_k3_bias_corrected(LOGP, REF, w).sum().backward()
    assert w.grad.item() == pytest.approx(0.5 + math.log(2) - 1)
