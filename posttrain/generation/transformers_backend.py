"""The ``transformers`` generation backend: ``model.generate`` exactly as TRL calls it, plus shared helpers.

``TransformersBackend`` left-pads the prompts, repeats each one ``num_generations`` times, and calls
``model.generate`` with a ``GenerationConfig`` built from the ``SamplingConfig`` (``generation_kwargs`` merged last,
``disable_compile=True``), then cuts every completion after its first EOS. Sampling log-probs come from
``output_scores`` (transformers' *processed* scores, i.e. after repetition penalty/temperature/top-k/top-p/min-p).
Note that ``output_scores`` keeps one ``(B, V)`` float tensor per generated token until ``generate`` returns; with
large vocabularies set ``return_logprobs=False`` or use the ``posttrain`` backend (``GroupSampler``), which keeps
only the current step's scores.

The helpers ``left_pad`` and ``sampling_mode`` are shared with ``group_sampler``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.generation.base import Completions, SamplingConfig, truncate_at_eos
from posttrain.models.unwrap import model_device, unwrap_parallel


def left_pad(
    prompt_ids: list[list[int]], pad_token_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad id lists into ``input_ids`` and ``attention_mask``, both ``(B, T_max)`` long tensors.

    Raises ``ValueError`` naming the row when a prompt is empty (a causal LM needs at least one token to condition
    on).
    """
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token.")
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, width - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask[i, width - len(ids) :] = 1
    return input_ids.to(device), attention_mask.to(device)


@contextlib.contextmanager
def sampling_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model.eval()`` + ``torch.inference_mode()`` for the duration, then restore the training flag.

    Eval mode turns dropout off (the sampling distribution is the model's, not a dropped-out copy) and lets the
    KV cache work with gradient checkpointing enabled.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def generation_config_from_sampling(sampling: SamplingConfig, tokenizer: Any = None) -> Any:
    """The ``transformers.GenerationConfig`` TRL builds for ``model.generate`` (§B1.8).

    ``top_k`` 0/None is passed as 0 (off) because ``GenerationConfig`` would otherwise fall back to 50.
    ``generation_kwargs`` are merged last and override every other field.
    """
    from transformers import GenerationConfig

    tok = getattr(tokenizer, "tokenizer", tokenizer)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=sampling.max_new_tokens,
        do_sample=sampling.do_sample,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k or 0,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        cache_implementation=sampling.cache_implementation,
        pad_token_id=sampling.pad_token_id,
        bos_token_id=getattr(tok, "bos_token_id", None),
        eos_token_id=list(sampling.eos_token_ids),
        disable_compile=True,
    )
    kwargs.update(sampling.generation_kwargs or {})
    return GenerationConfig(**kwargs)


class TransformersBackend:
    """Generate with ``model.generate`` (TRL's default backend).

    Args:
        model: A causal LM (optionally PEFT-wrapped); DDP-style ``.module`` wrappers are stripped.
        tokenizer: Its tokenizer or processor (used for ``bos_token_id``).
        return_logprobs: Return per-token sampling log-probs (from ``output_scores``).
    """

    def __init__(self, model: Any, tokenizer: Any = None, return_logprobs: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.return_logprobs = return_logprobs

    def sync_weights(self, model: Any) -> None:
        """No-op: generation runs on the trainer's own model object."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        num_generations: int = 1,
        vision_inputs: list[dict[str, Any]] | None = None,
    ) -> Completions:
        """Sample ``num_generations`` completions per prompt; rows ordered ``[p0 g0, p0 g1, ..., p1 g0, ...]``.

        ``vision_inputs``: one dict of processor outputs per prompt (``pixel_values``, ...; ``{}`` for a text-only
        prompt), passed to ``model.generate`` for the repeated rows as TRL does; the image token is then never
        sampled (TRL's ``suppress_tokens``: a sampled one would not match the image features).
        """
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
        if not prompt_ids:
            return Completions([], [] if self.return_logprobs else None, [], [])
        s = sampling.resolved()  # generation_kwargs that name a field are applied (and validated) here
        model = unwrap_parallel(self.model)
        gen_config = generation_config_from_sampling(s, self.tokenizer)
        gen_config.return_dict_in_generate = True
        gen_config.output_scores = self.return_logprobs
        eos = set(s.eos_token_ids)
        rows = [list(p) for p in prompt_ids for _ in range(num_generations)]
        input_ids, attention_mask = left_pad(rows, s.pad_token_id, model_device(model))
        extra: dict[str, Any] = {}
        if vision_inputs is not None:
            extra = vision_generate_inputs(model, vision_inputs, num_generations, input_ids.shape[1])
            suppress = image_token_ids(model)
            if suppress:
                gen_config.suppress_tokens = sorted(set(gen_config.suppress_tokens or []) | set(suppress))
        with sampling_mode(model):
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=gen_config,
                **extra,
            )
        completion = out.sequences[:, input_ids.shape[1] :]  # (B, T)
        token_logprobs = None
        if self.return_logprobs:
            # scores[t] is (B, V), processed; log p = score[token] - logsumexp(scores).
            per_step = [
                (s.float().gather(-1, completion[:, t : t + 1]) - torch.logsumexp(s.float(), dim=-1, keepdim=True))
                for t, s in enumerate(out.scores)
            ]
            token_logprobs = torch.cat(per_step, dim=1).tolist()  # (B, T)
        ids_out, lps_out, finished = [], [] if self.return_logprobs else None, []
        for i, ids in enumerate(completion.tolist()):
            ids, done = truncate_at_eos(ids, eos)
            ids_out.append(ids)
            finished.append(done)
            if token_logprobs is not None:
                lps_out.append(token_logprobs[i][: len(ids)])
        return Completions(ids_out, lps_out, finished, rows)


def image_token_ids(model: Any) -> list[int]:
    """The vision-language model's image (and video) placeholder token ids, never to be sampled (TRL suppresses
    ``config.image_token_id``)."""
    config = getattr(unwrap_parallel(model), "config", None)
    ids = []
    for name in ("image_token_id", "image_token_index", "video_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= 0 and value not in ids:
            ids.append(value)
    return ids


def vision_generate_inputs(
    model: Any, vision_inputs: list[dict[str, Any]], num_generations: int, prompt_width: int
) -> dict[str, torch.Tensor]:
    """``model.generate``'s vision inputs for prompts repeated ``num_generations`` times each (the rows of
    ``left_pad``), on the model's device and floating dtype."""
    from posttrain.data.vision_prompts import collate_vision_inputs

    rows = [inputs for inputs in vision_inputs for _ in range(num_generations)]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return collate_vision_inputs(rows, prompt_width, 0, device=model_device(model), dtype=dtype)
