"""Per-token log-probabilities and entropies without materialising full-vocabulary logits for a whole batch.

Three entry points:

* :func:`selective_log_softmax` — log p(index) from logits you already have, ``(..., V) -> (...)``.
* :func:`entropy_from_logits` — H = −Σ_v p_v log p_v from logits, ``(..., V) -> (...)``.
* :func:`chunked_logprobs_from_hidden` — log p(label) (and optionally H) straight from the last hidden states and
  the LM-head weight. Logits exist one chunk of tokens at a time, in the forward pass *and* in the backward pass
  (recomputed there), so peak memory grows with ``chunk_size × V``, not ``N × V``. This is the path the trainers
  use for policy, old and reference log-probs (design §3.1).

All three compute in float32 whatever the input dtype (bf16 log-softmax loses ~2 digits) and return float32. They
are custom ``torch.autograd.Function`` s that save only their inputs plus one float per token (the log-sum-exp, and
the entropy when it must be differentiated), and write the gradient chunk by chunk:

    ∂ log p_y / ∂ z_v = 1[v = y] − p_v          ∂ H / ∂ z_v = −p_v (log p_v + H)

where z are the (temperature-scaled) logits of one position.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

from posttrain.core.scratch import ScratchBuffers

__all__ = ["chunked_logprobs_from_hidden", "entropy_from_logits", "selective_log_softmax"]


# ----------------------------------------------------------------------------------------------------------------
# Chunk kernels shared by the autograd functions. ``z`` is always a float32 (c, V) buffer that the kernel may
# overwrite, so each chunk costs at most two (c, V) float32 buffers.
# ----------------------------------------------------------------------------------------------------------------


def _forward_chunk(
    z: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Return (logp of labels (c,), logsumexp (c,), entropy (c,) or None). Overwrites ``z`` when computing H."""
    lse = torch.logsumexp(z, dim=-1)
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    logp = z.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1) - lse
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    entropy = None
    if compute_entropy:
        probs = z.sub_(lse.unsqueeze(-1)).exp_()  # in place: z is a scratch buffer
        entropy = torch.special.entr(probs).sum(-1)  # entr(p) = −p log p, and entr(0) = 0 (underflowed p)
    return logp, lse, entropy


