"""Hand-computed checks for posttrain.core.policy_objectives (importance weights; clip, cispo, sapo, vespo)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.policy_objectives import (
    POLICY_OBJECTIVES,
    cispo_objective,
    clip_objective,
    importance_weights,
    sapo_objective,
    vespo_gamma_weights,
    vespo_objective,
)


def _logps(ratios: list[list[float]], logp: list[list[float]] | None = None):
    """Build (logp, old_logp) with exp(logp − old) = ratios; logp is a leaf that requires grad."""
    r = torch.tensor(ratios, dtype=torch.float64)
    lp = torch.full_like(r, -1.0) if logp is None else torch.tensor(logp, dtype=torch.float64)
    lp.requires_grad_()
    return lp, (lp.detach() - r.log())


def test_importance_weights_levels():
    """Token ratios [2, 1, e^5 (masked)]: token level returns them; sequence (GSPO) = exp((ln 2 + 0)/2) = √2;
    sequence_sum (RLOO) = exp(ln 2 + 0) = 2 — the masked token is excluded from both."""
    logp, old = _logps([[2.0, 1.0, math.exp(5)]])
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(importance_weights(logp, old, mask), torch.tensor([[2.0, 1.0, math.exp(5)]]).double())
    assert importance_weights(logp, old, mask, "sequence").item() == pytest.approx(math.sqrt(2))
    assert importance_weights(logp, old, mask, "sequence").shape == (1, 1)
    assert importance_weights(logp, old, mask, "sequence_sum").item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="importance_sampling_level 'seq'"):
        importance_weights(logp, old, mask, "seq")


def test_importance_weights_empty_sequence():
    """An all-masked row has ratio exp(0 / max(0, 1)) = 1 (no NaN)."""
    logp, old = _logps([[3.0, 3.0]])
    assert importance_weights(logp, old, torch.zeros(1, 2), "sequence").item() == 1.0


RATIOS = [[1.5, 0.5], [1.5, 0.5]]
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
MASK = torch.ones(2, 2)


def test_clip_values_stats_and_gradients():
    """ε = 0.2. Row 0 (A = +1), w = [1.5, 0.5]: clip -> [1.2, 0.8]; L = −min(w, w₂) = [−1.2, −0.5].
    Row 1 (A = −1): L = −min(−w, −w₂) = [max(1.5, 1.2), max(0.5, 0.8)] = [1.5, 0.8].
    High-clipped (w > 1.2 & A > 0): row 0 token 0 only; low-clipped (w < 0.8 & A < 0): row 1 token 1 only.
    dL/dlogp = −A·w where the unclipped branch is active, else 0: [[0, −0.5], [1.5, 0]]."""
    logp, old = _logps(RATIOS)
    loss, stats = clip_objective(logp, old, ADV, MASK, epsilon_low=0.2, epsilon_high=0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5], [1.5, 0.8]], dtype=torch.float64))
    assert stats["is_high_clipped"].tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert stats["is_low_clipped"].tolist() == [[0.0, 0.0], [0.0, 1.0]]
    assert stats["is_region_clipped"].tolist() == [[1.0, 0.0], [0.0, 1.0]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5], [1.5, 0.0]], dtype=torch.float64))


def test_clip_asymmetric_epsilon_and_delta():
    """ε_high = 0.28: row 0 token 0 -> −min(1.5, 1.28) = −1.28. δ = 1.4 caps the unclipped ratio for A < 0:
    row 1 token 0 -> −min(−1.4, −1.2) = 1.4, with zero gradient (capped). ε_high = None falls back to ε."""
    logp, old = _logps(RATIOS)
    loss, _ = clip_objective(logp, old, ADV, MASK, epsilon_low=0.2, epsilon_high=0.28, delta=1.4)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5], [1.4, 0.8]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5], [0.0, 0.0]], dtype=torch.float64))
    none_high, _ = clip_objective(logp, old, ADV, MASK, epsilon_low=0.2, epsilon_high=None)
    torch.testing.assert_close(none_high, torch.tensor([[-1.2, -0.5], [1.5, 0.8]], dtype=torch.float64))


def test_clip_sequence_level_gspo():
    """Sequence level: row 0 ratios [1.5, 0.5] -> w = exp((ln 1.5 + ln .5)/2) = √0.75 = 0.866025, A = +1 -> inside
    [0.8, 1.2] -> L = −0.866025, shape (B, 1). Row 1 A = −1 same w -> L = 0.866025."""
    logp, old = _logps(RATIOS)
    loss, stats = clip_objective(logp, old, ADV, MASK, importance_sampling_level="sequence")
    assert loss.shape == (2, 1)
    torch.testing.assert_close(loss, torch.tensor([[-math.sqrt(0.75)], [math.sqrt(0.75)]], dtype=torch.float64))
    assert stats["is_region_clipped"].shape == (2, 1)


def test_clip_per_token_advantages():
    """(B, T) advantages: A = [[1, −1]] with w = [1.5, 0.5]: L = [−1.2, 0.8]."""
    logp, old = _logps([[1.5, 0.5]])
    loss, _ = clip_objective(logp, old, torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2))
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 0.8]], dtype=torch.float64))


def test_cispo():
    """ε_high = 2 (absolute cap), A = +1, w = [3, 0.5], logp = [−0.5, −1]: L = −min(w, 2)·A·logp = [1.0, 0.5];
    dL/dlogp = −sg(min(w, 2))·A = [−2, −0.5] (the ratio carries no gradient); cispo_clip = [1, 0]."""
    logp, old = _logps([[3.0, 0.5]], logp=[[-0.5, -1.0]])
    loss, stats = cispo_objective(logp, old, torch.tensor([1.0]), torch.ones(1, 2), epsilon_high=2.0)
    torch.testing.assert_close(loss, torch.tensor([[1.0, 0.5]], dtype=torch.float64))
    assert stats["cispo_clip"].tolist() == [[1.0, 0.0]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -0.5]], dtype=torch.float64))
    # negative advantage: the weight is still capped but the clip indicator stays 0
    _, neg_stats = cispo_objective(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), epsilon_high=2.0)
    assert neg_stats["cispo_clip"].tolist() == [[0.0, 0.0]]


def test_sapo():
    """At w = 1: f = σ(0)·4/τ = 2/τ -> A = +1 (τ = 1): L = −2; A = −1 (τ = 1.05): L = 2/1.05 = 1.904762.
    The gradient at w = 1 equals the unclipped surrogate's: dL/dlogp = −A·σ'(0)·4·w = −A.
    At w = 2, A = +1: L = −4σ(1) = −2.924234."""
    logp, old = _logps([[1.0], [1.0]])
    loss, stats = sapo_objective(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    assert stats == {}
    torch.testing.assert_close(loss, torch.tensor([[-2.0], [2 / 1.05]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0], [1.0]], dtype=torch.float64))
    logp2, old2 = _logps([[2.0]])
    far, _ = sapo_objective(logp2, old2, torch.tensor([1.0]), torch.ones(1, 1))
    assert far.item() == pytest.approx(-4 / (1 + math.exp(-1)))


def test_vespo_gamma_kernel_values():
    """Token log-ratios [0.1, 0.2] -> s = 0.3 (a sum, not a mean). A ≥ 0 (k = 2, λ = 3):
    log φ = 3 + 2·0.3 − 3·e^0.3 = −0.449576 -> φ = 0.637904. A < 0 (k = 3, λ = 2): log φ = 2 + 0.9 − 2e^0.3 = 0.200282
    -> φ = 1.221757. W = 1 gives φ = 1."""
    log_ratio = torch.tensor([[0.1, 0.2], [0.1, 0.2], [0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0], [0.5]], dtype=torch.float64)
    phi = vespo_gamma_weights(adv, log_ratio, torch.ones(3, 2))
    e = math.exp(0.3)
    expected = [[math.exp(3 + 0.6 - 3 * e)], [math.exp(2 + 0.9 - 2 * e)], [1.0]]
    torch.testing.assert_close(phi, torch.tensor(expected, dtype=torch.float64))


def test_vespo_clamping_and_rollout_ratio():
    """Huge log-ratios are clamped (per token to 20, the sum to 20): φ = exp(3 + 40 − 3e^20) = 0, no NaN/inf.
    A rollout log-ratio of −0.3 per valid token cancels s = 0.3 -> φ = 1; masked tokens contribute nothing."""
    huge = vespo_gamma_weights(torch.tensor([[1.0]]), torch.tensor([[30.0, 30.0]]), torch.ones(1, 2))
    assert huge.item() == 0.0
    mask = torch.tensor([[1, 1, 0]])
    log_ratio = torch.tensor([[0.1, 0.2, 7.0]], dtype=torch.float64)
    rollout = torch.tensor([[-0.15, -0.15, float("-inf")]], dtype=torch.float64)
    phi = vespo_gamma_weights(torch.tensor([[1.0]]), log_ratio, mask, rollout_log_ratio=rollout)
    assert phi.item() == pytest.approx(1.0)


def test_vespo_objective_gradient_is_reinforce_times_phi():
    """L = −φ·A·logp with φ detached: dL/dlogp = −φ·A (φ = 0.637904 for s = 0.3, A = 1); stats carry φ (B, 1)."""
    logp, old = _logps([[math.exp(0.1), math.exp(0.2)]], logp=[[-1.0, -2.0]])
    loss, stats = vespo_objective(logp, old, torch.tensor([1.0]), torch.ones(1, 2))
    phi = math.exp(3 + 0.6 - 3 * math.exp(0.3))
    assert stats["phi_seq"].shape == (1, 1)
    assert stats["phi_seq"].item() == pytest.approx(phi)
    torch.testing.assert_close(loss, torch.tensor([[phi * 1.0, phi * 2.0]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-phi, -phi]], dtype=torch.float64))


def test_vespo_importance_sampling_ratio_argument():
    """TRL's token-level importance_sampling_ratio ρ is folded in as log ρ: ρ = e^{-0.15} per token cancels s = 0.3.
    A sequence-level (B, 1) ratio is rejected, and passing both forms is an error."""
    logp, old = _logps([[math.exp(0.1), math.exp(0.2)]])
    rho = torch.full((1, 2), math.exp(-0.15), dtype=torch.float64)
    _, stats = vespo_objective(logp, old, torch.tensor([1.0]), torch.ones(1, 2), importance_sampling_ratio=rho)
    assert stats["phi_seq"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="token_truncate"):
        vespo_objective(logp, old, torch.tensor([1.0]), torch.ones(1, 2), importance_sampling_ratio=rho[:, :1])
    with pytest.raises(ValueError, match="not both"):
        vespo_objective(
            logp, old, torch.tensor([1.0]), torch.ones(1, 2), importance_sampling_ratio=rho, rollout_log_ratio=rho
        )


def test_registry_and_shared_kwargs():
    """All four objectives are registered, accept one shared kwargs dict, and an unknown name lists the valid ones."""
    assert {"cispo", "clip", "sapo", "vespo"} <= set(POLICY_OBJECTIVES.names())
    logp, old = _logps(RATIOS)
    kwargs = dict(
        importance_sampling_level="token",
        epsilon_low=0.2,
        epsilon_high=0.28,
        delta=None,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        rollout_log_ratio=None,
        unrelated_option=123,
    )
    for name in POLICY_OBJECTIVES:
        loss, stats = POLICY_OBJECTIVES.get(name)(logp, old, ADV, MASK, **kwargs)
        assert loss.shape in ((2, 2), (2, 1)) and torch.isfinite(loss).all()  # (B, 1): sequence-level (gmpo)
        assert isinstance(stats, dict)
    with pytest.raises(ValueError, match="Valid names: ") as error:
        POLICY_OBJECTIVES.get("ppo")
    assert all(name in str(error.value) for name in ("cispo", "clip", "sapo", "vespo"))


def test_advantage_shape_validation():
    logp, old = _logps(RATIOS)
    with pytest.raises(ValueError, match=r"advantages must have shape"):
        clip_objective(logp, old, torch.ones(3), MASK)
    with pytest.raises(ValueError, match=r"advantages must have shape"):
        clip_objective(logp, old, torch.ones(2, 3), MASK)


def test_objectives_declare_their_metrics():
    """cispo and vespo declare the metrics their stats give (TRL's names and reductions); a trainer logs exactly
    these; an undeclared objective gets the registered ones whose stat it returns."""
    from posttrain.core.masking import masked_batch_mean
    from posttrain.core.policy_objectives import ObjectiveMetric, objective_metric_values, objective_properties

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp, old = _logps([[7.0, 1.0, 9.0], [0.5, 1.0, 1.0]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)

    cispo = objective_properties(POLICY_OBJECTIVES.get("cispo"))
    _, stats = cispo_objective(logp, old, advantages, mask, epsilon_high=5.0)
    values = objective_metric_values(cispo, stats, mask)
    assert list(values) == ["cispo_clip_ratio"]
    assert float(values["cispo_clip_ratio"]) == pytest.approx(1 / 3)  # ratio 7 > 5 with A > 0 on 1 of 3 tokens
    assert float(values["cispo_clip_ratio"]) == float(masked_batch_mean(stats["cispo_clip"], mask))

    vespo = objective_properties(POLICY_OBJECTIVES.get("vespo"))
    _, stats = vespo_objective(logp, old, advantages, mask)
    values = objective_metric_values(vespo, stats, mask)
    assert list(values) == ["vespo/phi_seq_mean"]
    assert float(values["vespo/phi_seq_mean"]) == float(stats["phi_seq"].mean())

    for name in ("clip", "sapo"):  # clip's indicators are the shared clip_ratio/* metrics, not its own
        assert dict(objective_properties(POLICY_OBJECTIVES.get(name)).metrics) == {}

    def custom(logp, old_logp, advantages, mask, **_):
        return logp * 0, {"cispo_clip": torch.ones_like(logp)}

    custom_stats = custom(logp, old, advantages, mask)[1]
    assert list(objective_metric_values(objective_properties(custom), custom_stats, mask)) == ["cispo_clip_ratio"]
    with pytest.raises(ValueError, match="masked_mean"):
        ObjectiveMetric("x", reduce="sum")
