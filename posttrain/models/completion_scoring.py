"""Scoring completions given their prompts: the inputs of the policy/old/reference forwards of online RL.

:func:`completion_token_stats` runs ``[prompt | completion]`` rows through :func:`forward_token_stats`, or, when it
saves work, the shared-prompt layout of :mod:`posttrain.models.prefix_sharing` (each distinct prompt encoded once
per micro-batch; design §3.2) — same log-probs, entropies and gradients.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import torch

from posttrain.data.vision_prompts import PER_TOKEN_VISION_KEYS, collate_vision_inputs, has_vision_inputs
from posttrain.models.forward import TokenStats, forward_token_stats
from posttrain.models.moe_routing import replay_routing, routing_for_packs, routing_for_rows
from posttrain.models.prefix_sharing import MicroBatchRows, SharedPromptLayout, plan_shared_prompt_layout
from posttrain.models.unwrap import unwrap_base_model

# A rollout micro-batch (``posttrain.rollout.buffer.RolloutBatch``: ``prompt_ids``, ``prompt_mask``,
# ``completion_ids``, ``completion_lengths``, ...); models/ sits below rollout/ and does not import it.
RolloutBatch = dict[str, Any]
logger = logging.getLogger(__name__)
_logged_vision_fallback = False

__all__ = [
    "choose_shared_prompt_layout",
    "completion_inputs",
    "completion_token_stats",
    "shared_prompt_token_stats",
    "vision_model_inputs",
]


def completion_inputs(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model inputs for scoring completions: ``(input_ids, attention_mask, position_ids, completion_attention)``.

    ``input_ids = [prompt_ids | completion_ids]`` ``(B, P + C)``; the attention mask is the left-padded prompt mask
    followed by the generated tokens of each completion (tool-result tokens included: they are context, just not
    trained on); ``position_ids`` count from each row's first real token; ``completion_attention`` ``(B, C)`` marks
    the generated tokens.
    """
    completion_ids = batch["completion_ids"]
    width = completion_ids.shape[1]
    lengths = batch["completion_lengths"].to(completion_ids.device)
    completion_attention = torch.arange(width, device=completion_ids.device).unsqueeze(0) < lengths.unsqueeze(1)
    input_ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], completion_attention.long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids, completion_attention


def completion_token_stats(
    model: torch.nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    entropy_requires_grad: bool = False,
    share_prompts: bool = False,
) -> TokenStats:
    """Log-probs ``(B, C)`` of the completion tokens given their prompts, from one chunked forward pass.

    See :func:`completion_inputs` for the inputs. Logits are divided by ``temperature`` (the sampling temperature,
    as TRL). Positions past a completion's end get log-prob 0. ``entropy_requires_grad`` keeps the entropies
    differentiable (GRPO's entropy bonus), still chunked. ``share_prompts`` encodes each distinct prompt once
    (:mod:`posttrain.models.prefix_sharing`) when the model's attention takes a tree mask and that saves work.

    A batch carrying the sampler's MoE routing (``prompt_routing`` / ``completion_routing``: ``keep_routing``) is
    scored with that routing replayed (:func:`posttrain.models.moe_routing.replay_routing`), in either layout.

    A batch carrying the sampler's kept support (``sampling_mask_ids`` ``(B, C, K)`` and ``sampling_mask_threshold``
    ``(B, C)``, ``keep_sampling_mask``) is scored with the masked log-softmax over it (:mod:`posttrain.core.sampling_mask`).
    """
    vision_kwargs = vision_model_inputs(model, batch)
    if share_prompts and vision_kwargs and not _shares_vision_prompts(vision_kwargs):
        global _logged_vision_fallback
        if not _logged_vision_fallback:
            _logged_vision_fallback = True
            logger.info(
                "Micro-batches with images use the plain [prompt | completion] forward, not the shared-prompt one "
                "(shared_prompt_forward), for this model: its vision inputs %s include per-token types (the model "
                "builds its own image attention from them) or multimodal RoPE grids.",
                sorted(vision_kwargs),
            )
        share_prompts = False
    if share_prompts:
        stats = shared_prompt_token_stats(
            model,
            batch,
            temperature=temperature,
            compute_entropy=compute_entropy,
            entropy_requires_grad=entropy_requires_grad,
        )
        if stats is not None:
            return stats
    input_ids, attention_mask, position_ids, completion_attention = completion_inputs(batch)
    if "image_grid_thw" in vision_kwargs:
        position_ids = None  # multimodal RoPE (Qwen2-VL family): the model derives its 3-D positions itself
    routing = routing_for_rows(batch)
    replay = nullcontext() if routing is None else replay_routing(model, routing.to(input_ids.device))
    with replay:
        return forward_token_stats(
            model,
            input_ids,
            attention_mask,
            position_ids=position_ids,
            logits_to_keep=completion_attention.shape[1],
            temperature=temperature,
            compute_entropy=compute_entropy,
            entropy_requires_grad=entropy_requires_grad,
            labels_mask=completion_attention,
            sampling_mask=batch_sampling_mask(batch),
            **vision_kwargs,
        )


