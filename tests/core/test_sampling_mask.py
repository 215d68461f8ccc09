"""The sampling mask (issue 40, ``keep_sampling_mask``): the masked log-softmax and entropy of the chunked and
vocabulary-tiled kernels against hand-computed values and a naive full-logits reference (values and gradients), and
the sampler-side description of the kept support."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.logprobs import chunked_logprobs_from_hidden
from posttrain.core.sampling_mask import (
    apply_sampling_mask,
    collate_sampling_mask,
    describe_kept_support,
    sampling_mask_entries,
)

INF = float("inf")


def _mask(rows: list[tuple[list[int], float]], k: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), k), -1, dtype=torch.int32)
    for r, (row_ids, _) in enumerate(rows):
        ids[r, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.int32)
    return ids, torch.tensor([tau for _, tau in rows], dtype=torch.float32)


# z = h @ Wᵀ with W = I: the logits are the hidden states, and dL/dh = dL/dz.
Z = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 4))  # p ∝ (1, 2, 3, 4)
LABELS = torch.tensor([2, 3, 3, 1])
HAND_MASK = [([1, 2], INF), ([], 0.5), ([], -INF), ([], 10.0)]  # ids {1, 2}; z ≥ 0.5 → {1, 2, 3}; unknown; label only


def _hand_expected() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, dlogp/dz, H, dH/dz) computed by hand for the four rows."""
    supports = [[0, 0.4, 0.6, 0], [0, 2 / 9, 3 / 9, 4 / 9], [0.1, 0.2, 0.3, 0.4], [0, 1.0, 0, 0]]
    p = torch.tensor(supports, dtype=torch.float64)
    logp = torch.tensor([math.log(3 / 5), math.log(4 / 9), math.log(4 / 10), 0.0])
    onehot = torch.nn.functional.one_hot(LABELS, 4).double()
    grad_logp = onehot - p  # ∂ log p_y / ∂ z_v = 1[v = y] − p_v, p the masked softmax (0 outside the support)
    logs = torch.where(p > 0, p.log(), torch.zeros_like(p))
    entropy = -(p * logs).sum(-1)
    grad_entropy = -p * (logs + entropy[:, None])  # ∂H/∂z_v = −p_v (log p_v + H), 0 outside the support
    return logp.float(), grad_logp.float(), entropy.float(), grad_entropy.float()


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", [(4, None), (1, None), (3, None), (4, 3), (1, 1), (3, 2)])
def test_masked_log_softmax_and_gradient_by_hand(chunk_size, vocab_chunk_size):
    logp_hand, grad_logp_hand, entropy_hand, grad_entropy_hand = _hand_expected()
    for output in ("logp", "entropy"):
        hidden = Z.clone().requires_grad_()
        logp, entropy = chunked_logprobs_from_hidden(
            hidden, torch.eye(4), LABELS, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
            compute_entropy=True, entropy_requires_grad=True, sampling_mask=_mask(HAND_MASK),
        )  # fmt: skip
        torch.testing.assert_close(logp, logp_hand, atol=1e-6, rtol=0)
        torch.testing.assert_close(entropy, entropy_hand, atol=1e-6, rtol=0)
        (logp if output == "logp" else entropy).sum().backward()
        expected = grad_logp_hand if output == "logp" else grad_entropy_hand
        torch.testing.assert_close(hidden.grad, expected, atol=1e-6, rtol=0)


def _naive(hidden, weight, bias, labels, temperature, ids, threshold):
    """Full logits, masked, autograd's log-softmax: the reference."""
    z = (hidden @ weight.T + bias) / temperature
    log_p = torch.log_softmax(apply_sampling_mask(z, labels, ids, threshold), dim=-1)
    logp = log_p.gather(-1, labels[:, None]).squeeze(-1)
    finite = torch.where(torch.isinf(log_p), torch.zeros_like(log_p), log_p)
    entropy = -(log_p.exp() * finite).sum(-1)
    return logp, entropy


