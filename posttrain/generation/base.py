"""The generation protocol shared by every backend: sampling settings in, completions out.

``SamplingConfig`` holds what to sample (TRL's ``GRPOConfig`` generation fields, already resolved to token ids),
``Completions`` holds what came back (unpadded ids, per-token sampling log-probs, whether each completion ended with
EOS), and ``GenerationBackend`` is the two-method protocol the online-RL pipeline talks to. This module imports
neither torch nor transformers, so the pipeline can type against it for free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# generation_kwargs keys that override a SamplingConfig field (GenerationConfig / vLLM SamplingParams spelling
# on the left). Anything else stays in ``SamplingConfig.extra_generation_kwargs()`` for the backend to handle.
_KWARG_TO_FIELD = {
    "max_new_tokens": "max_new_tokens",
    "max_tokens": "max_new_tokens",  # vLLM SamplingParams spelling
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "do_sample": "do_sample",
    "eos_token_id": "eos_token_ids",
    "pad_token_id": "pad_token_id",
    "cache_implementation": "cache_implementation",
}


@dataclass
class SamplingConfig:
    """What to sample, in backend-neutral terms (TRL's ``GRPOConfig`` generation fields).

    Args:
        max_new_tokens: Most tokens generated per completion (TRL's ``max_completion_length``).
        temperature: Logits are divided by it before top-k/top-p/min-p; must be > 0 when sampling.
        top_p: Nucleus sampling mass; 1.0 = off.
        top_k: Keep the ``top_k`` most likely tokens; ``0`` or ``None`` = off (note: transformers'
            ``GenerationConfig`` would otherwise default to 50, so backends pass 0 explicitly).
        min_p: Drop tokens whose probability is below ``min_p`` times the top token's; ``None`` = off.
        repetition_penalty: CTRL-style penalty on every token already in the prompt or completion; 1.0 = off.
        do_sample: ``False`` = greedy decoding (temperature/top-k/top-p/min-p are then not applied).
        eos_token_ids: Token ids that end a completion (the EOS is kept as the completion's last token).
        pad_token_id: Id used to left-pad prompts.
        generation_kwargs: Extra generation arguments merged last; they override the fields above (keys such as
            ``temperature`` or ``max_new_tokens`` replace the field, others go to the backend as is).
        cache_implementation: transformers ``generate`` cache implementation (``None`` = dynamic).
        return_sampling_mask: Also return each token's kept support under top-k / top-p / min-p
            (``Completions.sampling_mask``; the ``keep_sampling_mask`` config field). Backends that cannot describe
            it (vLLM, ``transformers``) return none, which the trainer treats as the full softmax.
        return_routing: Ask a ``posttrain serve`` server to record a mixture-of-experts model's routing
            (``Completions.routing``; the ``keep_routing`` config field in server mode). The in-process group
            sampler records it when built with ``record_routing=True``; other backends cannot and refuse it.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    do_sample: bool = True
    # Required, keyword-only: a wrong default EOS/pad id would silently produce wrong completions.
    eos_token_ids: list[int] = field(kw_only=True)
    pad_token_id: int = field(kw_only=True)
    generation_kwargs: dict[str, Any] | None = None
    cache_implementation: str | None = None
    return_sampling_mask: bool = False
    return_routing: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_ids, int):
            self.eos_token_ids = [self.eos_token_ids]
        self.eos_token_ids = [int(t) for t in (self.eos_token_ids or [])]

    @classmethod
    def from_args(cls, args: Any, tokenizer: Any) -> SamplingConfig:
        """Build from a TRL-style config (``GRPOConfig``/``RLOOConfig``/...) and its tokenizer or processor.

        Reads ``max_completion_length`` (default 512), ``temperature``, ``top_p``, ``top_k``, ``min_p``,
        ``repetition_penalty``, ``generation_kwargs`` and ``cache_implementation`` with TRL's defaults when the
        attribute is missing. EOS is the tokenizer's ``eos_token_id``; the pad id is its ``pad_token_id`` (falling
        back to EOS, as TRL sets ``pad_token = eos_token`` for tokenizers without one).
        """
        tok = getattr(tokenizer, "tokenizer", tokenizer)  # multimodal processors wrap the tokenizer
        eos = getattr(tok, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = getattr(tok, "pad_token_id", None)
        if pad is None:
            if not eos_ids:
                raise ValueError(
                    "The tokenizer has neither a pad_token_id nor an eos_token_id; set tokenizer.pad_token (and "
                    "tokenizer.eos_token) before building the sampling config."
                )
            pad = eos_ids[0]
        top_k = getattr(args, "top_k", 0)
        return cls(
            max_new_tokens=int(getattr(args, "max_completion_length", 512)),
            temperature=float(getattr(args, "temperature", 1.0)),
            top_p=float(getattr(args, "top_p", 1.0)),
            top_k=0 if top_k is None else int(top_k),
            min_p=getattr(args, "min_p", None),
            repetition_penalty=float(getattr(args, "repetition_penalty", 1.0)),
            do_sample=True,
            eos_token_ids=eos_ids,
            pad_token_id=int(pad),
            generation_kwargs=dict(getattr(args, "generation_kwargs", None) or {}) or None,
            cache_implementation=getattr(args, "cache_implementation", None),
            return_sampling_mask=bool(getattr(args, "keep_sampling_mask", False)),
            return_routing=bool(getattr(args, "keep_routing", False)),
        )

    def resolved(self) -> SamplingConfig:
        """A copy with the ``generation_kwargs`` that name a field applied to that field (they win).

        The returned copy keeps only the remaining keys in ``generation_kwargs``, and is validated.
        """
        kwargs = dict(self.generation_kwargs or {})
        updates: dict[str, Any] = {}
        for key in list(kwargs):
            if key in _KWARG_TO_FIELD:
                updates[_KWARG_TO_FIELD[key]] = kwargs.pop(key)
        out = dataclasses.replace(self, **updates, generation_kwargs=kwargs or None)
        out.validate()
        return out

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending option when a value cannot be sampled with."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens (max_completion_length) must be a positive integer, got {self.max_new_tokens!r}."
            )
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 when sampling, got {self.temperature!r}; for greedy decoding set "
                "do_sample=False (e.g. generation_kwargs={'do_sample': False})."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}; use 1.0 to disable nucleus sampling.")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}; use 0 to disable top-k.")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p!r}.")
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}; use 1.0 to disable it."
            )
        if not self.eos_token_ids:
            raise ValueError(
                "eos_token_ids is empty: completions could never finish. Give the tokenizer an eos_token or pass "
                "generation_kwargs={'eos_token_id': [...]}."
            )


