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


def test_truncate_top_k_is_the_warper_and_names_the_kept_ids():
    """One topk both truncates (bit for bit the transformers top-k warper, ties at the cut kept) and names the kept
    ids; rows with a tie at the cut are flagged (their kept set can exceed k)."""
    from posttrain.core.sampling_mask import describe_top_k_support, truncate_top_k

    g = torch.Generator().manual_seed(2)
    scores = torch.randn(5, 200, generator=g)
    scores[3, :4] = scores[3].max() + 1.0  # four tied leaders with k = 3: a tie across the cut
    truncated, top, untied = truncate_top_k(scores, 3)
    assert torch.equal(truncated, _warp("top_k", 3, scores))
    assert untied.tolist() == [True, True, True, False, True]
    ids, threshold = describe_top_k_support(truncated, top)
    ref_ids, ref_threshold = describe_kept_support(scores, truncated)
    assert ids.shape == (5, 16) and (threshold == INF).all()
    for row in (0, 1, 2, 4):  # untied rows: the same kept set as the general description
        assert set(ids[row].tolist()) - {-1} == set(ref_ids[row].tolist()) - {-1} and len(set(ids[row].tolist())) == 4
    narrowed = _warp("top_p", 0.5, truncated)  # top-p after top-k keeps a subset of the top ids
    ids, _ = describe_top_k_support(narrowed, top)
    assert torch.equal(
        torch.isfinite(apply_sampling_mask(scores, narrowed.argmax(-1), ids, ids.new_zeros(5).float() + INF))[
            [0, 1, 2, 4]
        ],
        torch.isfinite(narrowed)[[0, 1, 2, 4]],
    )
    with pytest.raises(ValueError, match="1 <= k < V"):
        truncate_top_k(scores, 200)


@pytest.mark.parametrize("vocab_chunk_size", [None, 5])
def test_ids_form_rows_alone_take_the_sparse_path_exactly(vocab_chunk_size):
    """Every row in ids form (the sparse path: only the kept logits are computed), duplicated ids and an ignored
    position among them: values and gradients equal the naive masked softmax."""
    hidden, weight, bias, labels, _, _ = _random_problem(seed=3)
    n = labels.shape[0]
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 37, (n, 4), generator=g, dtype=torch.int32)
    ids[:, 3] = ids[:, 0]  # a duplicate id per row
    ids[5, 1:] = -1
    threshold = torch.full((n,), INF)
    labels = labels.clone()
    labels[2] = -100  # an ignored position: logp 0, no gradient, entropy over its ids
    results = []
    for kind in ("kernel", "naive"):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        if kind == "kernel":
            logp, entropy = chunked_logprobs_from_hidden(
                leaves[0], leaves[1], labels, bias=leaves[2], temperature=0.7, chunk_size=4,
                vocab_chunk_size=vocab_chunk_size, compute_entropy=True, entropy_requires_grad=True,
                sampling_mask=(ids, threshold),
            )  # fmt: skip
        else:
            safe = labels.clamp(min=0)
            logp, entropy = _naive(*leaves, safe, 0.7, ids, threshold)
            keep_label_out = safe != labels  # the naive reference keeps the (clamped) label: recompute row 2
            ids2 = ids[2:3].long()
            z2 = (leaves[0][2:3] @ leaves[1].T + leaves[2]) / 0.7
            kept = torch.zeros_like(z2, dtype=torch.bool).scatter_(1, ids2, True)
            lp2 = torch.log_softmax(z2.masked_fill(~kept, float("-inf")), -1)
            ent2 = -(lp2.exp() * torch.where(kept, lp2, torch.zeros_like(lp2))).sum(-1)
            logp = torch.where(keep_label_out, torch.zeros_like(logp), logp)
            entropy = torch.cat([entropy[:2], ent2, entropy[3:]])
        grads = torch.autograd.grad(logp.sum() + 0.5 * entropy.sum(), leaves)
        results.append((logp.detach(), entropy.detach(), grads))
    (lp, ent, gr), (lp_ref, ent_ref, gr_ref) = results
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(gr, gr_ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert lp[2] == 0.0
