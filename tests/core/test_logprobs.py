"""posttrain.core.logprobs: hand-computed values, equality with the naive full-logits path (values and gradients),
and the memory property of the chunked kernel (no saved tensor of N × V elements)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.logprobs import chunked_logprobs_from_hidden, entropy_from_logits, selective_log_softmax


def _naive(hidden, weight, labels, bias=None, temperature=1.0, ignore_index=-100):
    """Reference: full (N, V) logits, log_softmax, gather; returns (logps, entropy)."""
    logits = hidden.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    logps = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy


def _inputs(n=37, h=8, v=50, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    bias = (torch.randn(v, generator=g) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, bias, labels


def _clone_leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


# ------------------------------------------------------------------ selective_log_softmax / entropy_from_logits


def test_selective_log_softmax_hand_computed():
    """logits = ln[1, 2, 5] -> p = [1/8, 2/8, 5/8]; index 2 -> ln(5/8), index 0 -> ln(1/8)."""
    logits = torch.log(torch.tensor([[1.0, 2.0, 5.0], [1.0, 2.0, 5.0]]))
    out = selective_log_softmax(logits, torch.tensor([2, 0]))
    torch.testing.assert_close(out, torch.tensor([math.log(5 / 8), math.log(1 / 8)]))


@pytest.mark.invariance
def test_selective_log_softmax_matches_naive_values_and_grad():
    """(B, T, V) logits, chunk of 5 rows over 12 positions: same values and d/dlogits as log_softmax + gather."""
    logits = torch.randn(3, 4, 11, requires_grad=True)
    index = torch.randint(0, 11, (3, 4))
    weights = torch.randn(3, 4)
    out = selective_log_softmax(logits, index, chunk_size=5)
    ref_logits = _clone_leaf(logits)
    ref = torch.log_softmax(ref_logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, ref)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_selective_log_softmax_bf16_computes_in_fp32():
    """bf16 logits: result is float32 and equals the float32 log-softmax of the same (bf16-representable) values."""
    logits = torch.randn(6, 300).to(torch.bfloat16)
    index = torch.randint(0, 300, (6,))
    out = selective_log_softmax(logits, index)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, ref)


def test_entropy_from_logits_hand_computed():
    """Uniform over 4 -> ln 4 = 1.386294; p = [1/4, 3/4] -> −(¼ ln ¼ + ¾ ln ¾) = 0.562335."""
    uniform = torch.zeros(1, 4)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.tensor([math.log(4)]))
    two = torch.log(torch.tensor([[1.0, 3.0]]))
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(two).item() == pytest.approx(expected, abs=1e-6)


def test_entropy_from_logits_with_masked_vocab():
    """A −inf logit (masked token) has p = 0 and contributes nothing: [0, −inf, ln 3] -> p = [¼, 0, ¾],
    H = 0.562335 as before; the gradient is finite and 0 at the masked entry."""
    logits = torch.tensor([[0.0, float("-inf"), math.log(3)]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 1].item() == 0.0


@pytest.mark.invariance
def test_entropy_from_logits_matches_naive_values_and_grad():
    """Chunked entropy (chunk 3 over 2×5 positions) equals −Σ p log p, and so does its gradient."""
    logits = torch.randn(2, 5, 7, requires_grad=True)
    weights = torch.randn(2, 5)
    out = entropy_from_logits(logits, chunk_size=3)
    ref_logits = _clone_leaf(logits)
    log_probs = torch.log_softmax(ref_logits, -1)
    ref = -(log_probs.exp() * log_probs).sum(-1)
    torch.testing.assert_close(out, ref)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


# ------------------------------------------------------------------ chunked_logprobs_from_hidden


def test_chunked_hand_computed_value_and_gradient():
    """H = 1, hidden = [1], W = [[0], [ln 3]]: logits [0, ln 3], p = [1/4, 3/4], label 1 -> logp = ln ¾.

    d logp / d hidden = Σ_v (1[v=1] − p_v) W_v = (1 − ¾)·ln 3 + (0 − ¼)·0 = ¼ ln 3 = 0.274653.
    d logp / d W = (onehot − p) ⊗ hidden = [[−¼], [¼]].
    With temperature 2: logits [0, ln3 / 2], p_1 = √3 / (1 + √3) -> logp = ln(√3 / (1 + √3)) = −0.455727.
    """
    hidden = torch.tensor([[1.0]], requires_grad=True)
    weight = torch.tensor([[0.0], [math.log(3)]], requires_grad=True)
    logps, entropy = chunked_logprobs_from_hidden(hidden, weight, torch.tensor([1]))
    assert entropy is None
    assert logps.item() == pytest.approx(math.log(0.75), abs=1e-6)
    logps.sum().backward()
    assert hidden.grad.item() == pytest.approx(0.25 * math.log(3), abs=1e-6)
    torch.testing.assert_close(weight.grad, torch.tensor([[-0.25], [0.25]]))
    hot, _ = chunked_logprobs_from_hidden(hidden, weight, torch.tensor([1]), temperature=2.0)
    assert hot.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)


@pytest.mark.invariance
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_bias", [False, True])
def test_chunked_matches_naive_values_and_grads(temperature, use_bias):
    """N = 37 positions in chunks of 8 (not a divisor), some ignored labels: logps, entropies and the gradients
    w.r.t. hidden, weight and bias equal the full-logits path within 1e-5."""
    hidden, weight, bias, labels = _inputs()
    labels[[0, 9, 36]] = -100
    bias = bias if use_bias else None
    upstream = torch.randn(37)
    logps, entropy = chunked_logprobs_from_hidden(
        hidden, weight, labels, bias=bias, temperature=temperature, chunk_size=8, compute_entropy=True
    )
    ref_h, ref_w = _clone_leaf(hidden), _clone_leaf(weight)
    ref_b = _clone_leaf(bias) if use_bias else None
    ref_logps, ref_entropy = _naive(ref_h, ref_w, labels, ref_b, temperature)
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert logps[[0, 9, 36]].tolist() == [0.0, 0.0, 0.0]
    assert not entropy.requires_grad  # detached: a metric / mask input

    (logps * upstream).sum().backward()
    (ref_logps * upstream).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref_w.grad, atol=1e-5, rtol=1e-5)
    if use_bias:
        torch.testing.assert_close(bias.grad, ref_b.grad, atol=1e-5, rtol=1e-5)
    # an ignored position sends no gradient into its hidden state
    assert hidden.grad[[0, 9, 36]].abs().max().item() == 0.0


def test_chunked_accepts_batch_time_shape():
    """(B, T, H) hidden with (B, T) labels gives (B, T) outputs equal to the flattened call."""
    hidden, weight, _, labels = _inputs(n=12)
    flat, _ = chunked_logprobs_from_hidden(hidden, weight, labels, chunk_size=5)
    shaped, ent = chunked_logprobs_from_hidden(
        hidden.reshape(3, 4, -1), weight, labels.reshape(3, 4), chunk_size=5, compute_entropy=True
    )
    assert shaped.shape == (3, 4) and ent.shape == (3, 4)
    torch.testing.assert_close(shaped.reshape(-1), flat)


@pytest.mark.invariance
def test_chunked_differentiable_entropy_matches_naive():
    """entropy_requires_grad=True: d(Σ c·H + Σ u·logp)/d(hidden, weight, bias) equals the naive path."""
    hidden, weight, bias, labels = _inputs(n=21)
    labels[3] = -100
    c, u = torch.randn(21), torch.randn(21)
    logps, entropy = chunked_logprobs_from_hidden(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=0.9,
        chunk_size=4,
        compute_entropy=True,
        entropy_requires_grad=True,
    )
    assert entropy.requires_grad
    ref_h, ref_w, ref_b = _clone_leaf(hidden), _clone_leaf(weight), _clone_leaf(bias)
    ref_logps, ref_entropy = _naive(ref_h, ref_w, labels, ref_b, 0.9)
    ((entropy * c).sum() + (logps * u).sum()).backward()
    ((ref_entropy * c).sum() + (ref_logps * u).sum()).backward()
    for got, want in [(hidden.grad, ref_h.grad), (weight.grad, ref_w.grad), (bias.grad, ref_b.grad)]:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chunked_entropy_only_gradient():
    """Only the entropy is used in the loss: the logp term is skipped and the gradient equals d(Σ H)/d hidden."""
    hidden, weight, _, labels = _inputs(n=9)
    _, entropy = chunked_logprobs_from_hidden(
        hidden, weight, labels, chunk_size=4, compute_entropy=True, entropy_requires_grad=True
    )
    entropy.sum().backward()
    ref_h = _clone_leaf(hidden)
    _naive(ref_h, weight.detach(), labels)[1].sum().backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad, atol=1e-5, rtol=1e-5)


def test_chunked_respects_requires_grad():
    """A frozen LM head (weight.requires_grad=False) gets no gradient; the hidden states still do."""
    hidden, weight, _, labels = _inputs(n=10)
    weight = weight.detach()
    logps, _ = chunked_logprobs_from_hidden(hidden, weight, labels, chunk_size=3)
    logps.sum().backward()
    assert weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        logps, _ = chunked_logprobs_from_hidden(hidden, weight, labels)
    assert not logps.requires_grad


def test_chunked_bf16_inputs_compute_in_fp32():
    """bf16 hidden/weight: outputs are float32 and equal the float32 computation on the same bf16 values; the
    gradients come back in bf16 and are close to the float32 ones."""
    hidden, weight, _, labels = _inputs(n=16, dtype=torch.bfloat16)
    logps, entropy = chunked_logprobs_from_hidden(hidden, weight, labels, chunk_size=5, compute_entropy=True)
    assert logps.dtype == torch.float32 and entropy.dtype == torch.float32
    ref_h = hidden.detach().float().requires_grad_()
    ref_w = weight.detach().float().requires_grad_()
    ref_logps, ref_entropy = _naive(ref_h, ref_w, labels)
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    logps.sum().backward()
    ref_logps.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.grad.float(), ref_h.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(weight.grad.float(), ref_w.grad, atol=2e-2, rtol=2e-2)


def test_chunked_ignores_autocast():
    """Inside torch.autocast(bfloat16) (mixed-precision training) the logits are still float32: same values and
    gradients as without autocast."""
    hidden, weight, bias, labels = _inputs(n=20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps, entropy = chunked_logprobs_from_hidden(
            hidden, weight, labels, bias=bias, chunk_size=6, compute_entropy=True
        )
        selected = selective_log_softmax(hidden.detach() @ weight.detach().T, labels)
    assert logps.dtype == torch.float32
    logps.sum().backward()
    ref_h, ref_w, ref_b = _clone_leaf(hidden), _clone_leaf(weight), _clone_leaf(bias)
    ref_logps, ref_entropy = _naive(ref_h, ref_w, labels, ref_b)
    ref_logps.sum().backward()
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref_w.grad, atol=1e-5, rtol=1e-5)
    # logits built under autocast are bf16; selective_log_softmax still reduces them in float32
    assert selected.dtype == torch.float32


def _saved_numels(fn):
    """Run fn under saved_tensors_hooks and return the element counts of every tensor saved for backward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sizes, out