@dataclass
class Completions:
    """Completions for ``len(prompt_ids)`` rows, ordered ``[p0 g0, p0 g1, ..., p1 g0, ...]``.

    Args:
        completion_ids: Unpadded generated ids per row, cut after the first EOS (the EOS is kept).
        logprobs: Per generated token, its log-probability under the *sampling* distribution, i.e. after
            repetition penalty, temperature, top-k, top-p and min-p (vLLM's ``processed_logprobs``); ``None``
            when the backend was asked not to return them.
        finished: Whether each completion ended with an EOS (``False`` = truncated at ``max_new_tokens``).
        prompt_ids: The (unpadded) prompt ids of each row, repeated per generation.
        extra: Per-row extra fields (e.g. a ``rollout_func``'s ``env_mask`` or reward kwargs), each a list of
            length ``len(completion_ids)``.
        log_kept_mass: Per generated token, log S: the log of the probability mass that top-k / top-p / min-p
            kept at that step (0.0 where nothing was truncated), so that ``logprobs + log_kept_mass`` is the token's
            log-prob under the untruncated distribution the trainer computes. ``None`` when the backend did not
            truncate or cannot report it (vLLM, ``rollout_func``): the importance ratio then uses ``logprobs`` as is.
        routing: MoE routing replay (``keep_routing``: the group sampler, in-process or behind ``posttrain serve``): per row, the top-k experts of each
            ``[prompt | completion]`` token at each router layer, ``(prompt + completion tokens, L, k)`` integer
            tensors storing ``expert + 1`` (0 = not recorded, e.g. the completion's last token, never fed back);
            see :mod:`posttrain.models.moe_routing`. ``None`` when not recorded.
        sampling_mask: With ``SamplingConfig.return_sampling_mask``, per generated token the kept support of its
            step (:mod:`posttrain.core.sampling_mask`): a list of at most 16 kept ids, a float score threshold
            (keep z ≥ τ, z the logits / temperature), or None (unknown: the full softmax). ``None`` (the whole
            field) when nothing truncated or the backend cannot describe it.
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    finished: list[bool]
    prompt_ids: list[list[int]]
    extra: dict[str, list] = field(default_factory=dict)
    log_kept_mass: list[list[float]] | None = None
    routing: list[Any] | None = None
    sampling_mask: list[list[Any]] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        checks = {"finished": self.finished, "prompt_ids": self.prompt_ids, **self.extra}
        if self.logprobs is not None:
            checks["logprobs"] = self.logprobs
        if self.log_kept_mass is not None:
            checks["log_kept_mass"] = self.log_kept_mass
        if self.routing is not None:
            checks["routing"] = self.routing
        if self.sampling_mask is not None:
            checks["sampling_mask"] = self.sampling_mask
        for name, values in checks.items():
            if len(values) != n:
                raise ValueError(f"Completions.{name} has {len(values)} rows but completion_ids has {n}.")

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_tokens(self) -> int:
        """Total generated tokens."""
        return sum(len(c) for c in self.completion_ids)


@runtime_checkable
class GenerationBackend(Protocol):
    """What the online-RL pipeline needs from a generator."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, num_generations: int = 1) -> Completions:
        """Return ``len(prompt_ids) * num_generations`` completions ordered ``[p0 g0, p0 g1, ..., p1 g0, ...]``."""
        ...

    def sync_weights(self, model: Any) -> None:
        """Load the trainer's current weights (a no-op for backends that run the trainer's model in-process)."""
        ...


def truncate_at_eos(ids: list[int], eos_token_ids: set[int] | list[int]) -> tuple[list[int], bool]:
    """Cut ``ids`` after its first EOS (kept); returns ``(ids, ended_with_eos)``."""
    eos = eos_token_ids if isinstance(eos_token_ids, set) else set(eos_token_ids)
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1], True
    return ids, False
