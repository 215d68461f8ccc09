"""Hand-computed checks for posttrain.core.preference (DPO family, WPO, LD-DPO, KTO, Bradley–Terry).

Shared DPO pair unless stated: β = 0.1, π_c = −1, ρ_c = −2 (u_c = 1), π_r = −3, ρ_r = −2 (u_r = −1), so with
reverse KL s_c = 1, s_r = −1, Δ = 2, βΔ = 0.2; len_c = 2, len_r = 4.
Reference numbers: σ(0.1) = 0.524979, σ(0.2) = 0.549834, −log σ(0.2) = 0.598139, −log σ(0.1) = 0.644397.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from posttrain.core.preference import (
    DPO_LOSSES,
    DPOLossInputs,
    bradley_terry_loss,
    dpo_loss,
    f_divergence_scores,
    kto_kl_estimate,
    kto_loss,
    kto_weight_range_warning,
    ld_weighted_logps,
    validate_dpo_loss_config,
    wpo_pair_weight,
    wpo_sequence_weight,
    wpo_token_log_normalizer,
)

BETA = 0.1


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def pair(**extra) -> DPOLossInputs:
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    fields = dict(
        chosen_logps=t(-1.0),
        rejected_logps=t(-3.0),
        ref_chosen_logps=t(-2.0),
        ref_rejected_logps=t(-2.0),
        chosen_lengths=t(2.0),
        rejected_lengths=t(4.0),
    )
    fields.update({k: t(v) for k, v in extra.items()})
    return DPOLossInputs(**fields)


def one(loss_type: str, batch: DPOLossInputs | None = None, **kw) -> float:
    return DPO_LOSSES.get(loss_type)(batch or pair(), beta=kw.pop("beta", BETA), **kw).item()


ALL_TRL_DPO_LOSSES = {
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
}  # fmt: skip


def test_registry_has_every_trl_loss_type():
    # a subset, not a snapshot: a loss posttrain adds is registered without editing this list
    missing = ALL_TRL_DPO_LOSSES - set(DPO_LOSSES.names())
    assert not missing, f"TRL's DPO loss types missing from DPO_LOSSES: {sorted(missing)}"
    with pytest.raises(ValueError, match="Valid names: .*sigmoid_norm"):
        DPO_LOSSES.get("sigmod")


# ----------------------------------------------------------------------------------------- f-divergence scores


def test_f_divergence_scores():
    u = torch.tensor([1.0, -2.0], dtype=torch.float64)
    assert torch.allclose(f_divergence_scores(u, "reverse_kl"), u)
    # forward KL: −e^{−u} = [−e^{−1}, −e^{2}] = [−0.367879, −7.389056]
    assert torch.allclose(
        f_divergence_scores(u, "forward_kl"), torch.tensor([-0.367879441, -7.389056099], dtype=torch.float64)
    )
    # JS: log σ(u) = [log 0.731059, log 0.119203] = [−0.313262, −2.126928]
    assert torch.allclose(
        f_divergence_scores(u, "js_divergence"), torch.tensor([-0.313261687, -2.126928011], dtype=torch.float64)
    )
    # α = 0.5: e^{−0.5u}/(−0.5) = [−2e^{−0.5}, −2e^{1}] = [−1.213061, −5.436564]
    assert torch.allclose(
        f_divergence_scores(u, "alpha_divergence", 0.5),
        torch.tensor([-1.213061319, -5.436563657], dtype=torch.float64),
    )
    # α → 1 falls back to reverse KL.
    assert torch.allclose(f_divergence_scores(u, "alpha_divergence", 1.0), u)


def test_alpha_divergence_exponent_is_clamped():
    # α = 2, u = 100: exponent (α−1)u = 100 is clamped to 80 (fp32) / 11 (fp16), coefficient 1/(α−1) = 1.
    assert f_divergence_scores(torch.tensor([100.0]), "alpha_divergence", 2.0).item() == pytest.approx(
        math.exp(80), rel=1e-5
    )
    half = f_divergence_scores(torch.tensor([100.0], dtype=torch.float16), "alpha_divergence", 2.0)
    assert half.dtype == torch.float16 and torch.isfinite(half).all()
    assert half.item() == pytest.approx(math.exp(11), rel=1e-3)


def test_unknown_f_divergence_lists_valid_names():
    with pytest.raises(ValueError, match="f_divergence_type.*forward_kl"):
        f_divergence_scores(torch.zeros(1), "kl")


# ------------------------------------------------------------------------------------------- DPO loss values


def test_sigmoid():
    # −log σ(βΔ) = −log σ(0.2) = log(1 + e^{−0.2}) = 0.598139
    assert one("sigmoid") == pytest.approx(0.598138869, abs=1e-8)


def test_hinge():
    # max(0, 1 − 0.2) = 0.8; with β = 1: max(0, 1 − 2) = 0
    assert one("hinge") == pytest.approx(0.8)
    assert one("hinge", beta=1.0) == 0.0


def test_ipo_is_length_normalised():
    # (s_c/len_c − s_r/len_r − 1/(2β))² = (1/2 + 1/4 − 5)² = (−4.25)² = 18.0625
    assert one("ipo") == pytest.approx(18.0625)


def test_exo_pair():
    # ε = 0.1: σ(0.2)(log σ(0.2) − log 0.9) + σ(−0.2)(log σ(−0.2) − log 0.1)
    #        = 0.549834·(−0.598139 + 0.105361) + 0.450166·(−0.798139 + 2.302585) = −0.270946 + 0.677251 = 0.406304
    expected = sig(0.2) * (logsig(0.2) - math.log(0.9)) + sig(-0.2) * (logsig(-0.2) - math.log(0.1))
    assert expected == pytest.approx(0.406304, abs=1e-6)
    assert one("exo_pair", label_smoothing=0.1) == pytest.approx(expected, abs=1e-10)


def test_exo_pair_requires_label_smoothing():
    with pytest.raises(ValueError, match="label_smoothing"):
        one("exo_pair")
    with pytest.raises(ValueError, match="exo_pair.*label_smoothing"):
        validate_dpo_loss_config(["sigmoid", "exo_pair"], label_smoothing=0.0)


def test_nca_pair():
    # βs_c = 0.1, βs_r = −0.1: −log σ(0.1) − ½ log σ(−0.1) − ½ log σ(0.1) = 0.644397 + 0.372198 + 0.322198 = 1.338793
    assert one("nca_pair") == pytest.approx(1.338793, abs=1e-6)


def test_robust():
    # ε = 0.1: [−0.9 log σ(0.2) + 0.1 log σ(−0.2)] / 0.8 = [0.538325 − 0.079814] / 0.8 = 0.573139
    expected = (-0.9 * logsig(0.2) + 0.1 * logsig(-0.2)) / 0.8
    assert expected == pytest.approx(0.573139, abs=1e-6)
    assert one("robust", label_smoothing=0.1) == pytest.approx(expected, abs=1e-10)
    # ε = 0 is plain DPO.
    assert one("robust") == pytest.approx(one("sigmoid"))


def test_robust_warns_outside_range():
    with pytest.warns(UserWarning, match=r"\[0.0, 0.5\).*robust|robust.*\[0.0, 0.5\)"):
        validate_dpo_loss_config("robust", label_smoothing=0.6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_dpo_loss_config("robust", label_smoothing=0.2)


def test_bco_pair():
    # −log σ(βs_c) − log σ(−βs_r) = 2·(−log σ(0.1)) = 1.288794
    assert one("bco_pair") == pytest.approx(1.288794, abs=1e-6)


def test_sppo_hard():
    # (s_c − 1/(2β))² + (s_r + 1/(2β))² = (1 − 5)² + (−1 + 5)² = 32
    assert one("sppo_hard") == pytest.approx(32.0)


def aot_batch() -> DPOLossInputs:
    # π_c − π_r = [2, −3] → sorted [−3, 2]; ρ_c − ρ_r = [0, −2] → sorted [−2, 0]; paired d = [−1, 2].
    # u_c = [1, −1] → sorted [−1, 1]; u_r = [−1, 0] → sorted [−1, 0]; unpaired d = [0, 1].
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return DPOLossInputs(t(-1.0, -5.0), t(-3.0, -2.0), t(-2.0, -4.0), t(-2.0, -2.0))


def test_aot_paired_sorts_margins():
    losses = DPO_LOSSES.get("aot")(aot_batch(), beta=BETA)
    # −log σ(βd) = [−log σ(−0.1), −log σ(0.2)] = [0.744397, 0.598139]
    assert torch.allclose(losses, torch.tensor([0.744396660, 0.598138869], dtype=torch.float64))
    smoothed = DPO_LOSSES.get("aot")(aot_batch(), beta=BETA, label_smoothing=0.1)
    expected = [-0.9 * logsig(z) - 0.1 * logsig(-z) for z in (-0.1, 0.2)]
    assert torch.allclose(smoothed, torch.tensor(expected, dtype=torch.float64))


def test_aot_unpaired_sorts_logratios():
    losses = DPO_LOSSES.get("aot_unpaired")(aot_batch(), beta=BETA)
    # −log σ(0) = log 2 = 0.693147; −log σ(0.1) = 0.644397
    assert torch.allclose(losses, torch.tensor([math.log(2), 0.644396660], dtype=torch.float64))


def test_apo_zero():
    # (1 − σ(0.1)) + σ(−0.1) = 2·0.475021 = 0.950042
    assert one("apo_zero") == pytest.approx(0.950042, abs=1e-6)


def test_apo_down():
    # σ(0.1) + 1 − σ(0.2) = 0.524979 + 0.450166 = 0.975145
    assert one("apo_down") == pytest.approx(0.975145, abs=1e-6)


def test_discopop():
    # z = 0.2, m = σ(0.2/0.05) = σ(4) = 0.982014; (1 − m)·0.598139 + m·e^{−0.2} = 0.010758 + 0.804005 = 0.814763
    expected = (1 - sig(4.0)) * -logsig(0.2) + sig(4.0) * math.exp(-0.2)
    assert expected == pytest.approx(0.814763, abs=1e-6)
    assert one("discopop", discopop_tau=0.05) == pytest.approx(expected, abs=1e-10)


def test_sft_broadcasts_chosen_nll():
    batch = aot_batch()
    batch.chosen_nll = torch.tensor(1.5, dtype=torch.float64)
    assert DPO_LOSSES.get("sft")(batch, beta=BETA).tolist() == [1.5, 1.5]
    with pytest.raises(ValueError, match="chosen_nll"):
        DPO_LOSSES.get("sft")(aot_batch(), beta=BETA)


def test_sigmoid_norm():
    # −log σ(β(s_c/2 − s_r/4)) = −log σ(0.1·0.75) = −log σ(0.075) = 0.656350
    assert one("sigmoid_norm") == pytest.approx(-logsig(0.075), abs=1e-10)
    assert one("sigmoid_norm") == pytest.approx(0.656350, abs=1e-6)


def test_length_losses_need_lengths():
    batch = aot_batch()
    for name in ("ipo", "sigmoid_norm"):
        with pytest.raises(ValueError, match=f"{name}.*chosen_lengths"):
            DPO_LOSSES.get(name)(batch, beta=BETA)


def test_sigmoid_with_f_divergences():
    # forward KL: s_c = −e^{−1} = −0.367879, s_r = −e^{1} = −2.718282, Δ = 2.350402 → −log σ(0.235040) = 0.582517
    d_fwd = -math.exp(-1) + math.exp(1)
    assert one("sigmoid", f_divergence_type="forward_kl") == pytest.approx(-logsig(0.1 * d_fwd), abs=1e-10)
    # JS: Δ = log σ(1) − log σ(−1) = 1 exactly (log σ(u) − log σ(−u) = u) → −log σ(0.1) = 0.644397
    assert one("sigmoid", f_divergence_type="js_divergence") == pytest.approx(0.644396660, abs=1e-8)
    # α = 0.5: s = −2e^{−u/2}: Δ = −2e^{−0.5} + 2e^{0.5} = 2.084381 → −log σ(0.208438)
    d_alpha = -2 * math.exp(-0.5) + 2 * math.exp(0.5)
    got = one("sigmoid", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5)
    assert got == pytest.approx(-logsig(0.1 * d_alpha), abs=1e-10)


def test_apo_zero_ignores_f_divergence_but_bco_uses_it():
    assert one("apo_zero", f_divergence_type="forward_kl") == pytest.approx(one("apo_zero"))
    # bco_pair with forward KL: −log σ(−0.1e^{−1}) − log σ(0.1e^{1})
    expected = -logsig(-0.1 * math.exp(-1)) - logsig(0.1 * math.exp(1))
    assert one("bco_pair", f_divergence_type="forward_kl") == pytest.approx(expected, abs=1e-10)


# ---------------------------------------------------------------------------------------------- dpo_loss combo


def test_dpo_loss_multi_loss_weighting_and_rewards():
    # MPO: 0.8·sigmoid + 0.2·bco_pair + 1.0·sft = 0.8·0.598139 + 0.2·1.288794 + 1.5 = 0.478511 + 0.257759 + 1.5
    batch = pair(chosen_nll=1.5)
    loss, metrics = dpo_loss(batch, ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], beta=BETA)
    assert loss.item() == pytest.approx(2.236270, abs=1e-6)
    # rewards: β·u_c = 0.1, β·u_r = −0.1
    assert metrics["chosen_rewards"].tolist() == pytest.approx([0.1])
    assert metrics["rejected_rewards"].tolist() == pytest.approx([-0.1])
    # Default weights are all 1.0.
    loss_default, _ = dpo_loss(batch, ["sigmoid", "hinge"], beta=BETA)
    assert loss_default.item() == pytest.approx(0.598138869 + 0.8, abs=1e-8)


def test_dpo_loss_is_mean_over_pairs_and_applies_wpo_weights():
    batch = aot_batch()  # Δ = [u_c − u_r] = [2, −1]
    per_pair = [-logsig(0.2), -logsig(-0.1)]  # [0.598139, 0.744397]
    loss, _ = dpo_loss(batch, "sigmoid", beta=BETA)
    assert loss.item() == pytest.approx(sum(per_pair) / 2)
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    loss_w, _ = dpo_loss(batch, "sigmoid", beta=BETA, weights=w)
    assert loss_w.item() == pytest.approx((per_pair[0] + 0.5 * per_pair[1]) / 2)


def test_dpo_loss_weight_length_mismatch():
    with pytest.raises(ValueError, match=r"loss_weights.*\(1\).*\(2\)"):
        dpo_loss(pair(), ["sigmoid", "ipo"], [1.0], beta=BETA)


def test_wpo_not_with_aot():
    with pytest.raises(ValueError, match="use_weighting.*aot"):
        dpo_loss(aot_batch(), "aot", beta=BETA, weights=torch.ones(2, dtype=torch.float64))


def test_dpo_loss_accepts_callable_and_gradients_flow():
    pi_c = torch.tensor([-1.0], requires_grad=True)
    batch = DPOLossInputs(pi_c, torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]))

    def custom(b: DPOLossInputs, *, beta: float, **_) -> torch.Tensor:
        return -beta * b.chosen_logratios

    loss, _ = dpo_loss(batch, ["sigmoid", custom], beta=BETA)
    loss.backward()
    # d/dπ_c [−log σ(β(π_c − ρ_c − u_r))] = −β(1 − σ(0.2)) = −0.045017; custom adds −β = −0.1
    assert pi_c.grad.item() == pytest.approx(-0.1 * (1 - sig(0.2)) - 0.1, abs=1e-6)


# ------------------------------------------------------------------------------------------------ WPO / LD-DPO


def test_wpo_token_log_normalizer():
    # z = [log 3, 0] → p = [0.75, 0.25], Σp² = 0.625; z = [0, 0] → Σp² = 0.5
    z = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    assert torch.allclose(wpo_token_log_normalizer(z), torch.tensor([math.log(0.625), math.log(0.5)]))


def test_wpo_sequence_and_pair_weight():
    # Sequence 0: tokens with p = 0.75 (Σp² = 0.625) and p = 0.25 (Σp² = 0.625), third token masked out:
    #   mean(log 0.75 − log 0.625, log 0.25 − log 0.625) = mean(log 1.2, log 0.4) → w = sqrt(0.48) = 0.692820
    # Sequence 1: one token with p = 0.5, Σp² = 0.5 → w = 1.
    logps = torch.tensor([[math.log(0.75), math.log(0.25), -9.0], [math.log(0.5), 0.0, 0.0]], requires_grad=True)
    norm = torch.tensor([[math.log(0.625)] * 3, [math.log(0.5)] * 3])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w = wpo_sequence_weight(logps, norm, mask)
    assert not w.requires_grad
    assert w.tolist() == pytest.approx([math.sqrt(0.48), 1.0], abs=1e-6)
    # Pair weight is the product, not clamped (TRL 1.16): 0.692820·1.2 = 0.831384; 1.2·1.5 = 1.8.
    pw = wpo_pair_weight(torch.tensor([math.sqrt(0.48), 1.2]), torch.tensor([1.2, 1.5]))
    assert pw.tolist() == pytest.approx([math.sqrt(0.48) * 1.2, 1.8], abs=1e-6)


def test_ld_weighted_logps():
    # Chosen: 3 completion tokens after one prompt position (mask 0); rejected: 5 tokens + 1 pad. l_p = 3.
    # chosen = −1 − 2 − 3 = −6 (no tail); rejected = 3·(−1) + α·(−2 − 2) = −3 − 0.5·4 = −5.
    lp_c = torch.tensor([[-7.0, -1.0, -2.0, -3.0]])
    m_c = torch.tensor([[0, 1, 1, 1]])
    lp_r = torch.tensor([[-1.0, -1.0, -1.0, -2.0, -2.0, -9.0]])
    m_r = torch.tensor([[1, 1, 1, 1, 1, 0]])
    c, r = ld_weighted_logps(lp_c, m_c, lp_r, m_r, ld_alpha=0.5)
    assert c.tolist() == [-6.0] and r.tolist() == [-5.0]
    # α = 1 is plain masked summation; α = 0 keeps only the shared prefix.
    c1, r1 = ld_weighted_logps(lp_c, m_c, lp_r, m_r, ld_alpha=1.0)
    assert c1.tolist() == [-6.0] and r1.tolist() == [-7.0]
    _, r0 = ld_weighted_logps(lp_c, m_c, lp_r, m_r, ld_alpha=0.0)
    assert r0.tolist() == [-3.0]


# ------------------------------------------------------------------------------------------------------- KTO


def kto_inputs():
    # u = π − ρ = [1, −1, 0]; labels [desirable, undesirable, desirable]
    policy = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    ref = torch.tensor([-2.0, -1.0, -3.0], dtype=torch.float64)
    labels = torch.tensor([True, False, True])
    return policy, ref, labels


def test_kto_loss():
    # z = 0.5: desirable 1 − σ(0.1(1 − 0.5)) = 1 − σ(0.05) = 0.487503, 1 − σ(0.1(0 − 0.5)) = σ(0.05) = 0.512497;
    # undesirable 1 − σ(0.1(0.5 + 1)) = 1 − σ(0.15) = 0.462570. Mean of the three = 0.487523
    policy, ref, labels = kto_inputs()
    loss, chosen, rejected = kto_loss(policy, ref, labels, torch.tensor(0.5), beta=0.1)
    expected = ((1 - sig(0.05)) + sig(0.05) + (1 - sig(0.15))) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    assert loss.item() == pytest.approx(0.487523, abs=1e-6)
    assert chosen.tolist() == pytest.approx([0.1, 0.0])
    assert rejected.tolist() == pytest.approx([-0.1])
    # Class weights w_d = 2, w_u = 0.5: (2·1 + 0.5·0.462570) / 3 (the two desirable terms sum to 1)
    loss_w, _, _ = kto_loss(policy, ref, labels, 0.5, beta=0.1, desirable_weight=2.0, undesirable_weight=0.5)
    assert loss_w.item() == pytest.approx((2.0 + 0.5 * (1 - sig(0.15))) / 3, abs=1e-10)


def test_kto_apo_zero_unpaired():
    # desirable 1 − σ(0.1) = 0.475021 and 1 − σ(0) = 0.5; undesirable σ(−0.1) = 0.475021; KL is ignored.
    policy, ref, labels = kto_inputs()
    loss, _, _ = kto_loss(policy, ref, labels, 123.0, beta=0.1, loss_type="apo_zero_unpaired")
    assert loss.item() == pytest.approx((2 * (1 - sig(0.1)) + 0.5) / 3, abs=1e-10)
    loss_w, _, _ = kto_loss(
        policy, ref, labels, 0.0, beta=0.1, loss_type="apo_zero_unpaired", desirable_weight=3.0, undesirable_weight=2.0
    )
    assert loss_w.item() == pytest.approx((3 * (1 - sig(0.1)) + 3 * 0.5 + 2 * sig(-0.1)) / 3, abs=1e-10)


def test_kto_single_class_batch_and_bad_input():
    policy, ref, _ = kto_inputs()
    loss, chosen, rejected = kto_loss(policy, ref, torch.ones(3, dtype=torch.bool), 0.0, beta=0.1)
    assert torch.isfinite(loss) and rejected.numel() == 0 and chosen.numel() == 3
    with pytest.raises(ValueError, match="Valid names: apo_zero_unpaired, kto"):
        kto_loss(policy, ref, torch.ones(3, dtype=torch.bool), 0.0, loss_type="sigmoid")
    with pytest.raises(ValueError, match="labels"):
        kto_loss(policy, ref, torch.ones(2, dtype=torch.bool), 0.0)


def test_kto_kl_estimate():
    kl_logps = torch.tensor([1.0, -3.0], requires_grad=True)
    z = kto_kl_estimate(kl_logps, torch.zeros(2))
    assert z.item() == 0.0 and not z.requires_grad  # mean −1 clamped at 0
    assert kto_kl_estimate(kl_logps, torch.zeros(2), clamp=False).item() == -1.0
    assert kto_kl_estimate(torch.tensor([2.0, 0.0]), torch.tensor([0.5, -0.5])).item() == 1.0


def test_kto_weight_range_warning():
    # n_d = 100, n_u = 40, w = 1: desirable range [0.4, 0.53], undesirable range [2.5/1.33 = 1.88, 2.5].
    msg = kto_weight_range_warning(100, 40, 1.0, 1.0)
    assert msg is not None and "desirable_weight in [0.4, 0.53]" in msg and "undesirable_weight in [1.88, 2.5]" in msg
    assert kto_weight_range_warning(100, 40, 0.5, 1.0) is None  # desirable weight in range
    assert kto_weight_range_warning(100, 40, 1.0, 2.0) is None  # undesirable weight in range
    assert kto_weight_range_warning(50, 50, 1.0, 7.0) is None  # balanced data: no advice


# ---------------------------------------------------------------------------------------------- Bradley–Terry


def test_bradley_terry():
    r_c = torch.tensor([2.0, 0.0], dtype=torch.float64)
    r_r = torch.tensor([1.0, 1.0], dtype=torch.float64)
    # No margin: −mean(log σ(1), log σ(−1)) = (0.313262 + 1.313262)/2 = 0.813262
    assert bradley_terry_loss(r_c, r_r).item() == pytest.approx(0.813262, abs=1e-6)
    # Margin [0.5, 0]: −mean(log σ(0.5), log σ(−1)) = (0.474077 + 1.313262)/2 = 0.893669
    margin = torch.tensor([0.5, 0.0], dtype=torch.float64)
    assert bradley_terry_loss(r_c, r_r, margin).item() == pytest.approx(0.893669, abs=1e-6)
    # Centering η = 0.01: + 0.01·mean((3)², (1)²) = + 0.05
    centered = bradley_terry_loss(r_c, r_r, margin, center_rewards_coefficient=0.01)
    assert centered.item() == pytest.approx(0.893669 + 0.05, abs=1e-6)