def _backward_chunk(
    z: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    label_here: torch.Tensor | None = None,
    probs_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return dL/dz (c, V) float32 for one chunk, given upstream grads of logp and entropy. Overwrites ``z``.

    ``z`` may be one block of the vocabulary (``lse`` and ``entropy`` are still the full-vocabulary ones); then
    ``labels`` are block-local ids and ``label_here`` (c,) says which rows' label falls inside the block.
    ``probs_out``: a buffer shaped like ``z`` for the probabilities (else one is allocated)."""
    log_probs = z.sub_(lse.unsqueeze(-1))  # (c, V), in place
    probs = log_probs.exp() if probs_out is None else torch.exp(log_probs, out=probs_out)
    grad = None
    if grad_entropy is not None:
        # ∂H/∂z = −p (log p + H); computed inside the log_probs buffer to avoid a third (c, V) tensor.
        grad = log_probs.add_(entropy.unsqueeze(-1)).mul_(probs).mul_(-grad_entropy.unsqueeze(-1))
        grad.nan_to_num_(nan=0.0)  # a −inf logit gives p = 0 and (−inf)·0 = NaN; its true gradient is 0
    if grad_logp is not None:
        g = torch.where(valid, grad_logp, torch.zeros_like(grad_logp))  # ignored positions get no gradient
        term = probs.mul_(-g.unsqueeze(-1))
        here = valid if label_here is None else valid & label_here
        safe_labels = torch.where(here, labels, torch.zeros_like(labels))
        onehot_g = g if label_here is None else torch.where(here, g, torch.zeros_like(g))
        term.scatter_add_(1, safe_labels.unsqueeze(-1), onehot_g.unsqueeze(-1))  # ∂logp/∂z = onehot(y) − p
        grad = term if grad is None else grad.add_(term)
    if grad is None:
        grad = log_probs.zero_()
    return grad


def _chunks(n: int, chunk_size: int):
    for start in range(0, n, chunk_size):
        yield start, min(start + chunk_size, n)


def _no_autocast(device: torch.device):
    """Float32 math even inside ``torch.autocast`` (mixed-precision training would run the matmuls in bf16)."""
    if device.type in ("cuda", "cpu", "xpu", "mps"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _scratch_float(x: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``x`` that the kernels may overwrite (``.float()`` alone aliases float32 inputs)."""
    z = x.float()
    return z.clone() if z.data_ptr() == x.data_ptr() else z


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")


# ----------------------------------------------------------------------------------------------------------------
# From logits
# ----------------------------------------------------------------------------------------------------------------


class _LogitsLogSoftmaxStats(torch.autograd.Function):
    """(logits (N, V), labels (N,)) -> (logp (N,), entropy (N,) or empty), computed chunk by chunk in float32."""

    @staticmethod
    def forward(ctx, logits, labels, chunk_size, ignore_index, compute_entropy):
        n = logits.shape[0]
        valid = labels != ignore_index
        logps = torch.empty(n, dtype=torch.float32, device=logits.device)
        lses = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropies = torch.empty(n if compute_entropy else 0, dtype=torch.float32, device=logits.device)
        with _no_autocast(logits.device):
            for s, e in _chunks(n, chunk_size):
                z = _scratch_float(logits[s:e]) if compute_entropy else logits[s:e].float()
                logp, lse, ent = _forward_chunk(z, labels[s:e], valid[s:e], compute_entropy)
                logps[s:e], lses[s:e] = logp, lse
                if compute_entropy:
                    entropies[s:e] = ent
        ctx.save_for_backward(logits, labels, lses, entropies)
        ctx.set_materialize_grads(False)  # an unused output then sends None, and its gradient term is skipped
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        if not compute_entropy:
            ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps, grad_entropies):
        logits, labels, lses, entropies = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        if entropies.numel() == 0:
            grad_entropies = None
        valid = labels != ctx.ignore_index
        grad_logits = torch.empty_like(logits)
        with _no_autocast(logits.device):
            for s, e in _chunks(logits.shape[0], ctx.chunk_size):
                g = _backward_chunk(
                    _scratch_float(logits[s:e]),
                    lses[s:e],
                    labels[s:e],
                    valid[s:e],
                    None if grad_logps is None else grad_logps[s:e],
                    None if grad_entropies is None else grad_entropies[s:e],
                    entropies[s:e] if grad_entropies is not None else None,
                )
                grad_logits[s:e] = g.to(logits.dtype)
        return grad_logits, None, None, None, None


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """log softmax(logits)[index], without a full ``(..., V)`` log-softmax tensor.

    logp = z_index − logsumexp_v(z_v), computed ``chunk_size`` positions at a time in float32. Only ``logits`` and
    one log-sum-exp per position are kept for backward (the autograd default would also keep a float32 copy of
    bf16 logits).

    Args:
        logits: ``(..., V)`` logits, any float dtype.
        index: ``(...)`` token ids in ``[0, V)``.
        chunk_size: positions per chunk; bounds the float32 scratch memory to ``chunk_size × V``.

    Returns:
        ``(...)`` float32 log-probabilities.
    """
    _check_chunk_size(chunk_size)
    if logits.shape[:-1] != index.shape:
        raise ValueError(
            f"index shape {tuple(index.shape)} must equal the logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}."
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_index = index.reshape(-1).long()
    # No index is ignored here: the ignore value only has to be one a real token id cannot take.
    logps, _ = _LogitsLogSoftmaxStats.apply(flat_logits, flat_index, chunk_size, -(2**62), False)
    return logps.reshape(index.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Entropy of the categorical distribution at every position: H = −Σ_v p_v log p_v, p = softmax(logits).

    Computed ``chunk_size`` positions at a time in float32; differentiable (∂H/∂z_v = −p_v (log p_v + H)), with
    only ``logits`` and two floats per position saved for backward.

    Args:
        logits: ``(..., V)`` logits, any float dtype.
        chunk_size: positions per chunk.

    Returns:
        ``(...)`` float32 entropies in nats.
    """
    _check_chunk_size(chunk_size)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    dummy = torch.full((flat_logits.shape[0],), -100, dtype=torch.long, device=logits.device)
    _, entropies = _LogitsLogSoftmaxStats.apply(flat_logits, dummy, chunk_size, -100, True)
    return entropies.reshape(logits.shape[:-1])


# ----------------------------------------------------------------------------------------------------------------
# From hidden states (fused LM head)
# ----------------------------------------------------------------------------------------------------------------


class _ChunkedHiddenLogProbs(torch.autograd.Function):
    """(hidden (N,H), weight (V,H), bias (V,)|None, labels (N,)) -> (logp (N,), entropy (N,) or empty).

    With a sampling mask, the rows whose support is given as ids alone (threshold +inf) take the sparse path
    (:func:`_sparse_forward`: their ≤ K + 1 kept logits only, no vocabulary pass); the others the chunked path."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        temperature,
        chunk_size,
        ignore_index,
        compute_entropy,
        entropy_grad,
        weight_grad_in_place,
        vocab_chunk_size,
        mask_ids,
        mask_threshold,
    ):
        n = hidden.shape[0]
        tiled = vocab_chunk_size is not None and vocab_chunk_size < weight.shape[0]
        with _no_autocast(hidden.device):
            # One float32 copy of a low-precision head for the duration of the call (not saved): logits in float32.
            w32 = weight.float()
            b32 = None if bias is None else bias.float()
            valid = labels != ignore_index
            logps = torch.empty(n, dtype=torch.float32, device=hidden.device)
            lses = torch.empty(n, dtype=torch.float32, device=hidden.device)
            entropies = torch.empty(n if compute_entropy else 0, dtype=torch.float32, device=hidden.device)
            split = _RowSplit.make(mask_ids, mask_threshold, n)
            if split.sparse is not None:
                rows = split.sparse
                logp, lse, ent = _sparse_forward(
                    hidden[rows], w32, b32, labels[rows], valid[rows], mask_ids[rows], temperature, compute_entropy
                )
                logps[rows], lses[rows] = logp, lse
                if compute_entropy:
                    entropies[rows] = ent
            if split.has_dense:
                args = (w32, b32, temperature, chunk_size, compute_entropy, vocab_chunk_size if tiled else None)
                if split.dense is None:  # every row: write straight into the outputs
                    _dense_forward(hidden, labels, valid, split.dense_mask, *args, logps, lses, entropies)
                else:
                    rows = split.dense
                    out = (logps.new_empty(len(rows)), lses.new_empty(len(rows)), entropies.new_empty(len(rows)))
                    _dense_forward(hidden[rows], labels[rows], valid[rows], split.dense_mask, *args, *out)
                    logps[rows], lses[rows] = out[0], out[1]
                    if compute_entropy:
                        entropies[rows] = out[2]
        saved_entropy = entropies if entropy_grad else None
        ctx.save_for_backward(hidden, weight, bias, labels, lses, saved_entropy, mask_ids, mask_threshold)
        ctx.set_materialize_grads(False)  # an unused output then sends None, and its gradient term is skipped
        ctx.temperature, ctx.chunk_size, ctx.ignore_index = temperature, chunk_size, ignore_index
        ctx.vocab_chunk_size = vocab_chunk_size if tiled else None
        # The parameter itself, not its saved copy: under saved-tensor hooks (activation offloading) the unpacked
        # tensor is a different object, and its .grad is not the parameter's.
        ctx.weight_param = weight if weight_grad_in_place else None
        if not entropy_grad:
            ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps, grad_entropies):
        hidden, weight, bias, labels, lses, entropies, mask_ids, mask_threshold = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not (need_h or need_w or need_b):
            return (None,) * 13
        if entropies is None:
            grad_entropies = None
        w32 = weight.float()
        b32 = None if bias is None else bias.float()
        valid = labels != ctx.ignore_index
        grad_h = torch.empty_like(hidden) if need_h else None
        param = ctx.weight_param
        in_place = need_w and param is not None
        if in_place and param.grad is not None:
            grad_w = param.grad  # accumulate into the parameter's gradient: no second (V, H) buffer
        else:
            grad_w = torch.zeros_like(w32) if need_w else None
        grad_b = torch.zeros_like(b32) if need_b else None
        split = _RowSplit.make(mask_ids, mask_threshold, hidden.shape[0])
        with _no_autocast(hidden.device):
            if split.sparse is not None:
                rows = split.sparse
                per_row = tuple(
                    None if t is None else t[rows]
                    for t in (labels, valid, mask_ids, lses, grad_logps, grad_entropies, entropies)
                )
                gh = _sparse_backward(hidden[rows], w32, b32, ctx.temperature, *per_row, grad_w, grad_b, need_h)
                if need_h:
                    grad_h[rows] = gh.to(hidden.dtype)
            if split.has_dense:
                rows = split.dense
                per_row = tuple(
                    None if t is None or rows is None else t[rows]
                    for t in (hidden, labels, valid, lses, grad_logps, grad_entropies, entropies)
                )
                if rows is None:
                    per_row = (hidden, labels, valid, lses, grad_logps, grad_entropies, entropies)
                gh = _dense_backward(
                    *per_row, split.dense_mask, w32, b32, ctx.temperature, ctx.chunk_size, ctx.vocab_chunk_size,
                    grad_w, grad_b, need_h,
                )  # fmt: skip
                if need_h:
                    if rows is None:
                        grad_h = gh
                    else:
                        grad_h[rows] = gh
        if in_place:
            if param.grad is None:
                param.grad = grad_w
            grad_w = None  # already in weight.grad; autograd gets nothing to add
        else:
            grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None


