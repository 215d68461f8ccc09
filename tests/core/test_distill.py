"""Hand-computed checks for posttrain.core.distill (generalized JSD, KL wrappers, chunked ≡ naive).

Two-token distributions used throughout: student logits [0, 0] → p_S = [0.5, 0.5]; teacher logits [log 3, 0] →
p_T = [0.75, 0.25].
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.distill import chunked_generalized_jsd, forward_kl, generalized_jsd_loss, reverse_kl

P_S = (0.5, 0.5)
P_T = (0.75, 0.25)


def kl(p, q) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


def mix(beta: float):
    return tuple((1 - beta) * s + beta * t for s, t in zip(P_S, P_T))


def logits(scale: float = 1.0):
    student = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[scale * math.log(3.0), 0.0]])
    return student, teacher


def test_beta_zero_is_forward_kl():
    # KL(p_T‖p_S) = 0.75·log(0.75/0.5) + 0.25·log(0.25/0.5) = 0.304099 − 0.173287 = 0.130812
    s, t = logits()
    assert kl(P_T, P_S) == pytest.approx(0.130812, abs=1e-6)
    assert generalized_jsd_loss(s, t, beta=0.0).item() == pytest.approx(kl(P_T, P_S), abs=1e-6)
    assert forward_kl(s, t).item() == pytest.approx(0.130812, abs=1e-6)


def test_beta_one_is_reverse_kl():
    # KL(p_S‖p_T) = 0.5·log(0.5/0.75) + 0.5·log(0.5/0.25) = −0.202733 + 0.346574 = 0.143841
    s, t = logits()
    assert kl(P_S, P_T) == pytest.approx(0.143841, abs=1e-6)
    assert generalized_jsd_loss(s, t, beta=1.0).item() == pytest.approx(kl(P_S, P_T), abs=1e-6)
    assert reverse_kl(s, t).item() == pytest.approx(0.143841, abs=1e-6)


def test_beta_half_is_jsd():
    # p_M = [0.625, 0.375]; 0.5·KL(p_T‖p_M) + 0.5·KL(p_S‖p_M) = 0.5·0.035375 + 0.5·0.032269 = 0.033822
    s, t = logits()
    expected = 0.5 * kl(P_T, mix(0.5)) + 0.5 * kl(P_S, mix(0.5))
    assert expected == pytest.approx(0.033822, abs=1e-6)
    assert generalized_jsd_loss(s, t, beta=0.5).item() == pytest.approx(expected, abs=1e-6)


def test_mixture_weights_follow_beta():
    # β = 0.3: p_M = 0.7·p_S + 0.3·p_T = [0.575, 0.425]; loss = 0.3·KL(p_T‖p_M) + 0.7·KL(p_S‖p_M)
    s, t = logits()
    assert mix(0.3) == pytest.approx((0.575, 0.425))
    expected = 0.3 * kl(P_T, mix(0.3)) + 0.7 * kl(P_S, mix(0.3))
    assert generalized_jsd_loss(s, t, beta=0.3).item() == pytest.approx(expected, abs=1e-6)


def test_temperature_divides_logits():
    # Teacher logits [2·log 3, 0] at temperature 2 give p_T = [0.75, 0.25] again.
    s, t = logits(scale=2.0)
    assert generalized_jsd_loss(s, t, beta=1.0, temperature=2.0).item() == pytest.approx(kl(P_S, P_T), abs=1e-6)


def test_reductions_with_mask():
    # (B=1, T=3, V=2): tokens 0 and 2 are (p_S, p_T) pairs, token 1 is identical distributions (divergence 0) and
    # token 2 is masked out. Reverse KL per token: [0.143841, 0, 0.143841·masked].
    s = torch.tensor([[[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]])
    t = torch.tensor([[[math.log(3.0), 0.0], [1.0, 2.0], [math.log(3.0), 0.0]]])
    mask = torch.tensor([[1, 1, 0]])
    d = kl(P_S, P_T)
    none = generalized_jsd_loss(s, t, mask, beta=1.0, reduction="none")
    assert none.shape == (1, 3)
    assert none[0].tolist() == pytest.approx([d, 0.0, 0.0], abs=1e-6)
    assert generalized_jsd_loss(s, t, mask, beta=1.0, reduction="sum").item() == pytest.approx(d, abs=1e-6)
    # batchmean: sum / 2 valid tokens; mean: sum / (2 tokens × V=2)
    assert generalized_jsd_loss(s, t, mask, beta=1.0).item() == pytest.approx(d / 2, abs=1e-6)
    assert generalized_jsd_loss(s, t, mask, beta=1.0, reduction="mean").item() == pytest.approx(d / 4, abs=1e-6)
    # No mask: all 3 tokens count.
    assert generalized_jsd_loss(s, t, beta=1.0).item() == pytest.approx(2 * d / 3, abs=1e-6)
    # Nothing valid: 0, not NaN.
    assert generalized_jsd_loss(s, t, torch.zeros(1, 3), beta=1.0).item() == 0.0


def test_zero_probability_tokens_do_not_give_nan():
    # Teacher puts zero mass on token 1 (logit −inf): forward KL = 1·log(1/0.5) = log 2.
    s = torch.tensor([[0.0, 0.0]])
    t = torch.tensor([[0.0, float("-inf")]])
    assert forward_kl(s, t).item() == pytest.approx(math.log(2.0), abs=1e-6)
    assert torch.isfinite(generalized_jsd_loss(s, t, beta=0.5))


def test_bad_options():
    s, t = logits()
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd_loss(s, t, beta=1.5)
    with pytest.raises(ValueError, match="reduction.*batchmean"):
        generalized_jsd_loss(s, t, reduction="avg")
    with pytest.raises(ValueError, match="same shape"):
        generalized_jsd_loss(s, torch.zeros(1, 3))


def make_heads(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, t, h, v = 3, 7, 8, 11
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    bias = torch.randn(v, generator=g, dtype=torch.float64) * 0.1
    t_hidden = torch.randn(b, t, 5, generator=g, dtype=torch.float64)
    t_weight = torch.randn(v, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.3
    return hidden, weight, bias, t_hidden, t_weight, mask


@pytest.mark.invariance
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
def test_chunked_equals_naive_value_and_gradient(beta, reduction):
    hidden, weight, bias, t_hidden, t_weight, mask = make_heads()

    def run(chunked: bool):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        bb = bias.clone().requires_grad_(True)
        kw = dict(beta=beta, temperature=1.5, reduction=reduction)
        if chunked:
            out = chunked_generalized_jsd(
                h, w, student_bias=bb, teacher_hidden=t_hidden, teacher_weight=t_weight, mask=mask, chunk_size=4, **kw
            )
        else:
            out = generalized_jsd_loss(h @ w.T + bb, t_hidden @ t_weight.T, mask, **kw)
        # A non-uniform cotangent for "none" so every per-token gradient is checked.
        (out * torch.arange(1.0, out.numel() + 1, dtype=out.dtype).reshape(out.shape)).sum().backward()
        return out.detach(), h.grad, w.grad, bb.grad

    naive, chunked = run(False), run(True)
    for a, b in zip(naive, chunked):
        assert torch.allclose(a, b, atol=1e-6), (a, b)
    assert naive[0].abs().sum() > 0 and naive[2].abs().sum() > 0


def test_chunked_teacher_logits_fn_and_no_grad_path():
    hidden, weight, _, t_hidden, t_weight, mask = make_heads(seed=1)
    teacher_logits = (t_hidden @ t_weight.T).reshape(-1, weight.size(0))
    naive = generalized_jsd_loss(hidden @ weight.T, teacher_logits.reshape(3, 7, -1), mask, beta=0.5)
    seen = []

    def teacher_fn(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.numel())
        return teacher_logits[rows]

    with torch.no_grad():
        got = chunked_generalized_jsd(hidden, weight, teacher_logits_fn=teacher_fn, mask=mask, beta=0.5, chunk_size=5)
    assert got.item() == pytest.approx(naive.item(), abs=1e-9)
    # Only valid tokens are processed, in chunks of at most 5.
    assert sum(seen) == int(mask.sum()) and max(seen) <= 5


def test_chunked_needs_a_teacher():
    hidden, weight, *_ = make_heads()
    with pytest.raises(ValueError, match="teacher_hidden.*teacher_logits_fn"):
        chunked_generalized_jsd(hidden, weight)


def test_chunked_recomputes_logits_in_backward_and_teacher_gets_no_grad():
    hidden, weight, _, t_hidden, t_weight, mask = make_heads(seed=2)
    h = hidden.clone().requires_grad_(True)
    th = t_hidden.clone().requires_grad_(True)
    calls = []

    def teacher_fn(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.numel())
        return th.reshape(-1, th.size(-1))[rows] @ t_weight.T

    loss = chunked_generalized_jsd(h, weight, teacher_logits_fn=teacher_fn, mask=mask, beta=0.5, chunk_size=4)
    n_chunks = math.ceil(int(mask.sum()) / 4)
    assert len(calls) == n_chunks
    loss.backward()
    # Each chunk ran again during backward (checkpoint recomputation): logits were not kept from forward.
    assert len(calls) == 2 * n_chunks
    assert h.grad is not None and th.grad is None
