"""One forward pass → per-token log-probs of the next tokens, without full-vocabulary logits for the batch.

Every trainer that scores tokens (SFT's loss, DPO/KTO log-ratios, GRPO/RLOO policy/old/ref log-probs) calls
:func:`token_logprobs` or :func:`forward_token_stats`. The model runs its normal ``forward`` (so DDP, PEFT, MoE
router losses and gradient checkpointing behave as usual), but a pre-hook on the LM head captures the last hidden
states and hands the head an empty slice, so the model itself never builds ``(B, T, V)`` logits. The log-probs of
the target tokens are then computed from the captured hidden states by
:func:`posttrain.core.logprobs.chunked_logprobs_from_hidden`, one chunk of tokens at a time in forward *and*
backward (design §3.1), and only at the positions that are scored (completion/label positions).

Heads the chunked path cannot reproduce fall back to the plain path (full logits from ``model(...)``), logged once:

* a LoRA adapter or any wrapper on the LM head itself, a sharded head weight (ZeRO-3, FSDP ``DTensor``);
* final-logit soft-capping (Gemma 2/3/4), which is not linear.

A constant logit scale (Cohere ``logit_scale``, Granite ``logits_scaling``) is folded into the temperature. On the
first call per head the hook also lets the model compute logits for one position per row and checks them against
the chunked head; any other unknown transform is caught there and the model switches to the plain path.

Alignment convention (shared by all trainers): ``logps[:, t] = log p(target[:, t] | tokens < t)``, with
``target = input_ids`` unless ``labels`` is given; position 0 has no prediction and gets 0, as does every position
that is not scored.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.core.logprobs import chunked_logprobs_from_hidden, entropy_from_logits, selective_log_softmax
from posttrain.core.sampling_mask import apply_sampling_mask
from posttrain.core.tied_embedding import in_place_tied_grad_supported, route_embedding_grad_in_place
from posttrain.models.padding_free import PaddingFreeLayout, padding_free_layout
from posttrain.models.unwrap import unwrap_base_model, unwrap_parallel

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100

__all__ = [
    "TokenStats",
    "forward_token_stats",
    "log_once",
    "prepare_attention_mask",
    "sequence_scores",
    "token_logprobs",
    "token_stats_from_logits",
]

# Heads whose chunked computation was checked against the model's own logits (True) or found different (False).
_HEAD_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
_LOGGED: set[str] = set()


def log_once(message: str) -> None:
    """Log ``message`` as a warning the first time only (a fallback path taken on every micro-batch)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning(message)


@dataclass
class TokenStats:
    """What one scored forward pass returns. All tensors have the output shape ``(B, T)`` (or ``(B, K)`` with
    ``logits_to_keep=K``); unscored positions hold 0 / False.

    Attributes:
        logps: float32 log-probabilities of the targets, differentiable.
        mask: bool, the scored positions (targets not ignored, inside the kept window, t ≥ 1).
        entropy: float32 entropy of the next-token distribution at scored positions (detached), or None.
        correct: bool, the top-1 prediction equals the target at scored positions, or None.
        aux_loss: the MoE load-balancing loss reported by the model (``outputs.aux_loss``), or None.
        chunked: whether the chunked path was used (False: plain full-logits path).
        padding_free: the flat layout the model ran on (:mod:`posttrain.models.padding_free`), None for a padded
            call; its ``to_rows`` maps a capture of that call (e.g. the LM head's input) back to ``(B, T)``.
    """

    logps: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    chunked: bool = True
    padding_free: PaddingFreeLayout | None = None


# ----------------------------------------------------------------------------------------------------------------
# Model introspection
# ----------------------------------------------------------------------------------------------------------------


def _config(model: torch.nn.Module) -> Any:
    return getattr(model, "config", None)


def _text_configs(model: torch.nn.Module) -> list[Any]:
    config = _config(model)
    if config is None:
        return []
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        text = get_text()
        if text is not None and text is not config:
            configs.append(text)
    return configs


@dataclass
class _Head:
    module: torch.nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    scale: float  # effective logits = scale · (h Wᵀ + b)


def _effective_linear(head: torch.nn.Module) -> torch.nn.Module | None:
    """The module that computes the logits: for PEFT's ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``,
    e.g. after ``clone_chat_template``) the active trained copy, or the original head when adapters are off."""
    if type(head).__name__ != "ModulesToSaveWrapper":
        return head
    active = list(getattr(head, "active_adapters", None) or [])
    copies = head.modules_to_save
    if head.disable_adapters or not active or any(name not in copies for name in active):
        return head.original_module
    return copies[active[0]] if len(active) == 1 else None