def test_chunked_saves_no_full_logits_for_backward():
    """N = 64, V = 512, chunk 16: the naive path saves an N×V = 32768-element tensor for backward; the chunked
    kernel's largest saved tensor is the weight (V×H = 8192) — memory no longer scales with N × V."""
    n, h, v = 64, 16, 512
    hidden, weight, bias, labels = _inputs(n=n, h=h, v=v)
    chunked_sizes, (logps, _) = _saved_numels(
        lambda: chunked_logprobs_from_hidden(hidden, weight, labels, bias=bias, chunk_size=16, compute_entropy=True)
    )
    naive_sizes, (ref, _) = _saved_numels(lambda: _naive(hidden, weight, labels, bias))
    assert max(naive_sizes) >= n * v
    assert max(chunked_sizes) < n * v
    assert max(chunked_sizes) == v * h
    logps.sum().backward()  # the saved tensors are enough to run backward
    assert hidden.grad is not None


def test_chunked_input_validation():
    hidden, weight, _, labels = _inputs(n=4)
    with pytest.raises(ValueError, match="labels shape"):
        chunked_logprobs_from_hidden(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="weight must have shape"):
        chunked_logprobs_from_hidden(hidden, weight.T, labels)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs_from_hidden(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs_from_hidden(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="bias"):
        chunked_logprobs_from_hidden(hidden, weight, labels, bias=torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_peak_cuda_memory_does_not_scale_with_n_times_v():
    """Large vocabulary (V = 151 936): the forward+backward peak of the chunked kernel stays far below the naive
    path's, whose fp32 logits alone take N·V·4 bytes; and both agree."""
    device = torch.device("cuda")
    n, h, v = 4096, 256, 151_936
    g = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(n, h, device=device, generator=g) * 0.1).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=g) * 0.1).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device, generator=g)

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        out.sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out.detach()

    chunked_peak, chunked = peak(lambda: chunked_logprobs_from_hidden(hidden, weight, labels, chunk_size=128)[0])
    hidden.grad = weight.grad = None
    naive_peak, naive = peak(lambda: _naive(hidden, weight, labels)[0])
    logits_bytes = n * v * 4
    assert naive_peak > logits_bytes
    # chunked: float32 weight copy + float32 weight grad + two (128, V) buffers, about 0.6 GB vs 2.5 GB of logits
    assert chunked_peak < logits_bytes / 2
    torch.testing.assert_close(chunked, naive, atol=1e-3, rtol=1e-3)