class _RowSplit:
    """Which rows take the sparse path (ids-form support) and which the chunked one, decided with one host read.

    ``sparse``: the ids-form rows (threshold +inf) or None when there are none. ``dense``: the other rows, or None
    for *every* row (no split: the chunked path runs on the inputs as they are). ``has_dense``: whether any row is
    dense. ``dense_mask``: ``(ids, threshold)`` of the dense rows, or None when none of them is masked (unknown
    support everywhere: the plain full softmax, bit for bit); its ids are None when no dense row lists any."""

    def __init__(self, sparse, dense, has_dense, dense_mask):
        self.sparse, self.dense, self.has_dense, self.dense_mask = sparse, dense, has_dense, dense_mask

    @classmethod
    def make(cls, ids: torch.Tensor | None, threshold: torch.Tensor | None, n: int) -> _RowSplit:
        if ids is None:
            return cls(None, None, True, None)
        is_sparse = threshold == float("inf")  # (N,)
        listed = (ids >= 0).any(-1)  # (N,)
        dense_masked = ~is_sparse & ((threshold > float("-inf")) | listed)
        n_sparse, any_masked, any_ids = torch.stack(
            [is_sparse.sum(), dense_masked.any(), (~is_sparse & listed).any()]
        ).tolist()
        if n_sparse == 0:
            mask = (ids if any_ids else None, threshold) if any_masked else None
            return cls(None, None, True, mask)
        sparse = is_sparse.nonzero().squeeze(1)
        if n_sparse == n:
            return cls(sparse, None, False, None)
        dense = (~is_sparse).nonzero().squeeze(1)
        mask = (ids[dense] if any_ids else None, threshold[dense]) if any_masked else None
        return cls(sparse, dense, True, mask)