def _resolve_head(inner: torch.nn.Module) -> _Head | str:
    """The LM head as a plain linear map plus a constant logit scale, or the reason the chunked path cannot be used."""
    get_out = getattr(inner, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is None:
        return f"{type(inner).__name__} has no output embeddings (get_output_embeddings() is None)"
    linear = _effective_linear(head)
    # A LoRA adapter or a custom head changes the computation beyond `weight`: use the model's logits.
    if (
        linear is None
        or not isinstance(linear, torch.nn.Linear)
        or type(linear).forward is not torch.nn.Linear.forward
    ):
        return f"the LM head is a {type(head).__name__}, not a plain torch.nn.Linear (e.g. a LoRA adapter on lm_head)"
    weight = linear.weight
    if hasattr(weight, "ds_id") or type(weight).__name__ == "DTensor" or weight.numel() == 0:
        return "the LM head weight is sharded (DeepSpeed ZeRO-3 or FSDP)"
    scale = 1.0
    for config in _text_configs(inner):
        for name in ("final_logit_softcapping", "logit_softcapping", "output_logit_softcapping"):
            if getattr(config, name, None) not in (None, 0, 0.0):
                return f"the model soft-caps its logits (config.{name}={getattr(config, name)})"
        logit_scale = getattr(config, "logit_scale", None)  # Cohere: logits = logits * logit_scale
        if isinstance(logit_scale, (int, float)) and logit_scale not in (0, 1):
            scale = float(logit_scale)
        logits_scaling = getattr(config, "logits_scaling", None)  # Granite: logits = logits / logits_scaling
        if isinstance(logits_scaling, (int, float)) and logits_scaling not in (0, 1):
            scale = 1.0 / float(logits_scaling)
    if scale <= 0:
        return f"the model scales its logits by a non-positive factor ({scale})"
    return _Head(head, weight, linear.bias, scale)


def prepare_attention_mask(model: torch.nn.Module, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Adapt a 4-D block-diagonal boolean mask (padding-free batches) to the model's attention implementation.

    The padding-free collator emits ``(1, 1, L, L)`` boolean masks (True = may attend) because on CPU, under sdpa
    and eager attention, ``position_ids`` alone do not keep packed sequences apart. Per implementation:

    * ``sdpa``: passed as is (boolean masks are native);
    * flash-attention variants: dropped — they read sequence boundaries from ``position_ids``;
    * ``eager`` and others: converted to an additive float mask (0 where allowed, the float32 minimum elsewhere),
      because eager attention *adds* the mask to the scores;
    * ``flex_attention``: not supported with a custom 4-D mask (clear error).

    2-D masks and ``None`` are returned unchanged.
    """
    if attention_mask is None or attention_mask.dim() != 4:
        return attention_mask
    config = _config(unwrap_base_model(model))
    impl = str(getattr(config, "_attn_implementation", None) or "sdpa")
    if "flash" in impl:
        return None
    if impl == "flex_attention":
        raise ValueError(
            "A 4-D block-diagonal attention mask (padding_free=True / packing) cannot be used with "
            "attn_implementation='flex_attention'. Load the model with attn_implementation='sdpa', 'eager' or a "
            "flash-attention implementation."
        )
    if attention_mask.dtype != torch.bool or impl == "sdpa":
        return attention_mask
    additive = torch.zeros(attention_mask.shape, dtype=torch.float32, device=attention_mask.device)
    return additive.masked_fill_(~attention_mask, torch.finfo(torch.float32).min)


# ----------------------------------------------------------------------------------------------------------------
# Targets and masks
# ----------------------------------------------------------------------------------------------------------------


def _targets_and_mask(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    labels_mask: torch.Tensor | None,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets (B, T) long, scored (B, T) bool) with position 0 and positions before the kept window unscored."""
    batch, seq_len = input_ids.shape
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}."
            )
        mask = labels != IGNORE_INDEX
        targets = torch.where(mask, labels, torch.zeros_like(labels))
    else:
        targets = input_ids
        if attention_mask is not None and attention_mask.dim() == 2:
            mask = attention_mask.bool()
        else:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
    if labels_mask is not None:
        if labels_mask.shape == (batch, width) and width != seq_len:
            labels_mask = torch.nn.functional.pad(labels_mask, (seq_len - width, 0))
        if labels_mask.shape != input_ids.shape:
            raise ValueError(
                f"labels_mask shape {tuple(labels_mask.shape)} must be {tuple(input_ids.shape)} (or (B, "
                f"logits_to_keep)=({batch}, {width}))."
            )
        mask = mask & labels_mask.bool()
    mask = mask.clone()
    mask[:, : max(seq_len - width, 1)] = False
    return targets, mask


# ----------------------------------------------------------------------------------------------------------------
# The two paths
# ----------------------------------------------------------------------------------------------------------------