# ------------------------------------------------------------------ vocabulary tiling (vocab_chunk_size)


def test_vocab_tiled_hand_computed_entropy_combination():
    """V = 4 in blocks of 2, logits [0, ln 3 | 0, 0] (W rows 0, ln 3, 0, 0 with hidden [1]): Σ e^z = 1 + 3 + 1 + 1 = 6,
    p = [1/6, 1/2, 1/6, 1/6]; label 1 -> logp = ln ½; H = −Σ p ln p = ½ ln 2 + 3·(1/6) ln 6 = ln 2 / 2 + ln 6 / 2.
    Block masses 4/6 and 2/6, block entropies (of [¼, ¾] and [½, ½]) combine as Σ m_k (H_k + lse − lse_k)."""
    hidden = torch.tensor([[1.0]], requires_grad=True)
    weight = torch.tensor([[0.0], [math.log(3)], [0.0], [0.0]], requires_grad=True)
    logps, entropy = chunked_logprobs_from_hidden(
        hidden, weight, torch.tensor([1]), compute_entropy=True, vocab_chunk_size=2
    )
    assert logps.item() == pytest.approx(math.log(0.5), abs=1e-6)
    assert entropy.item() == pytest.approx(math.log(2) / 2 + math.log(6) / 2, abs=1e-6)
    logps.sum().backward()
    # d logp / d hidden = Σ_v (1[v=1] − p_v) W_v = (1 − ½) ln 3
    assert hidden.grad.item() == pytest.approx(0.5 * math.log(3), abs=1e-6)
    torch.testing.assert_close(weight.grad, torch.tensor([[-1 / 6], [0.5], [-1 / 6], [-1 / 6]]))