def _dense_forward(
    hidden, labels, valid, mask, w32, b32, temperature, chunk_size, compute_entropy, vocab_chunk_size,
    logps, lses, entropies,
) -> None:  # fmt: skip
    """The chunked (and, with ``vocab_chunk_size``, vocabulary-tiled) forward of rows ``hidden`` (n, H) into
    ``logps`` / ``lses`` / ``entropies`` (n,); ``mask``: their ``(ids, threshold)`` or None."""
    n = hidden.shape[0]
    if vocab_chunk_size is not None:
        scratch = ScratchBuffers(2 if compute_entropy else 1, min(n, chunk_size) * vocab_chunk_size, hidden.device)
    support = None if mask is None else _Support.make(*mask, labels, min(n, chunk_size), vocab_chunk_size, w32)
    for s, e in _chunks(n, chunk_size):
        chunk_support = None if support is None else support.rows(s, e, hidden[s:e].float(), w32, b32, temperature)
        if vocab_chunk_size is not None:
            logp, lse, ent = _forward_chunk_tiled(
                hidden[s:e], w32, b32, temperature, labels[s:e], valid[s:e], compute_entropy, vocab_chunk_size,
                scratch, chunk_support,
            )  # fmt: skip
        else:
            z = _chunk_logits(hidden[s:e], w32, b32, temperature)
            if chunk_support is not None:
                chunk_support.apply_(z, 0)
            logp, lse, ent = _forward_chunk(z, labels[s:e], valid[s:e], compute_entropy)
        logps[s:e], lses[s:e] = logp, lse
        if compute_entropy:
            entropies[s:e] = ent


def _dense_backward(
    hidden, labels, valid, lses, grad_logps, grad_entropies, entropies, mask, w32, b32, temperature, chunk_size,
    vocab_chunk_size, grad_w, grad_b, need_h,
) -> torch.Tensor | None:  # fmt: skip
    """The chunked backward of rows ``hidden`` (n, H): adds into ``grad_w`` / ``grad_b``, returns dL/dh (n, H) in
    ``hidden``'s dtype (None unless ``need_h``)."""
    n = hidden.shape[0]
    grad_h = torch.empty_like(hidden) if need_h else None
    if vocab_chunk_size is not None:
        scratch = ScratchBuffers(2, min(n, chunk_size) * vocab_chunk_size, hidden.device)
    support = None if mask is None else _Support.make(*mask, labels, min(n, chunk_size), vocab_chunk_size, w32)
    for s, e in _chunks(n, chunk_size):
        # the chunk's rows of (lse, labels, valid, grad of logp, grad of entropy, entropy)
        rows = tuple(
            None if t is None else t[s:e] for t in (lses, labels, valid, grad_logps, grad_entropies, entropies)
        )
        chunk_support = None if support is None else support.rows(s, e, hidden[s:e].float(), w32, b32, temperature)
        if vocab_chunk_size is not None:
            tile_args = (w32, b32, temperature, vocab_chunk_size)
            gh = _backward_chunk_tiled(
                hidden[s:e].float(), *tile_args, *rows, grad_w, grad_b, need_h, scratch, chunk_support
            )
            if need_h:
                grad_h[s:e] = gh.to(hidden.dtype)
            continue
        h32 = hidden[s:e].float()
        z = _chunk_logits(h32, w32, b32, temperature)
        if chunk_support is not None:
            chunk_support.apply_(z, 0)  # the same mask as in forward: the same logits, recomputed
        gz = _backward_chunk(z, *rows)
        if temperature != 1.0:
            gz.div_(temperature)  # z = raw / T, so dL/draw = dL/dz / T
        if need_h:
            grad_h[s:e] = (gz @ w32).to(hidden.dtype)
        if grad_w is not None:
            grad_w.addmm_(gz.T, h32)
        if grad_b is not None:
            grad_b.add_(gz.sum(0))
    return grad_h


# Sparse path: a row whose support is a short list of ids needs only those logits. log π_K(y) = z_y − logsumexp_K z,
# the entropy and both gradients involve z_v for v ∈ K alone (p_v = 0 outside K), so such a row costs K + 1 dot
# products of length H instead of a V-row matmul and several V-wide passes. Rows are taken this many gathered
# head floats at a time (8 MiB of float32).
_SPARSE_CHUNK_FLOATS = 1 << 21


def _sparse_support(ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor):
    """``(cols (n, K+1) int64, present (n, K+1) bool, label_pos (n, 1) int64)``: each row's kept ids and (when
    valid) its label, sorted, duplicates and −1 padding marked absent (their column reads id 0); ``label_pos`` the
    label's column. A row with nothing kept (an ignored position listing no ids) keeps id 0 (finite, entropy 0)."""
    cols = torch.cat([ids.long(), torch.where(valid, labels, -1).unsqueeze(-1)], dim=1).sort(dim=-1).values
    present = cols >= 0
    present[:, 1:] &= cols[:, 1:] != cols[:, :-1]
    cols.clamp_(min=0)
    present[:, -1] |= ~present.any(-1)  # nothing kept: the last column (id 0 after the clamp) stands in
    label_pos = ((cols == labels.unsqueeze(-1)) & present).to(torch.uint8).argmax(-1, keepdim=True)
    return cols, present, label_pos