def _accepts(model: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(unwrap_base_model(model).forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


@torch.no_grad()
def _chunked_argmax(hidden: torch.Tensor, head: _Head, chunk_size: int) -> torch.Tensor:
    """Top-1 token per row of ``hidden`` (N, H), computed a chunk at a time (a positive scale cannot change it)."""
    weight = head.weight.float()
    bias = None if head.bias is None else head.bias.float()
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start : start + chunk_size].float()
        z = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
        out[start : start + chunk_size] = z.argmax(-1)
    return out


def _scatter(values: torch.Tensor, sel: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Place ``values`` (N,) at the True positions of ``sel`` (B, T-1) and prepend the empty position 0 → (B, T)."""
    out = torch.zeros(sel.shape, dtype=dtype, device=sel.device).masked_scatter(sel, values.to(dtype))
    return torch.nn.functional.pad(out, (1, 0))


def _call_model(model, input_ids, attention_mask, position_ids, model_kwargs, **extra):
    kwargs = dict(model_kwargs)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    kwargs.setdefault("use_cache", False)
    return model(input_ids=input_ids, attention_mask=attention_mask, **kwargs, **extra)


# 16 MiB: on a 151 936-row vocabulary (16-token chunks, the floor) the GRPO step's peak RSS drops by ~100 MiB
# against 128 MiB and the step is no slower on CPU (issue 26, benchmarks/RESULTS.md); 32k-row vocabularies get
# 65-token chunks, small ones keep 1024.
CHUNK_BUDGET_BYTES = 16 * 2**20


def auto_chunk_size(vocab_size: int, budget_bytes: int = CHUNK_BUDGET_BYTES) -> int:
    """Tokens per LM-head chunk so the chunk's float32 scratch (about 2 × chunk × V floats) stays near
    ``budget_bytes``: 1024 for small vocabularies, 16 (the floor) for Qwen-sized ones (151 936 rows)."""
    return int(max(16, min(1024, budget_bytes // (8 * max(int(vocab_size), 1)))))


# Above this many rows (fewer than 64 whole-vocabulary tokens fit the budget) the head is tiled over the
# vocabulary too: chunks of TILED_CHUNK_TOKENS tokens × blocks of rows sized to TILED_BUDGET_BYTES of scratch.
# On a 151 936-row vocabulary that is 256 × 2048 (4 MiB) instead of 16 × 151 936 (19 MiB), and the (V, H) head
# is read 16× less often (issue 26, benchmarks/RESULTS.md).
TILE_ABOVE_VOCAB = CHUNK_BUDGET_BYTES // (8 * 64)
TILED_CHUNK_TOKENS = 256
TILED_BUDGET_BYTES = 4 * 2**20


def auto_chunk_sizes(vocab_size: int) -> tuple[int, int | None]:
    """(tokens per chunk, head rows per vocabulary block or None for untiled) for the chunked LM head."""
    if vocab_size <= TILE_ABOVE_VOCAB:
        return auto_chunk_size(vocab_size), None
    return TILED_CHUNK_TOKENS, max(256, TILED_BUDGET_BYTES // (8 * TILED_CHUNK_TOKENS))


def resolve_lm_head(model: torch.nn.Module) -> _Head | str:
    """The model's LM head as a plain linear map with a constant logit scale, or why it is not one (see the module
    docstring); a head found to differ from that map by :func:`forward_capturing_head_input` stays excluded."""
    head = _resolve_head(unwrap_base_model(model))
    if isinstance(head, _Head) and _HEAD_VERIFIED.get(head.module, True) is False:
        return "its logits differ from hidden_states @ lm_head.weight (an unknown head transform)"
    return head


def forward_capturing_head_input(
    model: torch.nn.Module, head: _Head, run: Callable[[], Any]
) -> tuple[Any, torch.Tensor] | None:
    """Run ``run()`` (a forward of ``model``) while the LM head receives an empty slice: no ``(B, T, V)`` logits.

    Returns ``(outputs, hidden)`` with the hidden states the head was given. On the first call per head the head
    computes one position, which is checked against ``scale · (h Wᵀ + b)``; a mismatch is remembered and this call
    returns None (callers then use the model's own logits).
    """
    captured: dict[str, torch.Tensor] = {}
    verify = head.module not in _HEAD_VERIFIED

    def pre_hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["input"]
        captured["hidden"] = hidden
        stub = hidden[..., -1:, :] if verify and hidden.dim() == 3 else hidden[..., :0, :]
        captured["stub"] = stub
        return ((stub, *args[1:]), kwargs) if args else (args, {**kwargs, "input": stub})

    handle = head.module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        outputs = run()
    finally:
        handle.remove()
    if "hidden" not in captured:
        raise RuntimeError(f"{type(unwrap_base_model(model)).__name__}.forward never called its LM head.")
    if verify and captured["stub"].numel() > 0:
        with torch.no_grad():
            stub = captured["stub"].float()
            ours = stub @ head.weight.float().T
            if head.bias is not None:
                ours = ours + head.bias.float()
            ours = ours * head.scale
            theirs = getattr(outputs, "logits", None)
            same = theirs is not None and theirs.shape == ours.shape
            if same:
                tol = 1e-4 if theirs.dtype == torch.float32 else 3e-2
                same = torch.allclose(theirs.float(), ours, rtol=tol, atol=tol * (1.0 + ours.abs().max().item()))
        _HEAD_VERIFIED[head.module] = bool(same)
        if not same:
            return None
    return outputs, captured["hidden"]


def _chunked_path(
    model,
    head: _Head,
    input_ids,
    attention_mask,
    position_ids,
    targets,
    mask,
    temperature,
    chunk_size,
    compute_entropy,
    compute_accuracy,
    model_kwargs,
    entropy_requires_grad=False,
    sampling_mask=None,
) -> TokenStats | None:
    """Chunked path; returns None when the one-time check finds the model's logits differ from the chunked head."""
    tied = _tied_embedding_for_in_place_grad(model, head)
    with route_embedding_grad_in_place(tied):
        captured = forward_capturing_head_input(
            model, head, lambda: _call_model(model, input_ids, attention_mask, position_ids, model_kwargs)
        )
    if captured is None:
        return None
    outputs, hidden = captured
    seq_len = input_ids.shape[1]
    if hidden.shape[1] > seq_len:  # PEFT prompt learning prepends virtual tokens
        hidden = hidden[:, -seq_len:]
    sel = mask[:, 1:]  # (B, T-1): position t predicts targets[:, t+1]
    h = hidden[:, :-1][sel]  # (N, H)
    y = targets[:, 1:][sel]  # (N,)
    vocab_chunk_size = None  # an explicit chunk_size keeps its documented meaning: chunk × V scratch
    if chunk_size is None:
        chunk_size, vocab_chunk_size = auto_chunk_sizes(head.weight.shape[0])
    logp, entropy = chunked_logprobs_from_hidden(
        h,
        head.weight,
        y,
        bias=head.bias,
        temperature=temperature / head.scale,
        chunk_size=chunk_size,
        compute_entropy=compute_entropy,
        entropy_requires_grad=entropy_requires_grad,
        weight_grad_in_place=tied is not None,
        vocab_chunk_size=vocab_chunk_size,
        sampling_mask=None if sampling_mask is None else tuple(t[:, 1:][sel] for t in sampling_mask),
    )
    if entropy is not None and not entropy_requires_grad:
        entropy = entropy.detach()
    correct = None
    if compute_accuracy:
        argmax_chunk = chunk_size if vocab_chunk_size is None else auto_chunk_size(head.weight.shape[0])
        correct = _scatter(_chunked_argmax(h.detach(), head, argmax_chunk) == y, sel, torch.bool)
    return TokenStats(
        logps=_scatter(logp, sel),
        mask=mask,
        entropy=None if entropy is None else _scatter(entropy, sel),
        correct=correct,
        aux_loss=getattr(outputs, "aux_loss", None),
        chunked=True,
    )


def _tied_embedding_for_in_place_grad(model: torch.nn.Module, head: _Head) -> torch.nn.Embedding | None:
    """The input embedding when it shares the LM head's weight and both may add their gradients straight into
    ``weight.grad`` (:mod:`posttrain.core.tied_embedding`: one ``(V, H)`` gradient instead of two), else None.

    Only for an unwrapped model in one process (a DDP/FSDP/DeepSpeed wrapper or a process group owns the gradient
    reduction), with the head used as is (scale 1 is not required: the scale is folded into the temperature).
    """
    if unwrap_parallel(model) is not model or not torch.is_grad_enabled():
        return None
    get_in = getattr(unwrap_base_model(model), "get_input_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    if embedding is None or not in_place_tied_grad_supported(embedding, head.weight):
        return None
    return embedding


def _plain_path(
    model,
    input_ids,
    attention_mask,
    position_ids,
    targets,
    mask,
    width,
    temperature,
    chunk_size,
    compute_entropy,
    compute_accuracy,
    model_kwargs,
    entropy_requires_grad=False,
    sampling_mask=None,
) -> TokenStats:
    """Full-logits path: the model's own logits (with every head transform), then log-softmax at scored positions."""
    seq_len = input_ids.shape[1]
    extra = {}
    if width < seq_len and _accepts(model, "logits_to_keep"):
        extra["logits_to_keep"] = width + 1  # logits for the last width+1 positions predict the last width tokens
    outputs = _call_model(model, input_ids, attention_mask, position_ids, model_kwargs, **extra)
    stats = _stats_from_logits(
        outputs.logits,
        targets,
        mask,
        temperature,
        chunk_size,
        compute_entropy,
        compute_accuracy,
        entropy_requires_grad,
        sampling_mask,
    )
    stats.aux_loss = getattr(outputs, "aux_loss", None)
    return stats


def _stats_from_logits(
    logits,
    targets,
    mask,
    temperature,
    chunk_size,
    compute_entropy,
    compute_accuracy,
    entropy_requires_grad=False,
    sampling_mask=None,
) -> TokenStats:
    chunk_size = 1024 if chunk_size is None else chunk_size
    seq_len = targets.shape[1]
    if logits.shape[1] > seq_len:  # PEFT prompt learning prepends virtual tokens
        logits = logits[:, -seq_len:]
    # The kept logits belong to positions [T - kept, T); logits[:, :-1] predict positions [T - kept + 1, T).
    kept = logits.shape[1]
    full_sel = torch.zeros_like(mask[:, 1:])  # (B, T-1), index j ↔ position j + 1
    sel = mask[:, seq_len - kept + 1 :]
    full_sel[:, seq_len - kept :] = sel
    z = logits[:, :-1][sel]  # (N, V)
    if temperature != 1.0:
        z = z / temperature
    y = targets[:, seq_len - kept + 1 :][sel]
    if sampling_mask is not None:  # the sampler's kept support: −inf outside it (these logits exist anyway)
        ids, threshold = (t[:, seq_len - kept + 1 :][sel] for t in sampling_mask)
        z = apply_sampling_mask(z.float(), y, ids, threshold)
    logp = selective_log_softmax(z, y, chunk_size=chunk_size)
    entropy = correct = None
    if compute_entropy and entropy_requires_grad:  # the entropy enters the loss: H = −Σ_v p log p, with its graph
        log_p = torch.log_softmax(z.float(), dim=-1)
        # p log p = 0 outside a sampling mask's support (p = 0, log p = −inf)
        finite = log_p if sampling_mask is None else log_p.masked_fill(torch.isinf(log_p), 0.0)
        entropy = _scatter(-(log_p.exp() * finite).sum(dim=-1), full_sel)
    elif compute_entropy:
        with torch.no_grad():
            entropy = _scatter(entropy_from_logits(z.detach(), chunk_size=min(chunk_size, 128)), full_sel)
    if compute_accuracy:
        correct = _scatter(z.detach().argmax(-1) == y, full_sel, torch.bool)
    return TokenStats(logps=_scatter(logp, full_sel), mask=mask, entropy=entropy, correct=correct, chunked=False)


def token_stats_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    labels: torch.Tensor | None = None,
    labels_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    compute_accuracy: bool = False,
    chunk_size: int = 1024,
) -> TokenStats:
    """:class:`TokenStats` from logits you already have (e.g. a ``compute_loss_func`` forward), same conventions.

    Args:
        logits: ``(B, T, V)`` logits aligned with ``input_ids`` (``logits[:, t]`` predicts token ``t + 1``).
        input_ids, attention_mask, labels, labels_mask, temperature, compute_entropy, compute_accuracy,
            chunk_size: as for :func:`forward_token_stats`.
    """
    seq_len = input_ids.shape[1]
    targets, mask = _targets_and_mask(input_ids, attention_mask, labels, labels_mask, seq_len)
    return _stats_from_logits(logits, targets, mask, temperature, chunk_size, compute_entropy, compute_accuracy)


# ----------------------------------------------------------------------------------------------------------------
# Length buckets
# ----------------------------------------------------------------------------------------------------------------

BUCKET_CALL_PENALTY = 0.05  # each extra forward call must save at least this fraction of the estimated cost


def plan_length_buckets(
    lengths: list[int], hidden_size: int, max_buckets: int = 4, call_penalty: float = BUCKET_CALL_PENALTY
) -> list[list[int]] | None:
    """Split rows into groups of similar length when running them separately is estimated to be cheaper.

    The cost of a padded forward over ``n`` rows of width ``T`` is taken as ``n·T·(12·d + 2·T)`` (projections and
    MLP per token, attention over the row); each extra call adds ``call_penalty`` of the single-call cost. Rows are
    sorted by length and cut into 1, 2, ... ``max_buckets`` equal-count groups; returns the cheapest split's row
    indices (longest group first), or None when one call is cheapest.
    """
    n = len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i])

    def cost(group: list[int]) -> float:
        width = max(lengths[i] for i in group)
        return len(group) * width * (12 * hidden_size + 2 * width)

    single = cost(order)
    best, best_cost = None, single
    for k in range(2, max_buckets + 1):
        if n < 2 * k:
            break
        bounds = [round(j * n / k) for j in range(k + 1)]
        groups = [order[bounds[j] : bounds[j + 1]] for j in range(k)]
        total = sum(cost(g) for g in groups) + call_penalty * (k - 1) * single
        if total < best_cost:
            best, best_cost = groups, total
    return best