@pytest.mark.invariance
@pytest.mark.parametrize("vocab_chunk_size", [7, 16, 49])
@pytest.mark.parametrize("use_bias", [False, True])
def test_vocab_tiled_matches_untiled_and_naive(vocab_chunk_size, use_bias):
    """Blocks that do not divide V = 50 (7, 16, 49), chunks of 8 over N = 37 with ignored labels, temperature 0.8,
    a differentiable entropy: logps, entropies and every gradient equal the naive full-logits path within 1e-5."""
    hidden, weight, bias, labels = _inputs()
    labels[[0, 9, 36]] = -100
    labels[5], labels[6] = 0, 49  # first and last vocabulary rows (block edges)
    bias = bias if use_bias else None
    c, u = torch.randn(37), torch.randn(37)
    logps, entropy = chunked_logprobs_from_hidden(
        hidden, weight, labels, bias=bias, temperature=0.8, chunk_size=8, compute_entropy=True,
        entropy_requires_grad=True, vocab_chunk_size=vocab_chunk_size,
    )  # fmt: skip
    ref_h, ref_w = _clone_leaf(hidden), _clone_leaf(weight)
    ref_b = _clone_leaf(bias) if use_bias else None
    ref_logps, ref_entropy = _naive(ref_h, ref_w, labels, ref_b, 0.8)
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert logps[[0, 9, 36]].tolist() == [0.0, 0.0, 0.0]
    ((logps * u).sum() + (entropy * c).sum()).backward()
    ((ref_logps * u).sum() + (ref_entropy * c).sum()).backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref_w.grad, atol=1e-5, rtol=1e-5)
    if use_bias:
        torch.testing.assert_close(bias.grad, ref_b.grad, atol=1e-5, rtol=1e-5)


