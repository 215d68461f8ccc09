"""Hand-computed checks for posttrain.core.reference_free (CPO / SimPO / AlphaPO / TPO / ORPO),
posttrain.core.process_reward (PRM) and posttrain.core.averaging (BEMA).

Shared pair unless stated: β = 0.1, chosen log-prob −1, rejected −3, so Δ = 2 and βΔ = 0.2.
Reference numbers: −log σ(0.2) = 0.598139, −log σ(−0.2) = 0.798139, −log σ(−0.3) = 0.854355.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.averaging import bema_alpha, bema_ema_beta, bema_update_
from posttrain.core.process_reward import step_label_accuracy, step_label_loss
from posttrain.core.reference_free import (
    CONTRASTIVE_LOSSES,
    alphapo_reward,
    contrastive_loss,
    cpo_loss,
    log1mexp,
    masked_token_mean_nll,
    orpo_odds_ratio_loss,
)

C = torch.tensor([-1.0])
R = torch.tensor([-3.0])


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        ("sigmoid", {}, 0.598139),
        ("sigmoid", {"label_smoothing": 0.1}, 0.9 * 0.598139 + 0.1 * 0.798139),
        ("hinge", {}, 0.8),
        ("ipo", {}, (2.0 - 5.0) ** 2),
        ("simpo", {"gamma": 0.5}, 0.854355),
        ("tpo-l", {"gamma": 0.5}, 0.854355),
    ],
)
def test_contrastive_losses_hand_computed(loss_type, kwargs, expected):
    loss = contrastive_loss(C, R, loss_type, beta=0.1, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_unknown_loss_type_lists_valid_names():
    with pytest.raises(ValueError, match="hinge, ipo, sigmoid, simpo, tpo-l"):
        contrastive_loss(C, R, "sigmod", beta=0.1)
    assert set(CONTRASTIVE_LOSSES.names()) == {"sigmoid", "hinge", "ipo", "simpo", "tpo-l"}


def test_cpo_loss_standard_rewards_are_beta_logps():
    losses, chosen_r, rejected_r = cpo_loss(C, R, "sigmoid", beta=0.1)
    assert losses.item() == pytest.approx(0.598139, abs=1e-5)
    assert chosen_r.item() == pytest.approx(-0.1) and rejected_r.item() == pytest.approx(-0.3)


def test_cpo_loss_simpo_uses_simpo_gamma():
    losses, _, _ = cpo_loss(C, R, "simpo", beta=0.1, simpo_gamma=0.5)
    assert losses.item() == pytest.approx(0.854355, abs=1e-5)


def test_alphapo_reward_and_loss_hand_computed():
    # α = 0.5: r(−1) = (1 − e^{0.5})/0.5 = −1.297443, r(−3) = (1 − e^{1.5})/0.5 = −6.963378; Δ = 5.665935.
    assert alphapo_reward(C, 0.5).item() == pytest.approx(-1.297443, abs=1e-5)
    assert alphapo_reward(R, 0.5).item() == pytest.approx(-6.963378, abs=1e-5)
    losses, chosen_r, rejected_r = cpo_loss(C, R, "sigmoid", beta=0.1, alpha=0.5)
    assert losses.item() == pytest.approx(math.log1p(math.exp(-0.5665935)), abs=1e-5)  # 0.449470
    assert chosen_r.item() == pytest.approx(-0.1297443, abs=1e-6)
    assert rejected_r.item() == pytest.approx(-0.6963378, abs=1e-6)
    # α = 0 is the plain log reward; small α tends to it.
    assert torch.equal(alphapo_reward(C, 0.0), C)
    assert alphapo_reward(C, 1e-6).item() == pytest.approx(-1.0, abs=1e-5)


def test_log1mexp_stable_at_both_ends():
    x = torch.tensor([-1e-8, -math.log(2.0), -50.0], dtype=torch.float64)
    out = log1mexp(x)
    assert out[0].item() == pytest.approx(math.log(1e-8), rel=1e-6)
    assert out[1].item() == pytest.approx(math.log(0.5), rel=1e-12)
    assert out[2].item() == pytest.approx(-math.exp(-50.0), rel=1e-6)


def test_orpo_odds_ratio_hand_computed():
    # p_c = 0.5 (odds 1), p_r = 0.25 (odds 1/3): log odds ratio = log 3, log σ(log 3) = log(3/4).
    chosen, rejected = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    term, ratio, log_odds = orpo_odds_ratio_loss(chosen, rejected, beta=0.1)
    assert log_odds.item() == pytest.approx(math.log(3.0), abs=1e-6)
    assert ratio.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert term.item() == pytest.approx(0.1 * math.log(0.75), abs=1e-7)


def test_masked_token_mean_nll():
    logps = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_token_mean_nll(logps, mask).item() == pytest.approx(2.0)
    assert masked_token_mean_nll(logps, torch.zeros_like(mask)).item() == 0.0
    # a given divisor (global tokens / processes) replaces the local count: (1 + 2 + 3) / 4
    assert masked_token_mean_nll(logps, mask, num_tokens=4.0).item() == pytest.approx(1.5)


def test_step_label_loss_hand_computed():
    logits = torch.tensor([[[0.0, math.log(3.0)], [50.0, -50.0], [0.0, 0.0]]])
    labels = torch.tensor([[1, -100, 1]])
    # −log(3/4) = 0.287682 and −log(1/2) = 0.693147; the unlabelled position (which would cost 100) is ignored.
    assert step_label_loss(logits, labels).item() == pytest.approx((0.287682 + 0.693147) / 2, abs=1e-5)
    # a given divisor (global labels / processes) replaces the local count
    assert step_label_loss(logits, labels, num_labels=4.0).item() == pytest.approx((0.287682 + 0.693147) / 4, abs=1e-5)
    assert step_label_accuracy(logits, labels).item() == pytest.approx(
        0.5
    )  # [0, 0] argmaxes to class 0 ≠ 1: one hit of two
    empty = step_label_loss(logits.requires_grad_(), torch.full_like(labels, -100))
    assert empty.item() == 0.0 and empty.requires_grad


def test_bema_schedules_and_update_hand_computed():
    # ρ = 10, γ = 1, t = 6: ρ + γt = 16; β = 16^{−0.5} = 0.25, α = 16^{−0.2} = 0.574349.
    kw = {"lag": 10, "multiplier": 1.0}
    assert bema_ema_beta(6, ema_power=0.5, min_ema_multiplier=0.0, **kw) == pytest.approx(0.25)
    assert bema_ema_beta(6, ema_power=0.5, min_ema_multiplier=0.3, **kw) == pytest.approx(0.3)
    assert bema_ema_beta(6, ema_power=0.0, min_ema_multiplier=0.0, **kw) == 1.0
    alpha = bema_alpha(6, bias_power=0.2, **kw)
    assert alpha == pytest.approx(0.574349, abs=1e-6)
    theta0, ema, out = [torch.tensor([1.0, 2.0])], [torch.tensor([1.0, 2.0])], [torch.zeros(2)]
    bema_update_([torch.tensor([3.0, 2.0])], theta0, ema, out, beta=0.25, alpha=alpha)
    # ema = 0.75·1 + 0.25·3 = 1.5; out = 1.5 + α·(3 − 1) = 2.648698; an unchanged weight stays put.
    assert ema[0].tolist() == pytest.approx([1.5, 2.0])
    assert out[0].tolist() == pytest.approx([1.5 + 2 * 0.574349, 2.0], abs=1e-6)