def _sparse_logits(h32, w32, b32, cols, present, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z (c, K+1) with −inf at absent columns, gathered head rows (c, K+1, H))`` for rows ``h32`` (c, H)."""
    w_rows = w32[cols]  # (c, K+1, H)
    z = torch.bmm(w_rows, h32.unsqueeze(-1)).squeeze(-1)  # (c, K+1)
    if b32 is not None:
        z = z + b32[cols]
    if temperature != 1.0:
        z = z / temperature
    return z.masked_fill(~present, float("-inf")), w_rows


def _sparse_forward(hidden, w32, b32, labels, valid, ids, temperature, compute_entropy):
    """``(logp (n,), lse (n,), entropy (n,) or None)`` of ids-form rows: the log-softmax over each row's kept ids
    and label only (the masked kernel's values, without a vocabulary pass)."""
    n = hidden.shape[0]
    logps, lses = hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)
    entropies = hidden.new_empty(n, dtype=torch.float32) if compute_entropy else None
    step = max(1, _SPARSE_CHUNK_FLOATS // ((ids.shape[1] + 1) * hidden.shape[1]))
    for s, e in _chunks(n, step):
        cols, present, label_pos = _sparse_support(ids[s:e], labels[s:e], valid[s:e])
        z, _ = _sparse_logits(hidden[s:e].float(), w32, b32, cols, present, temperature)
        lse = torch.logsumexp(z, dim=-1)  # (c,)
        lses[s:e] = lse
        logp = z.gather(-1, label_pos).squeeze(-1) - lse
        logps[s:e] = torch.where(valid[s:e], logp, torch.zeros_like(logp))
        if compute_entropy:
            log_q = z - lse.unsqueeze(-1)  # −inf at absent columns
            entropies[s:e] = -(log_q.exp() * log_q.masked_fill(~present, 0.0)).sum(-1)
    return logps, lses, entropies


def _sparse_backward(
    hidden, w32, b32, temperature, labels, valid, ids, lses, grad_logp, grad_entropy, entropy, grad_w, grad_b, need_h
) -> torch.Tensor | None:
    """The backward of :func:`_sparse_forward`: dL/dz on the kept columns only (0 elsewhere), scattered into the
    head's rows with ``index_add_``; returns dL/dh (n, H) float32 (None unless ``need_h``)."""
    n, width = hidden.shape
    grad_h = torch.empty(n, width, dtype=torch.float32, device=hidden.device) if need_h else None
    step = max(1, _SPARSE_CHUNK_FLOATS // ((ids.shape[1] + 1) * width))
    for s, e in _chunks(n, step):
        h32 = hidden[s:e].float()
        cols, present, label_pos = _sparse_support(ids[s:e], labels[s:e], valid[s:e])
        z, w_rows = _sparse_logits(h32, w32, b32, cols, present, temperature)
        log_q = z - lses[s:e].unsqueeze(-1)  # (c, K+1), −inf at absent columns
        q = log_q.exp()  # the masked softmax, 0 at absent columns
        gz = torch.zeros_like(q)
        if grad_entropy is not None:  # ∂H/∂z = −q (log q + H)
            gz -= q * (log_q.masked_fill(~present, 0.0) + entropy[s:e].unsqueeze(-1)) * grad_entropy[s:e].unsqueeze(-1)
        if grad_logp is not None:  # ∂ log q_y/∂z = onehot(y) − q
            g = torch.where(valid[s:e], grad_logp[s:e], torch.zeros_like(grad_logp[s:e])).unsqueeze(-1)
            gz -= q * g
            gz.scatter_add_(1, label_pos, g)
        if temperature != 1.0:
            gz /= temperature
        if need_h:
            grad_h[s:e] = torch.bmm(gz.unsqueeze(1), w_rows).squeeze(1)
        flat_cols = cols.reshape(-1)
        if grad_w is not None:
            grad_w.index_add_(0, flat_cols, (gz.unsqueeze(-1) * h32.unsqueeze(1)).reshape(-1, width))
        if grad_b is not None:
            grad_b.index_add_(0, flat_cols, gz.reshape(-1))
    return grad_h


# A dropped token's logit becomes the label's logit minus this many nats (not −inf): its probability is at most
# e^−60 · p_label ≈ 1e−26 · p_label, so a whole vocabulary of them moves the log-sum-exp by less than float32 rounding
# (V · e^−60 < 1e−20 for V < 10^6), while exp stays on its fast path (on CPU, exp of −inf or of an argument below
# −87 runs a scalar fallback some 30× slower than the vectorised one; measured in issue 40).
DROPPED_LOGIT_GAP = 60.0


class _Support:
    """The sampling mask of some rows (``posttrain.core.sampling_mask``) and a reused float32 buffer:
    ``apply_(z, v0)`` pushes the logits of dropped tokens far below the row's label logit (``DROPPED_LOGIT_GAP``),
    in place, for ``z`` the columns ``[v0, v0 + b)`` of those rows. Their probability is then 0 to float32 precision
    in the log-sum-exp, the entropy and the gradient, and the kernels run unchanged on the masked logits. The label
    is always kept, so the reference logit is known before any vocabulary block (tiled or not) is seen.

    Two passes over a block: ``d = 1[z < τ]`` as a float (0.0 written back at the kept ids and the label), then
    ``z ← lerp(z, fill, d)``, exact at both ends (z + 0 · (fill − z) = z; fill − (fill − z) · 0 = fill) and about
    ten times faster on CPU than ``torch.where`` / ``masked_fill`` with a bool mask (measured: 0.14 against 1.8 ms
    for a 256 × 2048 block; the former ``z · k + fill · (1 − k)`` took three passes, 0.23 ms). ``ids`` None: no row
    lists ids (threshold-form rows), so only the label column is written back."""

    def __init__(self, ids, threshold, labels, buf, block, vocab, fill=None, kept_cols=None):
        self.ids, self.threshold, self.labels, self.buf, self.block = ids, threshold, labels, buf, block
        self.vocab, self.fill, self.kept_cols = vocab, fill, kept_cols

    @classmethod
    def make(cls, ids, threshold, labels, rows: int, vocab_chunk_size: int | None, weight) -> _Support:
        vocab = weight.shape[0]
        cols = vocab if vocab_chunk_size is None else min(vocab_chunk_size, vocab)
        buf = torch.empty(rows * (cols + 1), dtype=torch.float32, device=labels.device)
        return cls(ids, threshold.unsqueeze(-1), labels, buf, cols, vocab)

    def rows(self, s: int, e: int, h32: torch.Tensor, w32: torch.Tensor, b32, temperature: float) -> _Support:
        """The rows ``[s, e)``, with their fill value (label logit − gap, from ``h32``, the chunk's hidden states)
        and their always-kept columns (ids and label) as (vocabulary block, column within it)."""
        labels = self.labels[s:e]
        safe = labels.clamp(0, w32.shape[0] - 1)  # an ignored row's label (−100) reads row 0: any finite value
        label_logit = (h32 * w32[safe]).sum(-1)  # (c,)
        if b32 is not None:
            label_logit = label_logit + b32[safe]
        fill = label_logit / temperature - DROPPED_LOGIT_GAP  # (c,)
        kept = labels.unsqueeze(-1) if self.ids is None else torch.cat([self.ids[s:e].long(), labels[:, None]], 1)
        # every block's columns of the kept ids and label at once, (blocks, c, K + 1): the spare column b where a
        # kept id lies outside the block (−1 padding and an ignored label −100 included)
        n_blocks = -(-self.vocab // self.block)
        col_block = kept.div(self.block, rounding_mode="floor")  # (c, K + 1)
        here = col_block.unsqueeze(0) == torch.arange(n_blocks, device=kept.device).view(-1, 1, 1)
        kept_cols = torch.where(here, kept - col_block * self.block, self.block)
        ids = None if self.ids is None else self.ids[s:e]
        return _Support(ids, self.threshold[s:e], labels, self.buf, self.block, self.vocab, fill[:, None], kept_cols)

    def apply_(self, z: torch.Tensor, v0: int) -> None:
        c, b = z.shape
        drop = self.buf[: c * (b + 1)].view(c, b + 1)  # the spare last column absorbs ids outside the block
        torch.lt(z, self.threshold, out=drop[:, :b])  # 1.0 where z < τ
        cols = self.kept_cols[v0 // self.block]  # (c, K + 1); blocks start at multiples of the block size
        if b < self.block:  # the last, shorter block: its spare column is b
            cols = cols.clamp(max=b)
        drop.scatter_(1, cols, 0.0)  # the kept ids and the label
        z.lerp_(self.fill.expand(c, b), drop[:, :b])  # z where kept, the fill where dropped


# Vocabulary tiling: with a large vocabulary a chunk of c tokens × all V logits is big (16 tokens × 151 936 rows
# is 9.7 MiB per buffer) and every chunk re-reads the whole (V, H) head. Splitting V into blocks of b rows keeps
# the scratch at c × b floats, so c can be large and the head is read N / c times instead of N / 16. A block's
# log-sum-exp and entropy combine exactly: lse = logsumexp_k lse_k, and with block masses m_k = exp(lse_k − lse),
#     H = Σ_k m_k (H_k + lse − lse_k)        (H_k: the entropy of the softmax within block k; every term ≥ 0).
# Backward needs only the full lse (and H), so each block's dL/dz is computed on its own. The (c, b) buffers are
# allocated once per call and reused by every block: a fresh buffer per block, interleaved with the small tensors
# that outlive it, fragments the C heap (measured: +110 MiB of resident memory for one 512-token call).


def _tile_logits(
    out: torch.Tensor, h32: torch.Tensor, w_k: torch.Tensor, b_k: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """``out`` (c, b) ← (h32 @ w_kᵀ + b_k) / temperature, in float32, without allocating."""
    if b_k is None:
        torch.mm(h32, w_k.T, out=out)
    else:
        torch.addmm(b_k, h32, w_k.T, out=out)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _block_labels(labels: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-local label ids clamped into [0, v1 − v0), whether each row's label lies in [v0, v1))."""
    here = (labels >= v0) & (labels < v1)
    return (labels - v0).clamp_(0, v1 - v0 - 1), here


def _forward_chunk_tiled(
    hidden_chunk: torch.Tensor,
    w32: torch.Tensor,
    b32: torch.Tensor | None,
    temperature: float,
    labels: torch.Tensor,
    valid: torch.Tensor,
    compute_entropy: bool,
    vocab_chunk_size: int,
    scratch: ScratchBuffers,
    support: _Support | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`_forward_chunk` for one token chunk, ``vocab_chunk_size`` head rows at a time (scratch (c, b))."""
    h32 = hidden_chunk.float()
    c, device = h32.shape[0], h32.device
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    blocks = list(_chunks(w32.shape[0], vocab_chunk_size))
    z_label = torch.zeros(c, dtype=torch.float32, device=device)
    lse_blocks = torch.empty(len(blocks), c, dtype=torch.float32, device=device)  # (K, c)
    ent_blocks = torch.empty(len(blocks), c, dtype=torch.float32, device=device) if compute_entropy else None
    for k, (v0, v1) in enumerate(blocks):
        z = _tile_logits(
            scratch.view(0, c, v1 - v0), h32, w32[v0:v1], None if b32 is None else b32[v0:v1], temperature
        )
        if support is not None:
            support.apply_(z, v0)
        local, here = _block_labels(safe_labels, v0, v1)
        z_label = torch.where(here, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), z_label)
        top = z.amax(dim=-1)  # (c,) log-sum-exp in place: z ← exp(z − max)
        top.masked_fill_(top.isinf(), 0.0)  # an all −inf row gives lse −inf, not NaN (as torch.logsumexp)
        exp_sum = z.sub_(top.unsqueeze(-1)).exp_().sum(-1)
        torch.add(top, exp_sum.log(), out=lse_blocks[k])
        if compute_entropy:
            probs = z.div_(exp_sum.unsqueeze(-1))  # the softmax within the block
            torch.sum(torch.special.entr(probs, out=scratch.view(1, c, v1 - v0)), dim=-1, out=ent_blocks[k])
    lse = torch.logsumexp(lse_blocks, dim=0)
    logp = torch.where(valid, z_label - lse, torch.zeros_like(lse))
    entropy = None
    if compute_entropy:
        mass = (lse_blocks - lse).exp()  # (K, c); a block of −inf logits has mass 0 (and a NaN H_k)
        terms = mass * (ent_blocks + (lse - lse_blocks))
        entropy = torch.where(mass > 0, terms, torch.zeros_like(terms)).sum(0)
    return logp, lse, entropy


def _backward_chunk_tiled(
    h32: torch.Tensor,
    w32: torch.Tensor,
    b32: torch.Tensor | None,
    temperature: float,
    vocab_chunk_size: int,
    lse: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    need_h: bool,
    scratch: ScratchBuffers,
    support: _Support | None = None,
) -> torch.Tensor | None:
    """One token chunk's backward, block by block: adds into ``grad_w``/``grad_b`` rows, returns dL/dh (c, H)."""
    c = h32.shape[0]
    grad_h = torch.zeros_like(h32) if need_h else None
    for v0, v1 in _chunks(w32.shape[0], vocab_chunk_size):
        w_k = w32[v0:v1]
        z = _tile_logits(scratch.view(0, c, v1 - v0), h32, w_k, None if b32 is None else b32[v0:v1], temperature)
        if support is not None:
            support.apply_(z, v0)
        local, here = _block_labels(labels, v0, v1)
        gz = _backward_chunk(
            z,
            lse,
            local,
            valid,
            grad_logp,
            grad_entropy,
            entropy,
            label_here=here,
            probs_out=scratch.view(1, c, v1 - v0),
        )
        if temperature != 1.0:
            gz.div_(temperature)
        if need_h:
            grad_h.addmm_(gz, w_k)
        if grad_w is not None:
            grad_w[v0:v1].addmm_(gz.T, h32)
        if grad_b is not None:
            grad_b[v0:v1].add_(gz.sum(0))
    return grad_h


def _chunk_logits(
    hidden_chunk: torch.Tensor, w32: torch.Tensor, b32: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    h32 = hidden_chunk.float()
    z = h32 @ w32.T if b32 is None else torch.addmm(b32, h32, w32.T)  # (c, V) float32
    if temperature != 1.0:
        z.div_(temperature)
    return z


def chunked_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    compute_entropy: bool = False,
    ignore_index: int = -100,
    entropy_requires_grad: bool = False,
    weight_grad_in_place: bool = False,
    vocab_chunk_size: int | None = None,
    sampling_mask: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``labels`` (and entropies) from last hidden states, never holding ``N × V`` logits.

    For each chunk of ``chunk_size`` positions, in float32:

        z = (hidden_chunk @ weightᵀ + bias) / temperature          # (c, V)
        logp = z_label − logsumexp(z)        H = −Σ_v softmax(z)_v log softmax(z)_v

    The custom autograd function saves only ``hidden``, ``weight``, ``bias``, ``labels`` and one log-sum-exp per
    position, and recomputes each chunk's logits in backward, so the extra memory of forward + backward is
    O(chunk_size × V) instead of O(N × V) (design §3.1; the same idea as Liger's fused linear cross-entropy).
    Gradients flow to ``hidden``, ``weight`` and ``bias`` — each only if it requires grad, so a frozen LM head
    costs no weight-gradient matmul. A low-precision ``weight`` is upcast to float32 once per forward and once per
    backward call (transient, V × H floats).

    Args:
        hidden: ``(N, H)`` or ``(B, T, H)`` hidden states (fp32 or bf16/fp16), already aligned with ``labels``
            (position t predicts ``labels[t]``).
        weight: ``(V, H)`` LM-head weight (``lm_head.weight``).
        labels: ``(N,)`` or ``(B, T)`` target ids; positions equal to ``ignore_index`` get logp 0 and no gradient.
        bias: optional ``(V,)`` LM-head bias.
        temperature: logits are divided by it (GRPO's sampling temperature); must be > 0.
        chunk_size: positions per chunk; scratch memory is about ``2 × chunk_size × V`` floats.
        vocab_chunk_size: head rows per block within a chunk (None: the whole vocabulary at once). With a large
            vocabulary, blocks bound the scratch to ``2 × chunk_size × vocab_chunk_size`` floats, so chunks can be
            long and the head is read fewer times; the result equals the untiled one up to float rounding.
        compute_entropy: also return per-position entropies (at every position, ignored ones included).
        ignore_index: label value marking positions to skip (prompt, padding).
        entropy_requires_grad: by default the entropy is returned **detached** (it is a logged metric and the input
            of the entropy mask). Set True when the entropy enters the loss (entropy bonus); its gradient
            −p (log p + H) is then recomputed chunk-wise too.
        weight_grad_in_place: backward adds the weight's gradient straight into ``weight.grad`` (creating it when
            None) instead of returning it to autograd, so no separate ``(V, H)`` gradient buffer exists next to
            ``weight.grad``. For a float32 leaf ``weight`` in single-process training only: autograd hooks on the
            weight and ``torch.autograd.grad`` do not see this gradient. Used with
            :func:`posttrain.core.tied_embedding.route_embedding_grad_in_place` for tied embeddings (see there).
        sampling_mask: ``(ids (..., K), threshold (...))`` with the leading shape of ``labels``: each position's
            kept support under the sampler's top-k / top-p / min-p (:mod:`posttrain.core.sampling_mask`). The
            log-softmax, the entropy and their gradients are then over that support only,
            log p_y = z_y − logsumexp_{v kept} z_v. A position described by ids alone (threshold +inf) needs only
            its ≤ K + 1 kept logits: it is computed from those (a gather of head rows, no vocabulary pass). The
            others go through the chunks: a dropped logit is set 60 nats below the label's, p < 1e−26 · p_y, zero
            to float32 precision; one chunk or vocabulary block at a time, still no ``N × V`` logits, and a float
            ``chunk × block`` buffer is the only extra memory. The label
            is always kept; threshold −inf with no ids is the full softmax. None: the full softmax everywhere.

    Returns:
        ``(logps, entropy)``: float32 tensors with the leading shape of ``labels``; ``entropy`` is None unless
        ``compute_entropy``.
    """
    _check_chunk_size(chunk_size)
    if vocab_chunk_size is not None and (not isinstance(vocab_chunk_size, int) or vocab_chunk_size < 1):
        raise ValueError(f"vocab_chunk_size must be a positive int or None, got {vocab_chunk_size!r}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the hidden shape without the hidden dim "
            f"{tuple(hidden.shape[:-1])}."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, H={hidden.shape[-1]}) like lm_head.weight, got {tuple(weight.shape)}."
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape (V={weight.shape[0]},), got {tuple(bias.shape)}.")
    if weight_grad_in_place and not (weight.is_leaf and weight.dtype == torch.float32):
        raise ValueError("weight_grad_in_place needs a float32 leaf weight (a parameter).")
    leading = labels.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).long()
    mask_ids = mask_threshold = None
    if sampling_mask is not None:
        mask_ids, mask_threshold = sampling_mask
        if mask_ids.shape[:-1] != leading or mask_threshold.shape != leading:
            raise ValueError(
                f"sampling_mask must be (ids {tuple(leading)} + (K,), threshold {tuple(leading)}) like labels, got "
                f"{tuple(mask_ids.shape)} and {tuple(mask_threshold.shape)}."
            )
        mask_ids = mask_ids.reshape(-1, mask_ids.shape[-1]).to(hidden.device)
        mask_threshold = mask_threshold.reshape(-1).to(device=hidden.device, dtype=torch.float32)
    logps, entropies = _ChunkedHiddenLogProbs.apply(
        flat_hidden,
        weight,
        bias,
        flat_labels,
        float(temperature),
        chunk_size,
        ignore_index,
        compute_entropy,
        compute_entropy and entropy_requires_grad,
        weight_grad_in_place,
        vocab_chunk_size,
        mask_ids,
        mask_threshold,
    )
    return logps.reshape(leading), (entropies.reshape(leading) if compute_entropy else None)