def test_vocab_tiled_block_of_minus_inf_logits_has_zero_mass():
    """A bias of −inf on a whole block (a masked part of the vocabulary): that block gets mass 0, the entropy stays
    finite and equals the entropy over the other block; gradients are finite."""
    hidden, weight, _, labels = _inputs(n=6, v=20)
    labels = labels.clamp(max=9)
    bias = torch.zeros(20)
    bias[10:] = float("-inf")
    logps, entropy = chunked_logprobs_from_hidden(
        hidden, weight, labels, bias=bias, compute_entropy=True, vocab_chunk_size=10
    )
    ref_logps, ref_entropy = _naive(_clone_leaf(hidden)[:, :], weight[:10].detach(), labels)
    torch.testing.assert_close(logps.detach(), ref_logps.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    logps.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_vocab_tiled_in_place_weight_grad_accumulates():
    """weight_grad_in_place with vocabulary blocks: two calls add into weight.grad exactly as autograd's sum."""
    hidden, weight, _, labels = _inputs(n=11, v=30)
    for _ in range(2):
        lp, _ = chunked_logprobs_from_hidden(
            hidden, weight, labels, chunk_size=4, vocab_chunk_size=8, weight_grad_in_place=True
        )
        lp.sum().backward()
    ref_w = _clone_leaf(weight)
    for _ in range(2):
        _naive(hidden.detach(), ref_w, labels)[0].sum().backward()
    torch.testing.assert_close(weight.grad, ref_w.grad, atol=1e-5, rtol=1e-5)


def test_vocab_chunk_size_none_or_whole_vocab_is_the_untiled_path_bitwise():
    """None, and a block at least V, run the untiled kernel: identical bits (small vocabularies keep their numbers)."""
    hidden, weight, bias, labels = _inputs()
    outs = [
        chunked_logprobs_from_hidden(
            hidden, weight, labels, bias=bias, chunk_size=8, compute_entropy=True, vocab_chunk_size=vc
        )
        for vc in (None, 50, 1000)
    ]
    for logps, entropy in outs[1:]:
        assert torch.equal(logps, outs[0][0]) and torch.equal(entropy, outs[0][1])


def test_vocab_chunk_size_validation():
    hidden, weight, _, labels = _inputs(n=4)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="vocab_chunk_size"):
            chunked_logprobs_from_hidden(hidden, weight, labels, vocab_chunk_size=bad)