def batch_sampling_mask(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(sampling_mask_ids (B, C, K), sampling_mask_threshold (B, C))`` of a batch, or None when it has none."""
    ids = batch.get("sampling_mask_ids")
    if ids is None:
        return None
    return ids, batch["sampling_mask_threshold"]


def _shares_vision_prompts(vision_kwargs: dict[str, torch.Tensor]) -> bool:
    """Whether the shared-prompt layout can carry these vision inputs: image features that replace the image
    tokens' embeddings in order (LLaVA-style); not per-token type ids (Gemma 3's bidirectional image attention would
    override the tree mask) nor multimodal RoPE grids (Qwen2-VL's positions come from the images)."""
    return not any(key in vision_kwargs for key in (*PER_TOKEN_VISION_KEYS, "image_grid_thw", "video_grid_thw"))


def vision_model_inputs(model: torch.nn.Module, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The model's vision inputs for ``batch`` (``pixel_values``, ``image_grid_thw``, ``token_type_ids``, ...) from
    its per-row ``vision_inputs`` (:func:`~posttrain.data.vision_prompts.collate_vision_inputs`), on the batch's
    device in the model's floating dtype; ``{}`` for a batch without images."""
    rows = batch.get("vision_inputs")
    if not has_vision_inputs(rows):
        return {}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return collate_vision_inputs(
        rows,
        prompt_width=int(batch["prompt_ids"].shape[1]),
        completion_width=int(batch["completion_ids"].shape[1]),
        device=batch["completion_ids"].device,
        dtype=dtype,
    )


TREE_MASK_ATTENTION = ("sdpa", "eager")
SHARED_PROMPT_MIN_SAVING = 0.8  # use the shared layout when its estimated cost is below this fraction of plain
PACK_TOKEN_CANDIDATES = (4096, 1)  # pack caps tried: one pack for the micro-batch (up to 4096 tokens), one per group


def choose_shared_prompt_layout(model: torch.nn.Module, batch: RolloutBatch) -> SharedPromptLayout | None:
    """The cheapest shared-prompt layout of ``batch`` for ``model``, or None when the plain rows are the better choice.

    None when the model's attention cannot take a tree-shaped 4-D mask (flash attention, flex), with PEFT prompt
    learning, when a row is longer than an active sliding window (the tree mask would replace the model's window
    mask), for a MoE model that outputs its router logits (the load-balancing aux loss reads a 2-D mask and counts
    every row's prompt tokens, so it would change), for rows with an empty prompt, or when the estimated cost — tokens times (per-token projections +
    attention span), :meth:`SharedPromptLayout.cost_ratio` — is not clearly lower. One long pack shares a system
    prompt across groups; one pack per group keeps a dense attention small; the cheaper one wins. Under sdpa the
    layout's mask is a :class:`~posttrain.models.tree_attention.TreeAttentionMask` (block attention) whenever its
    blocks clearly beat the dense ``L²``, and the cost counts those blocks' scores.
    """
    config = getattr(unwrap_base_model(model), "config", None)
    impl = str(getattr(config, "_attn_implementation", None) or "sdpa")
    if config is None or impl not in TREE_MASK_ATTENTION or _is_prompt_learning(model):
        return None
    text_config = config.get_text_config()
    if getattr(text_config, "output_router_logits", False):
        return None
    window = getattr(text_config, "sliding_window", None)
    if window and getattr(text_config, "use_sliding_window", True) is not False:
        longest = int(batch["prompt_mask"].sum(dim=1).max()) + int(batch["completion_lengths"].max())
        if longest > int(window):  # a custom 4-D mask replaces the model's sliding-window mask
            return None
    hidden_size = int(getattr(text_config, "hidden_size", 0) or 1024)
    rows = MicroBatchRows.from_tensors(
        batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_lengths"]
    )
    vision = has_vision_inputs(batch.get("vision_inputs"))
    if vision:
        # a group is a prompt *with its images* (rows of one group share one vision-input dict); one pack per group,
        # so no prefix holding image tokens is shared by prompts whose images differ
        rows.group_keys = [id(inputs) for inputs in batch["vision_inputs"]]
        image_tokens = [getattr(config, name, None) for name in ("image_token_id", "image_token_index")]
        last = batch["prompt_ids"][:, -1]  # left-padded: each prompt's last token, copied into its completions
        if any(isinstance(t, int) and bool((last == t).any()) for t in image_tokens):
            return None
    # sdpa calls on a TreeAttentionMask compute only the tree's blocks; a compiled model keeps the plain mask (its
    # graph would have to trace the tensor subclass)
    block_attention = impl == "sdpa" and not _is_compiled(model)
    plan, best = None, SHARED_PROMPT_MIN_SAVING
    for max_pack_tokens in PACK_TOKEN_CANDIDATES[-1:] if vision else PACK_TOKEN_CANDIDATES:  # host lists: cheap
        candidate = plan_shared_prompt_layout(rows, max_pack_tokens=max_pack_tokens)
        if candidate is None:
            return None
        ratio = candidate.cost_ratio(hidden_size, block_attention=block_attention)
        if ratio <= best:
            plan, best = candidate, ratio
        if candidate.num_packs == candidate.num_groups:
            break  # already one pack per group: smaller caps give the same layout
    if plan is None:
        return None
    pad_token_id = _safe_pad_token_id(config)
    return plan.materialize(
        pad_token_id=pad_token_id, device=batch["completion_ids"].device, block_attention=block_attention
    )


def shared_prompt_token_stats(
    model: torch.nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    entropy_requires_grad: bool = False,
) -> TokenStats | None:
    """:func:`completion_token_stats` with each distinct prompt encoded once per micro-batch (design §3.2).

    Returns None (the caller runs the plain forward) when :func:`choose_shared_prompt_layout` finds no layout worth it.
    """
    layout = choose_shared_prompt_layout(model, batch)
    if layout is None:
        return None
    vision_kwargs = {}
    rows = batch.get("vision_inputs")
    if has_vision_inputs(rows):
        # each group's prompt (its image tokens) appears once, in first-row order: its images once, in that order
        firsts, seen = [], set()
        for inputs in rows:
            if id(inputs) not in seen:
                seen.add(id(inputs))
                firsts.append(inputs)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        vision_kwargs = collate_vision_inputs(
            firsts, prompt_width=0, device=batch["completion_ids"].device, dtype=dtype
        )
    routing = routing_for_rows(batch)
    replay = nullcontext()
    if routing is not None:  # keep_routing: each pack token replays its plain row's record
        prompt_mask = batch["prompt_mask"].to(layout.position_ids.device)
        packed = routing_for_packs(routing.to(prompt_mask.device), prompt_mask, layout.token_row, layout.position_ids)
        replay = replay_routing(model, packed)
    with replay:
        stats = forward_token_stats(
            model,
            layout.input_ids,
            layout.attention_mask,
            labels=layout.labels,
            position_ids=layout.position_ids,
            temperature=temperature,
            compute_entropy=compute_entropy,
            entropy_requires_grad=entropy_requires_grad,
            sampling_mask=_packed_sampling_mask(layout, batch_sampling_mask(batch)),
            **vision_kwargs,
        )
    shape = tuple(batch["completion_ids"].shape)
    lengths = batch["completion_lengths"].to(batch["completion_ids"].device)
    return TokenStats(
        logps=layout.to_rows(stats.logps, shape),
        mask=torch.arange(shape[1], device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1),
        entropy=None if stats.entropy is None else layout.to_rows(stats.entropy, shape),
        aux_loss=stats.aux_loss,
        chunked=stats.chunked,
    )


def _packed_sampling_mask(
    layout: SharedPromptLayout, sampling_mask: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``(B, C)`` rows' sampling mask moved to the packs' ``(K, L)`` positions of the same tokens (unknown
    support elsewhere: those positions are not scored)."""
    if sampling_mask is None:
        return None
    ids, threshold = (t.to(layout.labels.device) for t in sampling_mask)
    packs, length = layout.labels.shape
    packed_ids = ids.new_full((packs, length, ids.shape[-1]), -1)
    packed_threshold = threshold.new_full((packs, length), float("-inf"))
    packed_ids[layout.pack_index, layout.pack_pos] = ids[layout.row_index, layout.col_index]
    packed_threshold[layout.pack_index, layout.pack_pos] = threshold[layout.row_index, layout.col_index]
    return packed_ids, packed_threshold


def _is_compiled(model: torch.nn.Module) -> bool:
    """``torch.compile``'d: an ``OptimizedModule`` wrapper (``torch.compile(model)``, ``torch_compile=True``) or a
    module compiled in place (``model.compile()``), also under DDP / accelerate wrappers."""
    while model is not None:
        if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
            return True
        model = getattr(model, "module", None)
    return False


def _is_prompt_learning(model: torch.nn.Module) -> bool:
    """PEFT prompt learning prepends virtual tokens, which a tree mask does not cover."""
    while model is not None:
        if bool(getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False)):
            return True
        model = getattr(model, "module", None)  # DDP / accelerate wrappers
    return False


def _safe_pad_token_id(config: Any) -> int:
    """An id to write at the packs' padding positions (masked out, but still embedded): the text model's pad id,
    or 0 when there is none or it lies outside the embedding (a VLM's top-level config may carry a pad id of the
    original checkpoint's vocabulary, e.g. Idefics3's default 128002, whatever the text model's size)."""
    text_config = getattr(config, "text_config", None) or config
    vocab_size = getattr(text_config, "vocab_size", None) or getattr(config, "vocab_size", None)
    for source in (text_config, config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int) and pad >= 0 and (vocab_size is None or pad < vocab_size):
            return pad
    return 0