def _random_problem(seed: int = 0, n: int = 13, h: int = 8, v: int = 37, k: int = 4):
    g = torch.Generator().manual_seed(seed)
    hidden, weight, bias = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.randn(v, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    ids = torch.full((n, k), -1, dtype=torch.int32)
    threshold = torch.full((n,), -INF)  # rows 8.. : unknown support (full softmax)
    ids[0, :3] = torch.tensor([1, 2, 3])
    ids[1, :4] = torch.tensor([5, 6, 7, 36])  # ids in several vocabulary blocks
    threshold[:2] = INF
    threshold[2:7] = torch.randn(5, generator=g)  # threshold form (some labels fall below: kept anyway)
    threshold[7] = 1e9  # only the label
    return hidden, weight, bias, labels, ids, threshold


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 13, 64])
@pytest.mark.parametrize("vocab_chunk_size", [None, 5, 16, 37])
def test_chunked_and_tiled_equal_naive_values_and_gradients(chunk_size, vocab_chunk_size):
    hidden, weight, bias, labels, ids, threshold = _random_problem()
    weights_out = torch.linspace(0.5, 1.5, labels.shape[0])
    results = []
    for kind in ("kernel", "naive"):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        if kind == "kernel":
            logp, entropy = chunked_logprobs_from_hidden(
                leaves[0], leaves[1], labels, bias=leaves[2], temperature=0.7, chunk_size=chunk_size,
                vocab_chunk_size=vocab_chunk_size, compute_entropy=True, entropy_requires_grad=True,
                sampling_mask=(ids, threshold),
            )  # fmt: skip
        else:
            logp, entropy = _naive(*leaves, labels, 0.7, ids, threshold)
        grads_logp = torch.autograd.grad((logp * weights_out).sum(), leaves, retain_graph=True)
        grads_entropy = torch.autograd.grad(entropy.sum(), leaves)
        results.append((logp.detach(), entropy.detach(), grads_logp, grads_entropy))
    (lp, ent, gl, ge), (lp_ref, ent_ref, gl_ref, ge_ref) = results
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
    for got, want in zip((*gl, *ge), (*gl_ref, *ge_ref)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # label-only support: p = 1 (the dropped logits sit 60 nats below: e^−60 each, below float32 rounding of 1)
    assert torch.isfinite(lp).all() and lp[7] == 0.0 and 0.0 <= ent[7] < 1e-20


def test_unknown_support_is_the_full_softmax_and_the_mask_changes_the_rest():
    hidden, weight, bias, labels, ids, threshold = _random_problem()
    masked, _ = chunked_logprobs_from_hidden(hidden, weight, labels, bias=bias, sampling_mask=(ids, threshold))
    full, _ = chunked_logprobs_from_hidden(hidden, weight, labels, bias=bias)
    torch.testing.assert_close(masked[8:], full[8:], atol=0, rtol=0)  # unknown: bit for bit the unmasked kernel
    assert (masked[:8] > full[:8]).all()  # a smaller support renormalises: every kept log-prob goes up
    none = (torch.full_like(ids, -1), torch.full_like(threshold, -INF))
    torch.testing.assert_close(
        chunked_logprobs_from_hidden(hidden, weight, labels, bias=bias, sampling_mask=none)[0], full, atol=0, rtol=0
    )


def test_sampling_mask_shape_is_checked():
    hidden, weight, bias, labels, ids, threshold = _random_problem()
    with pytest.raises(ValueError, match="sampling_mask must be"):
        chunked_logprobs_from_hidden(hidden, weight, labels, sampling_mask=(ids[:3], threshold))


def _warp(name: str, value, scores: torch.Tensor) -> torch.Tensor:
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    cls = {"top_k": TopKLogitsWarper, "top_p": TopPLogitsWarper, "min_p": MinPLogitsWarper}[name]
    return cls(value, min_tokens_to_keep=1)(None, scores.clone())


@pytest.mark.parametrize("name,value", [("top_k", 5), ("top_k", 40), ("top_p", 0.8), ("top_p", 0.99), ("min_p", 0.1)])
def test_described_support_replays_the_warpers_kept_set(name, value):
    """Replayed on the same scores, the description keeps exactly the tokens the warper kept (ids or threshold)."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(6, 300, generator=g) * torch.tensor([0.5, 1, 2, 4, 8, 16])[:, None]  # flat to peaked
    truncated = _warp(name, value, scores)
    ids, threshold = describe_kept_support(scores, truncated)
    assert ids.shape == (6, 16) and ids.dtype == torch.int32
    labels = truncated.argmax(-1)
    keep = torch.isfinite(apply_sampling_mask(scores, labels, ids, threshold))
    assert torch.equal(keep, torch.isfinite(truncated))
    small = torch.isfinite(truncated).sum(-1) <= 16
    assert torch.equal(threshold == INF, small)  # ids form exactly where the kept set fits in 16 ids
    assert torch.isfinite(threshold[~small]).all()


def test_nothing_truncated_or_a_tied_cut_is_unknown():
    scores = torch.tensor([[0.0, 1.0, 2.0] + [-5.0] * 20, [3.0, 1.0, 1.0] + [-5.0] * 20])
    ids, threshold = describe_kept_support(scores, scores.clone())  # nothing dropped
    assert (threshold == -INF).all()
    tied = torch.full((1, 40), 1.0)
    cut = tied.clone()
    cut[0, 20:] = -INF  # a cut between equal scores (top-p on ties), more than 16 kept: no threshold separates it
    ids, threshold = describe_kept_support(tied, cut)
    assert threshold.item() == -INF and (ids == -1).all()


def test_entries_and_collation_round_trip():
    ids = torch.tensor([[4, 2, -1], [-1, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    threshold = torch.tensor([INF, 0.25, -INF])
    entries = sampling_mask_entries(ids, threshold)
    assert entries == [[4, 2], 0.25, None]
    out_ids, out_threshold = collate_sampling_mask([entries, None], width=4, max_ids=3)
    assert out_ids.shape == (2, 4, 3) and out_threshold.shape == (2, 4)
    assert torch.equal(out_ids[0, :3], ids) and torch.equal(out_threshold[0, :3], threshold)
    assert out_threshold[0, 3] == -INF and (out_threshold[1] == -INF).all() and (out_ids[1] == -1).all()
    with pytest.raises(ValueError, match="more than the 3 allowed"):
        collate_sampling_mask([[[1, 2, 3, 4]]], width=1, max_ids=3)
