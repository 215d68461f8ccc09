"""posttrain's own group sampler (the default ``"posttrain"`` generation backend), design §3.2.

GRPO/RLOO sample G completions per prompt. ``model.generate`` prefills every one of the B·G rows, although each
group of G shares its prompt, and keeps decoding finished rows (feeding them pad tokens) until the longest
completion is done. ``GroupSampler`` instead

1. prefills each *unique* prompt once (left-padded batch, attention mask, ``position_ids`` counted from the first
   real token, only the last position's logits); when the unique prompts share a long common prefix (a system
   prompt: ``SHARED_PREFIX_MIN_TOKENS`` or more), that prefix is prefilled once at batch 1 and each prompt's rest
   after it (padding between the two, masked; positions over real tokens only),
2. expands the ``DynamicCache`` G ways along the batch (``batch_repeat_interleave``; ``batch_select_indices`` when
   identical prompts were merged),
3. decodes step by step with transformers' own ``LogitsProcessor`` classes in ``generate``'s order (repetition
   penalty → temperature → top-k → top-p → min-p) so the sampling distribution is the same, records each sampled
   token's log-prob under that processed distribution (and, when top-k / top-p / min-p truncate, the log of the
   probability mass they kept, ``Completions.log_kept_mass``, so the importance ratio can compare the trainer's
   full softmax with the sampler's on the same scale) and, with ``SamplingConfig.return_sampling_mask``, each
   token's kept support (``Completions.sampling_mask``, :mod:`posttrain.core.sampling_mask`) for the trainer to
   replay,
4. runs decode steps through the model's own modules directly once that matched its forward bitwise
   (:mod:`posttrain.generation.lean_decode`), and
5. drops finished rows from the decode batch (``batch_select_indices`` on the cache, and on the mask, positions and
   token history), so short completions stop costing compute.

Greedy decoding (``do_sample=False``) applies only the repetition penalty and takes the argmax, as ``generate``
does. Randomness comes from the global torch RNG or the ``generator`` passed in. Token-for-token equality with
``generate`` under sampling is not a goal (the decode batch shrinks, so the RNG stream is consumed differently);
equality in distribution is.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from posttrain.core.categorical import TWO_LEVEL_MIN_VOCAB, inverse_cdf, inverse_cdf_two_level
from posttrain.core.sampling_mask import (
    SAMPLING_MASK_MAX_IDS,
    describe_kept_support,
    describe_top_k_support,
    sampling_mask_entries,
    truncate_top_k,
)
from posttrain.core.scratch import ScratchBuffers
from posttrain.generation.base import Completions, SamplingConfig
from posttrain.generation.host_memory import release_freed_host_memory
from posttrain.generation.lean_decode import LeanDecoder
from posttrain.generation.transformers_backend import left_pad, sampling_mode
from posttrain.models.unwrap import model_device, unwrap_parallel

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def build_logits_processors(sampling: SamplingConfig) -> tuple[Any, Any]:
    """transformers processors for ``sampling``, in ``GenerationMixin._get_logits_processor``'s order.

    Returns ``(repetition_penalty_processor | None, LogitsProcessorList)`` where the list holds every processor
    (the repetition penalty first). The repetition processor is returned separately because its
    ``prompt_ignore_length`` (left-padding per row) must follow the rows as finished ones are dropped.
    Warpers (temperature, top-k, top-p, min-p) are only added when sampling, as in ``generate``.
    """
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    repetition = None
    if sampling.repetition_penalty is not None and sampling.repetition_penalty != 1.0:
        repetition = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)
        processors.append(repetition)
    if sampling.do_sample:
        if sampling.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            processors.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
        if sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
        if sampling.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=sampling.min_p, min_tokens_to_keep=1))
    return repetition, processors


def split_truncation(processors: Any) -> tuple[Any, Any]:
    """``(before, truncation)``: the processors up to temperature, and the top-k / top-p / min-p warpers after them.

    Truncation only sets scores to −inf, so ``before``'s output restricted to the kept tokens equals the final
    scores: log S = logsumexp(final) − logsumexp(before) is the log of the mass truncation kept
    (:func:`posttrain.core.importance.truncated_log_kept_mass`). ``truncation`` is empty when nothing truncates.
    """
    from transformers import LogitsProcessorList, MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    cut = (TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
    before = LogitsProcessorList([p for p in processors if not isinstance(p, cut)])
    truncation = LogitsProcessorList([p for p in processors if isinstance(p, cut)])
    return before, truncation


def _top_k_first(truncation: Any, vocab: int) -> tuple[int, Any]:
    """``(k, rest)`` when ``truncation`` starts with a top-k warper keeping 1 ≤ k ≤ ``SAMPLING_MASK_MAX_IDS`` of
    ``vocab`` tokens (filter −inf): the decode loop then truncates with :func:`truncate_top_k` and applies ``rest``
    (a processor list, None when empty) after it. ``(0, None)`` otherwise: the warpers run as they are."""
    from transformers import LogitsProcessorList, TopKLogitsWarper

    if not truncation or not isinstance(truncation[0], TopKLogitsWarper):
        return 0, None
    warper = truncation[0]
    k = min(warper.top_k, vocab)
    if not (1 <= k < vocab and k <= SAMPLING_MASK_MAX_IDS and warper.filter_value == float("-inf")):
        return 0, None
    return k, (LogitsProcessorList(truncation[1:]) if len(truncation) > 1 else None)


def sample_categorical(
    probs: torch.Tensor, generator: torch.Generator | None = None, rows_per_chunk: int = 64
) -> torch.Tensor:
    """One draw per row from ``probs`` ``(R, V)`` by inverse CDF: ``token = min{i : CDF_i > u · CDF_V}``.

    Exact like ``torch.multinomial(probs, 1)``, but needs one uniform per row instead of one exponential per
    vocabulary entry. Vocabularies above ``TWO_LEVEL_MIN_VOCAB`` search block sums first, then one block
    (``posttrain.core.categorical``), so no ``(R, V)`` float64 cumulative sum is built; smaller ones cumulate
    ``rows_per_chunk`` rows at a time. A zero-probability token is never returned.
    """
    u = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=probs.device)  # (R, 1)
    if probs.shape[1] > TWO_LEVEL_MIN_VOCAB:
        return inverse_cdf_two_level(probs, u)
    return inverse_cdf(probs, u, rows_per_chunk)


class GroupSampler:
    """Sample G completions per prompt from one prefill per unique prompt, dropping finished rows as they end.

    Args:
        model: A decoder-only causal LM whose forward takes ``attention_mask``, ``position_ids`` and a
            ``DynamicCache`` (every transformers causal LM; PEFT-wrapped is fine). DDP-style ``.module``
            wrappers are stripped.
        tokenizer: Unused by sampling (ids in, ids out); kept for the common ``(model, tokenizer)`` constructor.
        return_logprobs: Return each sampled token's log-prob under the processed sampling distribution.
        max_batch_tokens: Cap on ``rows × (longest prompt + max_new_tokens)`` per batch (a KV-cache budget);
            prompts are split, in order, into consecutive batches under it (a single prompt's G rows always go
            together). ``None`` = everything in one batch.
        generator: Optional ``torch.Generator`` (on the model's device) used instead of the global RNG.
        top_logprobs: With ``return_logprobs``, also keep each step's ``top_logprobs`` most likely tokens under the
            same processed distribution (vLLM's ``logprobs=N``): ``last_top_logprobs[row][step]`` is a list of
            ``(token id, log-prob)`` by decreasing log-prob (``-inf`` for tokens the warpers filtered out).
        record_routing: For a mixture-of-experts model (``keep_routing``), record each token's top-k experts per
            router layer during prefill and decode (:mod:`posttrain.models.moe_routing`) and return them as
            ``Completions.routing``, for the training forward to replay.

    After each ``generate`` call, ``last_stats`` holds ``prefill_rows`` (unique prompts prefilled),
    ``prefill_tokens`` (padded prompt tokens run), ``shared_prefix_tokens`` (prefix tokens prefilled once for all of
    a batch's unique prompts, summed over batches; 0 when no batch shared one), ``decode_batch_sizes`` (rows per
    decode forward) and ``num_batches``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        return_logprobs: bool = True,
        max_batch_tokens: int | None = None,
        generator: torch.Generator | None = None,
        top_logprobs: int = 0,
        record_routing: bool = False,
    ):
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be a positive integer or None, got {max_batch_tokens!r}.")
        self.model = model
        self.tokenizer = tokenizer
        self.return_logprobs = return_logprobs
        self.max_batch_tokens = max_batch_tokens
        self.generator = generator
        self.top_logprobs = int(top_logprobs)
        self.last_top_logprobs: list[list[list[tuple[int, float]]]] | None = None
        self.last_stats: dict[str, Any] = {}
        self._trimmed_host_memory = False
        self.record_routing = bool(record_routing)
        if self.record_routing:
            from posttrain.models.moe_routing import require_routers

            require_routers(unwrap_parallel(model))

    def sync_weights(self, model: Any) -> None:
        """No-op: sampling runs on the trainer's own model object."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        num_generations: int = 1,
        vision_inputs: list[dict[str, Any]] | None = None,
    ) -> Completions:
        """Sample ``num_generations`` completions per prompt; rows ordered ``[p0 g0, p0 g1, ..., p1 g0, ...]``.

        Args:
            prompt_ids: Unpadded prompt token ids, one list per prompt (duplicates are prefilled once).
            sampling: What to sample; ``generation_kwargs`` may only override ``SamplingConfig`` fields here.
            num_generations: Completions per prompt (G).
            vision_inputs: A vision-language batch: one dict of processor outputs per prompt (``pixel_values``,
                ...; ``{}`` for a text-only prompt). Each prompt is prefilled once with its images (the vision tower
                runs once per prompt, not G times) and its cache shared by its G completions; image tokens are
                never sampled. Models with multimodal RoPE (``image_grid_thw``: the Qwen2-VL family), whose decode
                positions depend on the images, are sampled with ``model.generate`` instead (logged once).

        Returns:
            ``Completions`` with ``len(prompt_ids) * num_generations`` rows, each cut after its first EOS.
        """
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
        s = sampling.resolved()
        if s.generation_kwargs:
            raise ValueError(
                f"The 'posttrain' generation backend (GroupSampler) does not support generation_kwargs "
                f"{sorted(s.generation_kwargs)}; it accepts only keys that override sampling fields (max_new_tokens, "
                "temperature, top_p, top_k, min_p, repetition_penalty, do_sample, eos_token_id, pad_token_id). "
                "Use the 'transformers' generation backend to pass other GenerationConfig arguments."
            )
        if s.cache_implementation not in (None, "dynamic") and "cache_implementation" not in _warned:
            _warned.add("cache_implementation")
            logger.warning(
                "GroupSampler always uses a DynamicCache (it drops finished rows from it); cache_implementation=%r "
                "is ignored. Use the 'transformers' generation backend to honour it.",
                s.cache_implementation,
            )
        self.last_stats = {
            "prefill_rows": 0, "prefill_tokens": 0, "shared_prefix_tokens": 0, "decode_batch_sizes": [],
            "num_batches": 0,
        }  # fmt: skip
        n_rows = len(prompt_ids) * num_generations
        completion_ids: list[list[int]] = [[] for _ in range(n_rows)]
        logprobs: list[list[float]] | None = [[] for _ in range(n_rows)] if self.return_logprobs else None
        _, truncation = split_truncation(build_logits_processors(s)[1])
        kept_mass: list[list[float]] | None = (
            [[] for _ in range(n_rows)] if logprobs is not None and truncation else None
        )
        # the kept support per token (keep_sampling_mask): recorded when truncation happens, with or without log-probs
        support: list[list[Any]] | None = (
            [[] for _ in range(n_rows)] if truncation and s.return_sampling_mask else None
        )
        finished = [False] * n_rows
        self.last_top_logprobs = [[] for _ in range(n_rows)] if self.return_logprobs and self.top_logprobs > 0 else None
        for i, ids in enumerate(prompt_ids):
            if len(ids) == 0:
                raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token.")
        model = unwrap_parallel(self.model)
        if vision_inputs is not None and any("image_grid_thw" in inputs for inputs in vision_inputs):
            if self.record_routing:
                raise ValueError(
                    "keep_routing=True: prompts with images on a multimodal-RoPE model (image_grid_thw) are sampled "
                    "with model.generate, which records no MoE routing. Set keep_routing=False for this model."
                )
            if "mrope" not in _warned:
                _warned.add("mrope")
                logger.info(
                    "Prompts with images on a model with multimodal RoPE (image_grid_thw) are sampled with "
                    "model.generate (the 'transformers' backend): the group sampler's decode positions do not "
                    "follow its 3-D rotary positions."
                )
            from posttrain.generation.transformers_backend import TransformersBackend

            backend = TransformersBackend(self.model, self.tokenizer, return_logprobs=self.return_logprobs)
            return backend.generate(prompt_ids, sampling, num_generations, vision_inputs=vision_inputs)
        recorder = _routing_recorder(model) if self.record_routing else None
        routing: list[Any] | None = None if recorder is None else [None] * n_rows
        with sampling_mode(model), recorder.hooks() if recorder is not None else contextlib.nullcontext():
            for start, stop in self._batches(prompt_ids, num_generations, s.max_new_tokens):
                self._generate_batch(
                    model, prompt_ids[start:stop], start * num_generations, s, num_generations,
                    completion_ids, logprobs, finished,
                    vision=None if vision_inputs is None else vision_inputs[start:stop], kept_mass=kept_mass,
                    routing=None if recorder is None else (recorder, routing),
                    support=support,
                )  # fmt: skip
        if model_device(model).type == "cpu" and not self._trimmed_host_memory:
            # The first generation's freed decode buffers go back to the OS before training first allocates; later
            # steps reuse the heap's blocks, and trimming every step would only fault them back in (~6 000 page
            # faults a step on grpo@small) without lowering the peak.
            self._trimmed_host_memory = True
            release_freed_host_memory()
        rows = [list(p) for p in prompt_ids for _ in range(num_generations)]
        return Completions(
            completion_ids, logprobs, finished, rows, log_kept_mass=kept_mass, routing=routing, sampling_mask=support
        )

    def _batches(self, prompt_ids: list[list[int]], g: int, max_new_tokens: int) -> list[tuple[int, int]]:
        """Consecutive ``[start, stop)`` prompt ranges whose KV footprint stays under ``max_batch_tokens``."""
        if self.max_batch_tokens is None:
            return [(0, len(prompt_ids))] if prompt_ids else []
        out, start, longest = [], 0, 0
        for i, ids in enumerate(prompt_ids):
            new_longest = max(longest, len(ids))
            if i > start and (i - start + 1) * g * (new_longest + max_new_tokens) > self.max_batch_tokens:
                out.append((start, i))
                start, new_longest = i, len(ids)
            longest = new_longest
        if start < len(prompt_ids):
            out.append((start, len(prompt_ids)))
        return out

    def _generate_batch(
        self,
        model: Any,
        prompts: list[list[int]],
        row_offset: int,
        s: SamplingConfig,
        g: int,
        completion_ids: list[list[int]],
        logprobs: list[list[float]] | None,
        finished: list[bool],
        vision: list[dict[str, Any]] | None = None,
        kept_mass: list[list[float]] | None = None,
        routing: tuple[Any, list] | None = None,
        support: list[list[Any]] | None = None,
    ) -> None:
        """Prefill the unique prompts of ``prompts``, expand G ways, decode; write rows from ``row_offset`` on.

        ``vision``: each prompt's vision inputs (prompts with images are never merged: equal ids, other images).
        ``kept_mass``: when given (truncated sampling with log-probs), each token's log kept mass is appended.
        ``routing``: ``(RoutingRecorder, per-row output list)`` to record the MoE routing of every fed token.
        ``support``: when given, each token's kept-support entry is appended (with or without log-probs)."""
        from transformers import DynamicCache

        from posttrain.generation.kv_cache import preallocate_cache

        device = model_device(model)
        # Identical prompts share one prefill row; `source[r]` is the unique row that output row r extends.
        unique: dict[Any, int] = {}
        unique_ids: list[list[int]] = []
        source = []
        for index, ids in enumerate(prompts):
            key = (index,) if vision is not None else tuple(ids)
            if key not in unique:
                unique[key] = len(unique)
                unique_ids.append(list(ids))
            source.extend([unique[key]] * g)
        # (U, P) the full prompts, left-padded: the repetition penalty's token history, and the prefill's input
        input_ids, prompt_mask = left_pad(unique_ids, s.pad_token_id, device)
        cache_kw = _cache_kwarg(model)
        routing_log = None
        if routing is not None:
            from posttrain.models.moe_routing import SampledRouting

            lengths = [len(prompts[i // g]) for i in range(len(source))]
            routing_log = SampledRouting(routing[0], lengths, source, s.max_new_tokens)
        # A long prefix all distinct prompts share (a system prompt) is prefilled once (not with images: their
        # features are spliced per prompt by the model's own forward).
        prefix = _shared_prefix_length(unique_ids) if vision is None else 0
        if prefix and not _may_share_prefix(model):
            prefix = 0
        suppress: list[int] = []
        if prefix:
            # Cache layout per unique row: [prefix | left padding | the rest of its prompt]; `attention_mask` is the
            # mask of that layout (U, S + R), the decode steps' mask and positions follow from it.
            rest_width = max(len(ids) for ids in unique_ids) - prefix
            cache = preallocate_cache(DynamicCache(config=model.config), reserve=rest_width + s.max_new_tokens)
            logits, attention_mask = _prefill_shared_prefix(
                model, unique_ids, prefix, s.pad_token_id, cache, cache_kw, routing_log
            )  # (U, V), (U, S + R)
            self.last_stats["prefill_tokens"] += prefix + len(unique_ids) * rest_width
        else:
            attention_mask = prompt_mask  # (U, P)
            # Positions count real tokens only, as generate's cumsum - 1 (pad positions are masked; 0 is arbitrary).
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (U, P)
            cache = preallocate_cache(DynamicCache(config=model.config), reserve=s.max_new_tokens)
            vision_kwargs: dict[str, Any] = {}
            if vision is not None:
                from posttrain.generation.transformers_backend import image_token_ids, vision_generate_inputs

                vision_kwargs = vision_generate_inputs(model, vision, 1, input_ids.shape[1])
                suppress = image_token_ids(model)
            # the vision tower runs here, once per prompt; decode steps read the image features from the cache
            logits = _forward_last(
                model, input_ids, attention_mask, position_ids, cache, cache_kw, **vision_kwargs
            )  # (U, V)
            if routing_log is not None:
                routing_log.prefill(len(unique), input_ids.shape[1])
            self.last_stats["prefill_tokens"] += input_ids.numel()
        if suppress:
            logits[:, suppress] = float("-inf")
        self.last_stats["prefill_rows"] += len(unique)
        self.last_stats["shared_prefix_tokens"] += prefix
        self.last_stats["num_batches"] += 1

        # Expand the prefill G ways: cache, last logits, mask and (for the repetition penalty) token history.
        if len(unique) == len(prompts):
            index = torch.arange(len(unique), device=device).repeat_interleave(g)
            cache.batch_repeat_interleave(g)
        else:
            index = torch.as_tensor(source, device=device)
            cache.batch_select_indices(index)
        # Vocabulary-sized buffers reused by every step (logits, log-sum-exp scratch, probabilities) and one
        # buffer for all steps' log-probs: fresh (R, V) tensors per step, interleaved with small long-lived ones,
        # fragment the C heap and raise the resident memory the training step then starts from.
        vocab = logits.shape[-1]
        scratch = ScratchBuffers(3 if s.do_sample else 2, len(source) * vocab, device)
        logits = torch.index_select(logits, 0, index, out=scratch.view(0, len(source), vocab))  # (R, V)
        attention_mask, history = attention_mask[index], input_ids[index]  # (R, ·) cache layout, full prompts
        positions = attention_mask.sum(-1)  # (R,) position of the next token: the prompt's length
        rows = list(range(row_offset, row_offset + len(source)))  # output row of each decode-batch row
        four_d = _takes_boolean_4d_mask(model) and vision is None  # a VLM decodes through its own forward
        mask = DecodeMask(attention_mask, s.max_new_tokens, four_d=four_d)

        def full_forward(ids: torch.Tensor, step_mask: torch.Tensor, pos: torch.Tensor, kv: Any) -> torch.Tensor:
            return _forward_last(model, ids, step_mask, pos, kv, cache_kw)

        # With the boolean 4-D mask the model's mask construction is void: its modules can be called directly.
        decode = LeanDecoder(model, full_forward, cache_kw) if four_d else full_forward

        repetition, processors = build_logits_processors(s)
        before, truncation = split_truncation(processors)
        record_kept = kept_mass is not None and len(truncation) > 0
        if repetition is not None:
            pad_lens = history.shape[1] - positions  # (R,) left padding of `history` the penalty must not see
        eos = set(s.eos_token_ids)
        step_lps = torch.empty(s.max_new_tokens * len(source), dtype=torch.float32, device=device)
        step_kept = torch.empty(
            s.max_new_tokens * len(source) if record_kept else 0, dtype=torch.float32, device=device
        )
        record_support = support is not None and len(truncation) > 0
        support_rows = s.max_new_tokens * len(source) if record_support else 0
        step_ids = torch.empty((support_rows, SAMPLING_MASK_MAX_IDS), dtype=torch.int32, device=device)
        # top_k ≤ 16 first: one topk both truncates and names the kept ids (no pass over the vocabulary to find them)
        top_k_cut, after_top_k = _top_k_first(truncation, vocab) if record_support else (0, None)
        step_threshold = torch.empty(support_rows, dtype=torch.float32, device=device)
        step_logprobs: list[tuple[list[int], int]] = []  # (rows, offset of their log-probs in step_lps) per step
        step_support: list[tuple[list[int], int]] = []  # (rows, offset of their supports in step_ids) per step
        written = described = 0
        top_k = min(self.top_logprobs, vocab) if self.last_top_logprobs is not None else 0
        step_tops: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (rows, values (R, N), ids (R, N))
        for step in range(s.max_new_tokens):
            if repetition is not None:
                repetition.prompt_ignore_length = pad_lens
            if record_kept or record_support:
                untruncated = before(history, logits)  # (R, V) after repetition penalty and temperature
                if top_k_cut:
                    scores, top_ids, untied = truncate_top_k(untruncated, top_k_cut)  # the top-k warper's scores
                    if after_top_k:
                        scores = after_top_k(history, scores)  # top-p / min-p narrow the top-k set further
                else:
                    scores = truncation(history, untruncated)  # (R, V) float32, processed as in generate
            else:
                scores = processors(history, logits)  # (R, V) float32, processed as in generate
            if s.do_sample:
                probs = torch.softmax(scores, dim=-1, out=scratch.view(2, len(rows), vocab))
                tokens = sample_categorical(probs, self.generator)  # (R,)
            else:
                tokens = scores.argmax(dim=-1)  # (R,)
            if logprobs is not None:
                lse = logsumexp_rows(scores, scratch.view(1, len(rows), vocab))  # (R,)
                token_lp = step_lps[written : written + len(rows)]
                torch.sub(scores.gather(-1, tokens[:, None]).squeeze(1), lse, out=token_lp)
                if record_kept:
                    # log S = logsumexp(kept) − logsumexp(all), ≤ 0 (clamped: the two sums round independently)
                    full_lse = logsumexp_rows(untruncated, scratch.view(1, len(rows), vocab))
                    torch.sub(lse, full_lse, out=step_kept[written : written + len(rows)]).clamp_(max=0.0)
                step_logprobs.append((rows, written))
                written += len(rows)
                if top_k:
                    values, ids = scores.topk(top_k, dim=-1)
                    step_tops.append((rows, values - lse[:, None], ids))
            if record_support:
                if top_k_cut and bool(untied.all()):  # the kept ids are among the top-k ones
                    ids, threshold = describe_top_k_support(scores, top_ids)  # (R, 16), (R,)
                else:
                    ids, threshold = describe_kept_support(  # (R, 16), (R,); the lse scratch is free now
                        untruncated, scores, out=scratch.view(1, len(rows), vocab)
                    )
                step_ids[described : described + len(rows)] = ids
                step_threshold[described : described + len(rows)] = threshold
                step_support.append((rows, described))
                described += len(rows)
            if record_kept or record_support:
                del untruncated
            # The one host transfer per step: finished rows and the next decode batch are decided on the host.
            keep = []
            for i, (r, t) in enumerate(zip(rows, tokens.tolist())):
                completion_ids[r].append(t)
                if t in eos:
                    finished[r] = True
                else:
                    keep.append(i)
            if step + 1 == s.max_new_tokens or not keep:
                break
            if len(keep) < len(rows):
                # Drop finished rows everywhere so the next forward runs only on live ones.
                kept = torch.tensor(keep, device=device)
                cache.batch_select_indices(kept)
                tokens, positions, history = tokens[kept], positions[kept], history[kept]
                rows = [rows[i] for i in keep]
                mask.select(kept)
                if repetition is not None:
                    pad_lens = pad_lens[kept]
            if repetition is not None:
                history = torch.cat([history, tokens[:, None]], dim=1)
            self.last_stats["decode_batch_sizes"].append(len(rows))
            del scores
            if decode is full_forward:
                logits = decode(tokens[:, None], mask.extend(), positions[:, None], cache)  # (R, V)
            else:
                logits = decode(
                    tokens[:, None], mask.extend(), positions[:, None], cache, out=scratch.view(0, len(rows), vocab)
                )
            if routing_log is not None:
                routing_log.step(step, [r - row_offset for r in rows])
            if suppress:
                logits[:, suppress] = float("-inf")
            positions = positions + 1
        if logprobs is not None and step_logprobs:
            values = step_lps[:written].tolist()  # one transfer for the whole batch
            it = iter(values)
            for step_rows, _ in step_logprobs:
                for r in step_rows:
                    logprobs[r].append(next(it))
            if record_kept and kept_mass is not None:
                it = iter(step_kept[:written].tolist())
                for step_rows, _ in step_logprobs:
                    for r in step_rows:
                        kept_mass[r].append(next(it))
        if record_support and support is not None and step_support:
            entries = iter(sampling_mask_entries(step_ids[:described].cpu(), step_threshold[:described].cpu()))
            for step_rows, _ in step_support:
                for r in step_rows:
                    support[r].append(next(entries))
        if routing_log is not None:
            lengths = [len(completion_ids[row_offset + i]) for i in range(len(source))]
            for i, value in enumerate(routing_log.rows(lengths)):
                routing[1][row_offset + i] = value
        if step_tops and self.last_top_logprobs is not None:
            for step_rows, values, ids in step_tops:
                for r, vals, toks in zip(step_rows, values.tolist(), ids.tolist()):
                    self.last_top_logprobs[r].append(list(zip(toks, vals)))


# The shortest common prefix of a batch's distinct prompts worth prefilling once (tokens). Sharing it costs one more
# forward call (the prefix alone at batch 1, then every prompt's rest), whose per-layer call overhead outweighs the
# (U - 1) · S prefix tokens it saves when S is short: measured on `grpo_long`'s 2 prompts cut to an S-token common
# prefix (G = 8, 32 new tokens, one thread, `benchmarks/bench_prefix_prefill.py --prefix-tokens S`), the sampler's
# CPU time shared / full is 1.09 at S = 8 and 16 and 0.97 at S = 32 on the 4-layer `small` model; at S = 437 it is
# 0.87 there and 0.83 at the Qwen2.5-0.5B shape. A chat-template opening (≈ 14 tokens under the benchmarks'
# template) stays under it; a system prompt is over it. Below it the batch is prefilled as it always was, bit for bit.
SHARED_PREFIX_MIN_TOKENS = 32


def _shared_prefix_length(unique_ids: list[list[int]]) -> int:
    """The tokens all of ``unique_ids`` (≥ 2 distinct prompts) start with, at most the shortest prompt's length − 1
    (each prompt keeps ≥ 1 token: its last position's logits are the first sampled token's); 0 when fewer than
    ``SHARED_PREFIX_MIN_TOKENS`` or fewer than 2 prompts."""
    if len(unique_ids) < 2:
        return 0
    first, limit = unique_ids[0], min(len(ids) for ids in unique_ids) - 1
    n = 0
    while n < limit and all(ids[n] == first[n] for ids in unique_ids):
        n += 1
    return n if n >= SHARED_PREFIX_MIN_TOKENS else 0


def _may_share_prefix(model: Any) -> bool:
    """Whether the shared-prefix prefill gives the full prefill's results for ``model``.

    It leaves padding *between* the prefix and each prompt's rest. Full attention masks those slots by the 2-D mask
    whatever their place; a sliding or chunked window counts cache slots (the padding would shrink the window), and
    linear-attention or recurrent layers would fold the padding into their state, so those models, and PEFT prompt
    learning (virtual tokens prepended per forward), keep the full prefill.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        return False
    if not _full_attention_only(model.config):
        return False
    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _prefill_shared_prefix(
    model: Any,
    unique_ids: list[list[int]],
    prefix: int,
    pad_token_id: int,
    cache: Any,
    cache_kw: str,
    routing_log: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill the ``prefix`` tokens every prompt of ``unique_ids`` starts with once, then each prompt's rest.

    The prefix runs at batch 1 into ``cache``, which is then repeated to the U prompts; the rests run left-padded
    among themselves, with the 2-D mask ``[ones(S) | rest mask]`` and positions continuing from ``S`` over real tokens
    only, so every real token sees the keys, values and positions the full left-padded prefill would give it.

    Returns ``(logits (U, V) of each prompt's last token, attention_mask (U, S + R))``: the mask of the cache layout
    ``[prefix | padding | rest]`` that the decode steps extend. ``routing_log`` (a ``SampledRouting``) records both
    forwards' routing.
    """
    device = model_device(model)
    head = torch.tensor([unique_ids[0][:prefix]], dtype=torch.long, device=device)  # (1, S)
    _forward_last(
        model, head, torch.ones_like(head), torch.arange(prefix, device=device)[None], cache, cache_kw
    )  # its logits are not needed: every prompt goes on past the prefix
    if routing_log is not None:
        routing_log.prefill_prefix()
    cache.batch_repeat_interleave(len(unique_ids))
    rest_ids, rest_mask = left_pad([ids[prefix:] for ids in unique_ids], pad_token_id, device)  # (U, R)
    position_ids = prefix + (rest_mask.cumsum(-1) - 1).clamp(min=0)  # (U, R); pads' positions are masked
    attention_mask = torch.cat([rest_mask.new_ones((len(unique_ids), prefix)), rest_mask], dim=1)  # (U, S + R)
    logits = _forward_last(model, rest_ids, attention_mask, position_ids, cache, cache_kw)  # (U, V)
    if routing_log is not None:
        routing_log.prefill(len(unique_ids), rest_ids.shape[1], [len(ids) - prefix for ids in unique_ids])
    return logits, attention_mask


def _routing_recorder(model: Any) -> Any:
    """A :class:`~posttrain.models.moe_routing.RoutingRecorder` on ``model`` (``keep_routing``)."""
    from posttrain.models.moe_routing import RoutingRecorder

    return RoutingRecorder(model)


def logsumexp_rows(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(x, -1)`` for ``x`` ``(R, V)``, bit for bit, with ``scratch`` (like ``x``) as its one
    vocabulary-sized temporary: max, masked to 0 where infinite, then log Σ exp(x − max) + max."""
    top = torch.amax(x, dim=-1, keepdim=True)  # (R, 1)
    top.masked_fill_(top.abs() == float("inf"), 0.0)
    out = torch.sum(torch.sub(x, top, out=scratch).exp_(), dim=-1)
    return out.log_().add_(top.squeeze(-1))


class DecodeMask:
    """The decode steps' attention mask, preallocated for ``max_new_tokens`` and handed out as growing views.

    ``four_d=False``: a ``(R, P + max_new_tokens)`` 2-D padding mask (the model builds its 4-D mask from it at each
    step). ``four_d=True``: a ``(R, 1, 1, P + max_new_tokens)`` boolean mask used as is by SDPA (True = attend): for a
    single query token at the end of the sequence the causal constraint is void, so the padding mask *is* the 4-D
    mask, and the per-step mask construction is skipped.
    """

    def __init__(self, prompt_mask: torch.Tensor, max_new_tokens: int, four_d: bool):
        rows, width = prompt_mask.shape
        dtype = torch.bool if four_d else prompt_mask.dtype
        self.buffer = torch.ones((rows, width + max_new_tokens), dtype=dtype, device=prompt_mask.device)
        self.buffer[:, :width] = prompt_mask
        if four_d:
            self.buffer = self.buffer[:, None, None, :]  # (R, 1, 1, P + N)
        self.length = width

    def extend(self) -> torch.Tensor:
        """Mask covering one more position (the token about to be fed): ``(R, L)`` or ``(R, 1, 1, L)``."""
        self.length += 1
        return self.buffer[..., : self.length]

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the decode-batch rows ``keep`` ``(R',)``."""
        self.buffer = self.buffer[keep]


def _takes_boolean_4d_mask(model: Any) -> bool:
    """Whether decode steps may pass :class:`DecodeMask`'s boolean 4-D mask: SDPA, full attention in every layer.

    Eager attention adds the mask to the scores (needs a float mask), sliding-window or chunked layers need their
    own masks, and PEFT prompt learning extends the 2-D mask with its virtual tokens, so those keep the 2-D mask and
    the model's own construction.
    """
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        return False
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or not getattr(config, "is_causal", True):
        return False
    return _full_attention_only(config)


def _full_attention_only(config: Any) -> bool:
    """Whether every attention layer of ``config`` is full (causal) attention: no sliding-window or chunked layer."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return set(layer_types) <= {"full_attention"}
    return getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None


def _cache_kwarg(model: Any) -> str:
    """The forward's KV-cache argument name: ``cache`` (transformers ≥ 5.24) or ``past_key_values`` (older)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _forward_last(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
    cache_kw: str,
    **model_kwargs: Any,
) -> torch.Tensor:
    """One forward through ``cache``; returns the last position's logits as float32 ``(B, V)``.

    ``logits_to_keep=1`` keeps the prefill from materialising ``(B, T, V)`` logits. A MoE model set to output its
    router logits (for the training loss's aux term) is asked not to: sampling needs no load-balancing loss, and
    its computation assumes the attention mask covers only the new tokens.
    """
    extra = {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **{cache_kw: cache},
        **extra,
        **model_kwargs,
    )
    return out.logits[:, -1, :].float()