def length_bucket_groups(
    model: torch.nn.Module, attention_mask: torch.Tensor | None
) -> list[tuple[torch.Tensor, int]] | None:
    """``[(rows, width), ...]`` for a right-padded 2-D mask worth splitting (see :func:`plan_length_buckets`)."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[0] < 4:
        return None
    if not bool(attention_mask[:, 0].all()):  # left padding (or empty rows): keep one call
        return None
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size() > 1:  # DDP/FSDP sync per forward call: same calls on all
        return None
    config = _config(unwrap_base_model(model))
    if config is None or getattr(config, "output_router_logits", False):  # MoE aux loss is per call
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden_size = int(getattr(text_config, "hidden_size", 0) or 1024)
    width = attention_mask.shape[1]
    positions = torch.arange(1, width + 1, device=attention_mask.device)
    lengths = (attention_mask.bool() * positions).amax(dim=1).tolist()  # last real token + 1
    groups = plan_length_buckets([int(x) for x in lengths], hidden_size)
    if groups is None:
        return None
    device = attention_mask.device
    return [(torch.tensor(g, device=device), max(int(lengths[i]) for i in g)) for g in groups]


def restore_row_order(
    parts: list[torch.Tensor], groups: list[tuple[torch.Tensor, int]], width: int | None = None
) -> torch.Tensor:
    """Concatenate per-group results (rows first) back in the original row order.

    ``parts[i]`` holds group ``i``'s rows; with ``width`` their dim 1 (positions) is right-padded with zeros from the
    group's width to ``width``. Differentiable.
    """
    if width is not None:
        padded = []
        for v in parts:
            pad = [0, 0] * (v.dim() - 2) + [0, width - v.shape[1]]
            padded.append(torch.nn.functional.pad(v, pad))
        parts = padded
    rows = torch.cat([r for r, _ in groups])
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(rows.numel(), device=rows.device)
    return torch.cat(parts)[inverse]


def _bucketed_token_stats(
    groups: list[tuple[torch.Tensor, int]], run: Any, shape: torch.Size | tuple[int, int]
) -> TokenStats:
    """Run ``run(rows, width)`` per group and put the per-row results back in the original ``(B, T)`` layout."""
    parts = [run(rows, w) for rows, w in groups]

    def gather(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else restore_row_order(values, groups, shape[1])

    return TokenStats(
        logps=gather("logps"),
        mask=gather("mask"),
        entropy=gather("entropy"),
        correct=gather("correct"),
        aux_loss=None,
        chunked=all(p.chunked for p in parts),
    )


def _padding_free_token_stats(
    model: torch.nn.Module,
    layout: PaddingFreeLayout,
    *,
    labels: torch.Tensor | None,
    labels_mask: torch.Tensor | None,
    **kwargs: Any,
) -> TokenStats:
    """:func:`forward_token_stats` of a right-padded batch run as one flat row (:mod:`posttrain.models.padding_free`),
    its results put back into the ``(B, T)`` layout: padding and each row's first token unscored, as in the padded
    call."""
    scored = layout.rows if labels is None else labels != IGNORE_INDEX
    if labels_mask is not None:
        scored = scored & labels_mask.bool()
    scored = scored & layout.rows
    scored[:, 0] = False  # a row's first token is never scored (no predictor)
    stats = forward_token_stats(
        model,
        layout.input_ids,
        layout.attention_mask,
        labels=None if labels is None else layout.flatten(labels),
        labels_mask=layout.scored(scored),
        position_ids=layout.position_ids,
        **kwargs,
    )
    return TokenStats(
        logps=layout.to_rows(stats.logps) * scored,
        mask=scored,
        entropy=None if stats.entropy is None else layout.to_rows(stats.entropy) * scored,
        correct=None if stats.correct is None else layout.to_rows(stats.correct, False) & scored,
        aux_loss=stats.aux_loss,
        chunked=stats.chunked,
        padding_free=layout,
    )


def sequence_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, length_buckets: bool = True
) -> torch.Tensor:
    """First logit of a sequence classifier per row, ``(B,)`` float32 (reward models read the last real token).

    With ``length_buckets`` right-padded rows of very different lengths run in groups of similar length, each
    trimmed to its longest row (:func:`plan_length_buckets`); rows never interact, so the scores are the same.
    """

    def run(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, 0].float()

    groups = length_bucket_groups(model, attention_mask) if length_buckets else None
    if groups is None:
        return run(input_ids, attention_mask)
    return restore_row_order([run(input_ids[r, :w], attention_mask[r, :w]) for r, w in groups], groups)


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def forward_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    labels: torch.Tensor | None = None,
    labels_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    logits_to_keep: int | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    compute_accuracy: bool = False,
    chunk_size: int | None = None,
    chunked: bool = True,
    entropy_requires_grad: bool = False,
    length_buckets: bool = False,
    sampling_mask: tuple[torch.Tensor, torch.Tensor] | None = None,
    **model_kwargs: Any,
) -> TokenStats:
    """Run ``model`` once and return per-token log-probs of the next tokens (plus entropy, top-1 hits, aux loss).

    ``logps[:, t] = log softmax(z_{t-1} / temperature)[target_t]`` where ``z_{t-1}`` are the logits after token
    ``t-1`` and ``target = labels`` (``-100`` = not scored) or ``input_ids``. Scored positions are those with a
    target, ``labels_mask`` True (if given), ``attention_mask`` 1 (2-D masks, when no ``labels``), ``t ≥ 1`` and
    inside the last ``logits_to_keep`` positions. Only scored positions reach the LM head.

    Args:
        model: a causal LM (``PreTrainedModel``, ``PeftModel``, or one wrapped by accelerate).
        input_ids: ``(B, T)`` token ids.
        attention_mask: ``(B, T)`` padding mask, or a ``(1, 1, L, L)`` block-diagonal bool mask from the
            padding-free collator (adapted by :func:`prepare_attention_mask`).
        labels: optional ``(B, T)`` targets with ``-100`` at unscored positions (SFT's labels).
        labels_mask: optional ``(B, T)`` (or ``(B, K)`` with ``logits_to_keep=K``) mask of positions to score,
            e.g. a completion mask.
        position_ids: optional ``(B, T)`` positions (restarting per packed sequence).
        logits_to_keep: score only the last K tokens and return ``(B, K)`` tensors (TRL's GRPO convention:
            ``logps[:, -K:]`` are the completion tokens).
        temperature: logits are divided by it (GRPO's sampling temperature).
        compute_entropy: also return the (detached) entropy of each scored position's distribution.
        compute_accuracy: also return whether the top-1 prediction equals the target (a no-grad chunked argmax
            pass over the same hidden states on the chunked path).
        chunk_size: tokens per chunk; the chunked path's scratch memory is about ``2 × chunk_size × V`` floats.
            None sizes it from the vocabulary (:func:`auto_chunk_sizes`: ~16 MiB of scratch, or for vocabularies
            above 32 768 rows 256-token chunks tiled into 2048-row vocabulary blocks, ~4 MiB).
        chunked: False forces the plain full-logits path (TRL's ``nll`` loss type, and reference checks).
        entropy_requires_grad: return the entropy with its autograd graph (an entropy bonus in the loss); on the
            chunked path its gradient −p (log p + H) is recomputed chunk-wise, so still no ``(B, T, V)`` logits.
        length_buckets: skip the work on padding of right-padded rows. First choice: the padding-free layout
            (:func:`posttrain.models.padding_free.padding_free_layout`: the real tokens as one flat row with block
            attention per row, rows with the same prompt before their first ``labels_mask`` token sharing it;
            sdpa on CPU, see there for when it applies; ``position_ids`` are carried over). Otherwise groups of
            similar length, each trimmed to its longest row (:func:`plan_length_buckets`), when that is estimated
            to save work; ignored with ``position_ids``, 4-D masks, MoE router losses and several processes
            (DDP/FSDP synchronise on every forward call, so all ranks must make the same calls). Rows never
            interact, so the result is the same up to float summation order. Both are off with
            ``logits_to_keep`` and extra model inputs.
        sampling_mask: ``(ids (B, W, K), threshold (B, W))`` aligned with the targets (``W`` = T, or K =
            ``logits_to_keep``): the sampler's kept support of each target's distribution
            (:mod:`posttrain.core.sampling_mask`). Log-probs and entropies are then the masked log-softmax over it,
            on both paths; None (default): the full softmax.
        **model_kwargs: passed to the model (e.g. ``pixel_values``).

    Returns:
        :class:`TokenStats` with ``(B, T)`` (or ``(B, K)``) float32 ``logps`` that carry gradients.
    """
    padding_free = length_buckets and logits_to_keep is None and not model_kwargs and sampling_mask is None
    if padding_free and _accepts(model, "position_ids"):  # (the kept-support path scores the padded layout)
        share = labels_mask if labels is None else None  # scored tokens mark the prompt (preference rows)
        layout = padding_free_layout(model, input_ids, attention_mask, position_ids, share_prompts=share)
        if layout is not None:
            return _padding_free_token_stats(
                model,
                layout,
                labels=labels,
                labels_mask=labels_mask,
                temperature=temperature,
                compute_entropy=compute_entropy,
                compute_accuracy=compute_accuracy,
                chunk_size=chunk_size,
                chunked=chunked,
                entropy_requires_grad=entropy_requires_grad,
            )
    if length_buckets and logits_to_keep is None and position_ids is None and not model_kwargs:
        groups = length_bucket_groups(model, attention_mask)
        if groups is not None:
            return _bucketed_token_stats(
                groups,
                lambda rows, width: forward_token_stats(
                    model,
                    input_ids[rows, :width],
                    attention_mask[rows, :width],
                    labels=None if labels is None else labels[rows, :width],
                    labels_mask=None if labels_mask is None else labels_mask[rows, :width],
                    temperature=temperature,
                    compute_entropy=compute_entropy,
                    compute_accuracy=compute_accuracy,
                    chunk_size=chunk_size,
                    chunked=chunked,
                    entropy_requires_grad=entropy_requires_grad,
                    sampling_mask=None if sampling_mask is None else tuple(t[rows, :width] for t in sampling_mask),
                ),
                input_ids.shape,
            )
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}.")
    seq_len = input_ids.shape[1]
    width = seq_len if logits_to_keep is None else int(logits_to_keep)
    if not 1 <= width <= seq_len:
        raise ValueError(f"logits_to_keep must be in [1, T={seq_len}], got {logits_to_keep}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    targets, mask = _targets_and_mask(input_ids, attention_mask, labels, labels_mask, width)
    attention_mask = prepare_attention_mask(model, attention_mask)
    if sampling_mask is not None:
        sampling_mask = _align_sampling_mask(sampling_mask, input_ids.shape, width, input_ids.device)
    common = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        targets=targets,
        mask=mask,
        temperature=temperature,
        chunk_size=chunk_size,
        compute_entropy=compute_entropy,
        compute_accuracy=compute_accuracy,
        model_kwargs=model_kwargs,
        entropy_requires_grad=entropy_requires_grad,
        sampling_mask=sampling_mask,
    )
    stats = None
    if chunked:
        inner = unwrap_base_model(model)
        head = resolve_lm_head(model)
        if isinstance(head, _Head):
            stats = _chunked_path(model, head, **common)
            if stats is None:
                head = "its logits differ from hidden_states @ lm_head.weight (an unknown head transform)"
        if stats is None:
            log_once(
                f"posttrain: chunked log-probs are not used for {type(inner).__name__} because {head}; falling back "
                "to full-vocabulary logits (more memory, same result)."
            )
    if stats is None:
        stats = _plain_path(model, width=width, **common)
    if width != seq_len:
        keep = slice(seq_len - width, None)
        stats.logps, stats.mask = stats.logps[:, keep], stats.mask[:, keep]
        stats.entropy = None if stats.entropy is None else stats.entropy[:, keep]
        stats.correct = None if stats.correct is None else stats.correct[:, keep]
    return stats


def _align_sampling_mask(
    sampling_mask: tuple[torch.Tensor, torch.Tensor], shape: torch.Size, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, threshold)`` given for the last ``width`` positions (or all T), left-padded to ``(B, T, ·)`` with the
    unknown support (ids −1, threshold −inf) and moved to the targets' device."""
    ids, threshold = (t.to(device) for t in sampling_mask)
    batch, seq_len = shape
    if ids.dim() != 3 or ids.shape[:2] not in ((batch, width), (batch, seq_len)) or threshold.shape != ids.shape[:2]:
        raise ValueError(
            f"sampling_mask must be (ids (B, W, K), threshold (B, W)) with (B, W) = ({batch}, {width}) or "
            f"({batch}, {seq_len}), got {tuple(ids.shape)} and {tuple(threshold.shape)}."
        )
    if ids.shape[1] != seq_len:
        pad = seq_len - ids.shape[1]
        ids = torch.nn.functional.pad(ids, (0, 0, pad, 0), value=-1)
        threshold = torch.nn.functional.pad(threshold, (pad, 0), value=float("-inf"))
    return ids, threshold


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    position_ids: torch.Tensor | None = None,
    logits_to_keep: int | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_size: int = 1024,
    labels_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``log p(input_ids[:, t] | < t)`` (and entropies) from one forward pass.

    Shapes: ``(B, T)``, or ``(B, K)`` for the last ``K = logits_to_keep`` tokens (so ``logps[:, -K:]`` is the same
    tensor either way). Position 0, padding (``attention_mask`` 0) and positions outside ``labels_mask`` get 0.
    Computed with :func:`forward_token_stats` (chunked, no ``(B, T, V)`` logits); extra keyword arguments
    (``labels``, ``chunked``, model inputs) are passed through to it.

    Returns:
        ``(logps, entropy)``: float32 tensors; ``entropy`` is detached and None unless ``compute_entropy``.
    """
    stats = forward_token_stats(
        model,
        input_ids,
        attention_mask,
        position_ids=position_ids,
        logits_to_keep=logits_to_keep,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_size=chunk_size,
        labels_mask=labels_mask,
        **kwargs,
    )
    return stats.logps, stats.entropy
