"""Scoring preference completions: per-token log-probs of the completion tokens of right-padded ``[prompt |
completion]`` rows (chunked, no ``(B, T, V)`` logits) with optional entropy, top-1 hits, mean logits and WPO
normalisers — the forwards of the offline preference trainers (DPO, KTO, the experimental pairwise ones).

- :class:`PreferenceScores`: the per-token results, ``(B, T)`` aligned with ``input_ids``.
- :func:`score_preference_completions`: one scored forward pass through
  :func:`posttrain.models.forward.forward_token_stats` (length-bucketed), with the LM head's input captured for the
  statistics that need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.models.forward import (
    TokenStats,
    auto_chunk_size,
    forward_token_stats,
    length_bucket_groups,
    restore_row_order,
)
from posttrain.models.unwrap import unwrap_base_model

__all__ = ["PreferenceScores", "score_preference_completions"]


@dataclass
class PreferenceScores:
    """Per-token results of one scored forward pass, all ``(B, T)`` aligned with ``input_ids`` (position t holds
    the quantity for ``input_ids[:, t]`` predicted from ``< t``; unscored positions hold 0).

    Attributes:
        logps: float32 log-probs, differentiable.
        mask: bool, the scored completion positions.
        entropy: detached entropies, or None.
        correct: bool top-1 hits, or None.
        mean_logits: detached mean over the vocabulary of the logits that predict each token, or None.
        wpo_log_normalizer: detached ``logsumexp(2z) − 2·logsumexp(z)`` per token (WPO), or None.
        aux_loss: MoE load-balancing loss reported by the model, or None.
    """

    logps: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    wpo_log_normalizer: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None

    def sequence_sums(self) -> torch.Tensor:
        """Σ_t logp over the scored positions of each row → ``(B,)``."""
        return (self.logps * self.mask).sum(dim=-1)


def _head_linear(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward:
        return head.weight, head.bias
    return None


@dataclass
class _HeadStats:
    mean: torch.Tensor | None = None  # (N,) mean logit per position
    norm: torch.Tensor | None = None  # (N,) WPO log-normaliser per position
    top1: torch.Tensor | None = None  # (N,) argmax token per position (-1 where not requested)


@torch.no_grad()
def _head_stats(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    *,
    mean_logits: bool,
    wpo: bool,
    argmax_mask: torch.Tensor | None,
    chunk_size: int,
) -> _HeadStats:
    """Mean logit, WPO normaliser and top-1 token of the head's logits at each row of ``hidden`` (N, H), a chunk of
    rows at a time (never (N, V) logits).

    For a plain linear head the mean logit is exact and cheap: mean_v(h·W_v + b_v) = h·mean_v(W) + mean_v(b), so no
    logits are needed for it. WPO needs every position's full distribution; the top-1 token is computed only where
    ``argmax_mask`` (N,) is True (e.g. DPO's chosen rows), inside the same pass when WPO runs anyway. Heads that are
    not a plain ``nn.Linear`` (a PEFT wrapper on ``lm_head``) are applied as modules.
    """
    linear = _head_linear(head)
    out = _HeadStats()
    if mean_logits and linear is not None:
        weight, bias = linear
        out.mean = hidden.float() @ weight.float().mean(dim=0)
        if bias is not None:
            out.mean = out.mean + bias.float().mean()
    all_rows = wpo or (mean_logits and linear is None)
    if not all_rows and argmax_mask is None:
        return out
    n = hidden.shape[0]
    rows = torch.arange(n, device=hidden.device) if all_rows else argmax_mask.nonzero().squeeze(-1)
    if all_rows and mean_logits and linear is None:
        out.mean = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    if wpo:
        out.norm = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    if argmax_mask is not None:
        out.top1 = torch.full((n,), -1, dtype=torch.long, device=hidden.device)
    w32 = None if linear is None else linear[0].float()
    b32 = None if linear is None or linear[1] is None else linear[1].float()
    for start in range(0, rows.numel(), chunk_size):
        idx = rows[start : start + chunk_size]
        h = hidden[idx]
        if w32 is None:
            z = head(h).float()
        else:
            z = h.float() @ w32.T if b32 is None else torch.addmm(b32, h.float(), w32.T)
        if mean_logits and linear is None:
            out.mean[idx] = z.mean(dim=-1)
        if wpo:
            out.norm[idx] = torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1)
        if argmax_mask is not None:
            keep = argmax_mask[idx]
            out.top1[idx[keep]] = z[keep].argmax(dim=-1)
    return out


def _place(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scatter per-position values (N,) into a zero (B, T) float32 tensor at the True positions of ``mask``."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, values.float())


def _captured_hidden(
    captured: list[torch.Tensor], model: torch.nn.Module, attention_mask: torch.Tensor, width: int
) -> torch.Tensor | None:
    """The ``(B, T, H)`` hidden states the LM head saw: one capture, or one per length bucket put back in order."""
    if not captured:
        return None
    if len(captured) == 1:
        return captured[0]
    groups = length_bucket_groups(model, attention_mask)  # the same groups forward_token_stats ran
    if groups is None or len(groups) != len(captured) or any(h.dim() != 3 for h in captured):
        return None
    return restore_row_order([h[:, -w:] for h, (_, w) in zip(captured, groups)], groups, width)


def score_preference_completions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    compute_entropy: bool = False,
    compute_accuracy: bool = False,
    compute_mean_logits: bool = False,
    compute_wpo: bool = False,
    accuracy_rows: torch.Tensor | None = None,
    chunk_size: int | None = None,
    **model_kwargs: Any,
) -> PreferenceScores:
    """Per-token log-probs of the completion tokens of right-padded ``(B, T)`` sequences, plus optional statistics.

    The log-probs, entropy and top-1 hits come from :func:`posttrain.models.forward.forward_token_stats` (chunked
    path, no ``(B, T, V)`` logits). The mean logits and WPO normalisers need the last hidden states, which a forward
    pre-hook on the LM head captures (detached) on the way; they are computed from the scored positions only.

    Args:
        model: Causal LM (plain, PEFT or accelerator-wrapped).
        input_ids: ``(B, T)`` prompt+completion ids.
        attention_mask: ``(B, T)`` padding mask.
        completion_mask: ``(B, T)`` 1 on completion tokens.
        compute_entropy: Also return entropies (detached).
        compute_accuracy: Also return top-1 hits at every scored position.
        compute_mean_logits: Also return the mean logit per scored token (``logits/*`` metrics).
        compute_wpo: Also return the WPO log-normaliser per scored token.
        accuracy_rows: ``(B,)`` bool: return top-1 hits for these rows only (e.g. DPO's chosen half), computed in
            the statistics pass over the captured hidden states — half the LM-head work of ``compute_accuracy``.
        chunk_size: Tokens per chunk of the LM-head computations (None: sized from the vocabulary).
        **model_kwargs: Extra model inputs, e.g. a vision-language batch's ``pixel_values`` / ``image_sizes``.
    """
    captured: list[torch.Tensor] = []  # the LM head's input, one per model call (several with length buckets)
    handle = None
    head = None
    if compute_mean_logits or compute_wpo or accuracy_rows is not None:
        head = unwrap_base_model(model).get_output_embeddings()
        if head is not None:

            def capture(module, args, kwargs):
                hidden = args[0] if args else kwargs.get("input")
                captured.append(hidden.detach())

            handle = head.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        stats: TokenStats = forward_token_stats(
            model,
            input_ids,
            attention_mask,
            labels_mask=completion_mask,
            compute_entropy=compute_entropy,
            compute_accuracy=compute_accuracy,
            chunk_size=chunk_size,
            length_buckets=True,
            **model_kwargs,
        )
    finally:
        if handle is not None:
            handle.remove()
    scores = PreferenceScores(
        logps=stats.logps, mask=stats.mask, entropy=stats.entropy, correct=stats.correct, aux_loss=stats.aux_loss
    )
    sel = stats.mask[:, 1:]  # position t-1 predicts token t
    predictors = None  # (n, H): the LM head's input at the positions that predict the scored tokens
    layout = stats.padding_free
    if layout is not None and len(captured) == 1 and captured[0].dim() == 3:  # one flat row: read it directly
        predictors = captured[0][0].index_select(0, layout.index[:, :-1][sel])
    else:
        hidden = _captured_hidden(captured, model, attention_mask, input_ids.shape[1])
        if hidden is not None and hidden.dim() == 3 and hidden.shape[1] >= input_ids.shape[1]:
            predictors = hidden[:, -input_ids.shape[1] :][:, :-1][sel]
    if head is not None and predictors is not None:
        argmax_mask = None
        if accuracy_rows is not None:
            argmax_mask = accuracy_rows.to(sel.device).unsqueeze(1).expand_as(sel)[sel]
        head_stats = _head_stats(
            predictors,
            head,
            mean_logits=compute_mean_logits,
            wpo=compute_wpo,
            argmax_mask=argmax_mask,
            chunk_size=chunk_size or auto_chunk_size(head.weight.shape[0]),
        )
        pad = torch.nn.functional.pad
        if head_stats.mean is not None:
            scores.mean_logits = pad(_place(head_stats.mean, sel), (1, 0))
        if head_stats.norm is not None:
            scores.wpo_log_normalizer = pad(_place(head_stats.norm, sel), (1, 0))
        if head_stats.top1 is not None:
            hits = (head_stats.top1 == input_ids[:, 1:][sel]).float()
            scores.correct = pad(_place(hits, sel), (1, 0)).bool()
    if (compute_wpo and scores.wpo_log_normalizer is None) or (accuracy_rows is not None and scores.correct is None):
        raise RuntimeError(
            "WPO weights and row-restricted accuracy need the LM head's input hidden states, but the model's output "
            "embeddings were not called with them; this model is not supported for them."
        )
    return scores
