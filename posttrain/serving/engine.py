"""Generation engines behind ``posttrain serve``: a request in backend-neutral terms, sequences out.

``GenerationRequest`` is what ``/v1/completions`` (and TRL's ``/generate/``) asks for, already validated and with
token-id prompts. An engine implements ``check(request)`` (raise ``RequestError`` naming the field it cannot serve),
``generate(request) -> [[GeneratedSequence] * n per prompt]``, ``load_weights({name: tensor})`` and the attributes
``name``, ``model_name``, ``max_model_len``, ``world_size``; optionally ``weight_specs() -> {name: (shape, dtype)}``
(the server then checks pushed names and shapes before staging; without it, dtypes and finiteness only), and
optionally ``load_adapter(lora_config, {name: tensor})`` for adapter-only (LoRA) pushes. Engines are called from one worker thread at a time
(the server serialises requests and weight loads), so they need no locking of their own.

``PosttrainEngine`` is posttrain's group sampler (``GroupSampler``: one prefill per prompt, its KV cache expanded
``n`` ways, finished rows dropped) on a transformers model. A request with a ``seed`` samples from a fresh
``torch.Generator`` seeded with it, so the same request on the same weights returns the same tokens (and equals
in-process sampling with ``GroupSampler(generator=torch.Generator().manual_seed(seed))``); without a seed the
engine's own generator (seeded once at start-up with ``--seed``) is used. ``VLLMEngine`` (``vllm_engine.py``) wraps
vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve; ``param`` names the offending field (the server answers 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class GenerationRequest:
    """What to generate, in vLLM ``SamplingParams`` terms (``top_k`` 0 and ``min_p`` 0 = off).

    ``stop_token_ids`` end a completion in addition to the tokenizer's EOS (unless ``ignore_eos``); the stop token is
    kept as the completion's last token, as vLLM's ``token_ids`` keep it. ``top_logprobs`` (with ``logprobs``) asks
    for each step's most likely tokens too (vLLM's ``logprobs=N``). ``structured_outputs_regex`` and ``extra``
    (more ``SamplingParams`` fields) are served by the vLLM engine only. ``return_sampling_mask`` (posttrain's
    extension, ``keep_sampling_mask``) asks the posttrain engine for each token's kept support under top-k / top-p /
    min-p (at most 16 ids or one float per token); the vLLM engine returns none. ``return_routing`` (posttrain's
    extension, ``keep_routing``) asks the posttrain engine to record a mixture-of-experts model's top-k experts per
    router layer for every prompt and completion token (``GeneratedSequence.routing``); a dense model, an image
    prompt on a multimodal-RoPE model and the vLLM engine refuse it (400 naming ``return_routing``).
    """

    prompts: list[list[int]]
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = True
    top_logprobs: int = 0
    seed: int | None = None
    return_sampling_mask: bool = False
    return_routing: bool = False
    structured_outputs_regex: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Per prompt, its decoded images (vLLM's ``multi_modal_data["image"]``; ``None`` / ``[]`` = a text prompt); the
    # prompt ids already hold the processor's expanded image tokens, as vLLM's token prompts do.
    images: list[list[Any] | None] | None = None


@dataclass
class GeneratedSequence:
    """One completion: its ids (stop token kept), per-token processed sampling log-probs, why it ended, and (when
    asked) each step's top log-probs as ``(token id, log-prob)`` pairs by decreasing log-prob."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length"
    stop_reason: int | None = None  # the stop_token_id that ended it (None for EOS / length), as vLLM
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # per token, log of the mass top-k / top-p / min-p kept (None: nothing truncated); processed log-prob + this =
    # the log-prob under the untruncated distribution, for the trainer's importance ratio (TRL 1.17's correction)
    log_kept_mass: list[float] | None = None
    # per token, the kept support (``Completions.sampling_mask``: ids, a threshold or None), when asked and truncated
    sampling_mask: list[Any] | None = None
    # with ``return_routing``: the MoE routing of the ``[prompt | completion]`` tokens, ``(P + C, L, k)`` stored as
    # ``expert + 1`` (0 = not recorded: the completion's last token), as ``Completions.routing`` holds it in-process
    routing: torch.Tensor | None = None


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class PosttrainEngine:
    """posttrain's group sampler on a transformers causal LM (see the module docstring).

    Args:
        model: The causal LM (put in eval mode; dropout off).
        tokenizer: Its tokenizer (EOS id, decoding for the ``text`` field).
        model_name: The name the server reports (``/v1/models``) and accepts in the ``model`` field.
        seed: Seed of the engine's own generator (requests without a ``seed``).
        max_batch_tokens: ``GroupSampler``'s KV budget per batch (``None`` = one batch per request).
    """

    name = "posttrain"
    world_size = 1

    def __init__(
        self, model: Any, tokenizer: Any, model_name: str = "model", seed: int = 0, max_batch_tokens: int | None = None
    ):
        from posttrain.models.unwrap import model_device

        self.model = model.eval()
        self.adapter_config: dict[str, Any] | None = None  # the LoRA config of adapter-only pushes (load_adapter)
        self._adapter_specs_cache: dict[str, Any] = {}
        # A vision-language model is served with its processor (``tokenizer`` may be one): images are rebuilt into
        # the model's vision inputs with its image processor (see ``vision_inputs``).
        self.processor = tokenizer if getattr(tokenizer, "image_processor", None) is not None else None
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_batch_tokens = max_batch_tokens
        self.device = model_device(model)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "get_text_config"):  # a VLM's text sizes live in its text config
            config = config.get_text_config()
        self.text_config = config
        self.max_model_len = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        eos = getattr(tok, "eos_token_id", None)
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = getattr(tok, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids or [0])[0])

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        *,
        dtype: str = "auto",
        device: str | None = "auto",
        seed: int = 0,
        revision: str | None = None,
        trust_remote_code: bool = False,
        max_batch_tokens: int | None = None,
        served_model_name: str | None = None,
    ) -> PosttrainEngine:
        """Load ``model`` (a local path or hub id) and its tokenizer with transformers; a vision-language model
        (a config with ``vision_config``) with ``AutoModelForImageTextToText`` and its processor."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if revision is not None:
            kwargs["revision"] = revision
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        if getattr(AutoConfig.from_pretrained(model, **kwargs), "vision_config", None) is not None:
            from transformers import AutoModelForImageTextToText, AutoProcessor

            import posttrain.models.image_only_processors  # noqa: F401  (image-only Qwen2-VL processors load)

            lm = AutoModelForImageTextToText.from_pretrained(model, dtype=torch_dtype, **kwargs)
            tokenizer = AutoProcessor.from_pretrained(model, **kwargs)
        else:
            lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(model, **kwargs)
        lm = lm.to(resolve_device(device))
        return cls(lm, tokenizer, served_model_name or model, seed=seed, max_batch_tokens=max_batch_tokens)

    def tokenize(self, text: str) -> list[int]:
        tok = getattr(self.tokenizer, "tokenizer", self.tokenizer) if self.processor is not None else self.tokenizer
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _image_token_ids(self) -> set[int]:
        ids = {getattr(self.processor, "image_token_id", None), getattr(self.model.config, "image_token_id", None),
               getattr(self.model.config, "image_token_index", None)}  # fmt: skip
        return {int(i) for i in ids if isinstance(i, int)}

    def check_images(self, request: GenerationRequest) -> None:
        """Raise ``RequestError`` (param ``multi_modal_data``) for images this engine cannot serve: a text-only model
        or one served without an image processor, or a prompt whose image tokens and images disagree."""
        if not request.images or not any(request.images):
            image_tokens = self._image_token_ids() if self.processor is not None else set()
            for i, ids in enumerate(request.prompts):
                if image_tokens and any(t in image_tokens for t in ids):
                    raise RequestError(
                        "multi_modal_data",
                        f"prompt[{i}] has image tokens {sorted(image_tokens)} in its prompt ids but no images: send "
                        "the prompt as {\"prompt_token_ids\": [...], \"multi_modal_data\": {\"image\": [...]}}.",
                    )
            return
        if len(request.images) != len(request.prompts):
            raise RequestError("multi_modal_data", "multi_modal_data must be given per prompt (one entry each).")
        if self.processor is None or getattr(self.model.config, "vision_config", None) is None:
            raise RequestError(
                "multi_modal_data",
                f"The served model {self.model_name!r} is a text-only model (or was served without an image "
                "processor): it cannot read multi_modal_data images. Serve a vision-language model with its processor, "
                "or send token prompts without images.",
            )
        image_tokens = self._image_token_ids()
        for i, (ids, images) in enumerate(zip(request.prompts, request.images)):
            has_tokens = bool(image_tokens) and any(t in image_tokens for t in ids)
            if images and image_tokens and not has_tokens:
                raise RequestError(
                    "multi_modal_data",
                    f"prompt[{i}] has {len(images)} image(s) in multi_modal_data but no image token "
                    f"{sorted(image_tokens)} in its prompt_token_ids: send the ids the processor made from the chat "
                    "template with the images (image placeholders expanded).",
                )
            if not images and has_tokens:
                raise RequestError(
                    "multi_modal_data",
                    f"prompt[{i}] has image tokens {sorted(image_tokens)} in its prompt_token_ids but no images in "
                    "multi_modal_data.image.",
                )

    def vision_inputs(self, ids: list[int], images: list[Any] | None) -> dict[str, torch.Tensor]:
        """One prompt's vision inputs as the trainer's ``encode_vision_prompts`` makes them: the processor's
        image-level outputs (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ``pixel_attention_mask``, ...;
        the image processor run on the decoded images) and the per-token ``token_type_ids`` /
        ``mm_token_type_ids`` (1 on image tokens) where the processor's model inputs have them; ``{}`` without
        images."""
        from posttrain.data.vision_prompts import PER_TOKEN_VISION_KEYS

        if not images:
            return {}
        names = set(getattr(self.processor, "model_input_names", None) or [])
        processed = self.processor.image_processor(list(images), return_tensors="pt")
        out = {k: v for k, v in processed.items() if isinstance(v, torch.Tensor) and (not names or k in names)}
        image_tokens = self._image_token_ids()
        for key in PER_TOKEN_VISION_KEYS:
            if key in names:
                out[key] = torch.tensor([1 if t in image_tokens else 0 for t in ids], dtype=torch.long)
        return out

    def check(self, request: GenerationRequest) -> None:
        """Raise ``RequestError`` for what this engine cannot serve."""
        self.check_images(request)
        if request.return_routing:
            self.check_routing(request)
        if request.structured_outputs_regex is not None:
            raise RequestError(
                "structured_outputs",
                "structured_outputs (regex-constrained decoding) needs the vLLM engine: start the server with "
                "--backend vllm.",
            )
        if request.extra:
            raise RequestError(
                sorted(request.extra)[0],
                f"Unsupported sampling parameter(s) {sorted(request.extra)} for the posttrain backend, which serves "
                "n, max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, "
                "logprobs and seed.",
            )
        for i, ids in enumerate(request.prompts):
            vocab = self.text_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError("prompt", f"prompt[{i}] has token ids outside the vocabulary [0, {vocab}): {bad[:5]}.")
            if self.max_model_len is not None and len(ids) + request.max_tokens > self.max_model_len:
                raise RequestError(
                    "max_tokens",
                    f"prompt[{i}] has {len(ids)} tokens and max_tokens is {request.max_tokens}: together more than "
                    f"the model's context length {self.max_model_len}.",
                )

    def check_routing(self, request: GenerationRequest) -> None:
        """``return_routing`` (keep_routing) needs a mixture-of-experts model whose prompts the group sampler
        decodes itself: ``RequestError`` naming ``return_routing`` otherwise."""
        from posttrain.models.moe_routing import find_routers

        if not find_routers(self.model):
            raise RequestError(
                "return_routing",
                f"return_routing=true records the expert routing of a mixture-of-experts model, but the served model "
                f"{self.model_name!r} ({type(self.model).__name__}) has no MoE router (Qwen2-MoE, Qwen3-MoE, Mixtral "
                "...). Serve a MoE model, or train with keep_routing=False (do not send return_routing).",
            )
        if request.images and any(request.images) and self._uses_mrope():
            raise RequestError(
                "return_routing",
                "return_routing=true: prompts with images on a multimodal-RoPE model are sampled with "
                "model.generate, which records no MoE routing. Send text prompts, or set keep_routing=False.",
            )

    def _uses_mrope(self) -> bool:
        """Whether image prompts go through ``model.generate`` (multimodal RoPE: an ``image_grid_thw`` input)."""
        names = set(getattr(self.processor, "model_input_names", None) or [])
        return "image_grid_thw" in names

    def generate(self, request: GenerationRequest) -> list[list[GeneratedSequence]]:
        from posttrain.generation.base import SamplingConfig
        from posttrain.generation.group_sampler import GroupSampler

        greedy = request.temperature == 0
        stops = list(request.stop_token_ids)
        eos = ([] if request.ignore_eos else list(self.eos_token_ids)) + [t for t in stops if t not in self.eos_token_ids]
        sampling = SamplingConfig(
            max_new_tokens=request.max_tokens,
            temperature=1.0 if greedy else request.temperature,
            top_p=request.top_p,
            top_k=max(request.top_k, 0),
            min_p=request.min_p or None,
            repetition_penalty=request.repetition_penalty,
            do_sample=not greedy,
            # -1 matches no token: with ignore_eos and no stop ids a completion runs to max_tokens.
            eos_token_ids=eos or [-1],
            pad_token_id=self.pad_token_id,
            return_sampling_mask=request.return_sampling_mask and request.logprobs,
        )
        generator = self.generator
        if request.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
        sampler = GroupSampler(
            self.model, return_logprobs=request.logprobs, max_batch_tokens=self.max_batch_tokens, generator=generator,
            top_logprobs=request.top_logprobs if request.logprobs else 0, record_routing=request.return_routing,
        )  # fmt: skip
        vision = None
        if request.images and any(request.images):
            vision = [self.vision_inputs(ids, images) for ids, images in zip(request.prompts, request.images)]
        out = sampler.generate(request.prompts, sampling, request.n, vision_inputs=vision)
        stop_set = set(stops)
        results: list[list[GeneratedSequence]] = []
        for p in range(len(request.prompts)):
            group = []
            for j in range(request.n):
                r = p * request.n + j
                ids = out.completion_ids[r]
                stop_reason = ids[-1] if out.finished[r] and ids and ids[-1] in stop_set else None
                group.append(
                    GeneratedSequence(
                        ids,
                        out.logprobs[r] if out.logprobs is not None else None,
                        "stop" if out.finished[r] else "length",
                        stop_reason,
                        sampler.last_top_logprobs[r] if sampler.last_top_logprobs is not None else None,
                        out.log_kept_mass[r] if out.log_kept_mass is not None else None,
                        out.sampling_mask[r] if out.sampling_mask is not None else None,
                        out.routing[r] if out.routing is not None else None,
                    )
                )
            results.append(group)
        return results

    @torch.no_grad()
    def score_sequences(
        self, sequences: list[list[int]], prompt_lengths: list[int], top_logprobs: int = 1, temperature: float = 1.0
    ) -> dict[str, list]:
        """Teacher log-probs of given sequences (TRL's ``get_sequence_logprobs``): for each completion token
        (positions ``prompt_length..``) the log-prob of the actual token and the ``top_logprobs`` most likely tokens
        with their log-probs, under ``softmax(logits / temperature)``.

        Returns ``{"logprobs": [(C_i, K)], "logprob_token_ids": [(C_i, K)], "actual_logprobs": [(C_i, 1)]}`` as
        nested lists (sorted by decreasing log-prob within each position).
        """
        vocab = self.text_config.vocab_size
        if top_logprobs < 0:
            raise RequestError("top_logprobs", f"top_logprobs must be >= 0, got {top_logprobs}.")
        if not temperature > 0:
            raise RequestError("temperature", f"temperature must be > 0, got {temperature}.")
        if len(prompt_lengths) != len(sequences):
            raise RequestError("prompt_lengths", "prompt_lengths must have one entry per sequence.")
        for i, (ids, p) in enumerate(zip(sequences, prompt_lengths)):
            if not 1 <= p <= len(ids):
                raise RequestError("prompt_lengths", f"prompt_lengths[{i}]={p} must lie in [1, {len(ids)}].")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError("sequences", f"sequences[{i}] has token ids outside [0, {vocab}): {bad[:5]}.")
            if self.max_model_len is not None and len(ids) > self.max_model_len:
                raise RequestError(
                    "sequences",
                    f"sequences[{i}] has {len(ids)} tokens, more than the model's context length {self.max_model_len}.",
                )
        out: dict[str, list] = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": []}
        if not sequences:
            return out
        width = max(len(ids) for ids in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(sequences):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        logits = self.model(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), use_cache=False
        ).logits
        k = min(top_logprobs, logits.shape[-1])
        for i, (ids, p) in enumerate(zip(sequences, prompt_lengths)):
            log_probs = torch.log_softmax(logits[i, p - 1 : len(ids) - 1].float() / temperature, dim=-1)  # (C, V)
            targets = torch.tensor(ids[p:], dtype=torch.long, device=log_probs.device)
            actual = log_probs.gather(-1, targets[:, None])
            top = log_probs.topk(k, dim=-1) if k > 0 else None
            out["actual_logprobs"].append(actual.tolist())
            out["logprobs"].append(top.values.tolist() if top is not None else [[] for _ in ids[p:]])
            out["logprob_token_ids"].append(top.indices.tolist() if top is not None else [[] for _ in ids[p:]])
        return out

    # -- weights ----------------------------------------------------------------------------------------------
    def _base_targets(self) -> dict[str, torch.Tensor]:
        """The base model's parameters and buffers under their checkpoint names (tied aliases included), also while
        the model is wrapped with a pushed LoRA adapter (``.base_layer`` dropped, LoRA tensors left out)."""
        from posttrain.generation.weights import clean_param_name

        named = list(self.model.named_parameters(remove_duplicate=False)) + list(self.model.named_buffers())
        if self.adapter_config is None:
            return dict(named)
        targets = {}
        for name, tensor in named:
            clean = clean_param_name(name)
            if clean is not None:
                targets[clean] = tensor
        return targets

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` a weight update may write: the server checks every staged chunk against it."""
        return {n: (tuple(t.shape), t.dtype) for n, t in self._base_targets().items()}

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        """Copy a verified update into the model (everything is checked again before anything is copied). A full
        push after adapter-only pushes replaces the policy: the adapter is removed (PEFT ``unload``) first."""
        from posttrain.generation.weights import check_tensors

        check_tensors(tensors, self.weight_specs())
        if self.adapter_config is not None:
            self.model = self.model.unload().eval()
            self.adapter_config = None
            logger.info("A full weight push replaced the LoRA adapter: the adapter is removed.")
        targets = self._base_targets()
        with torch.no_grad():
            for name, tensor in tensors.items():
                targets[name].copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
        return len(tensors)

    def _adapter_specs(self, kwargs: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The LoRA tensors (wire names, shapes, dtypes) the adapter of ``kwargs`` has on this model, found on a
        meta-device skeleton so that a refused adapter changes nothing."""
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from posttrain.generation.weights import adapter_wire_name

        key = repr(sorted(kwargs.items()))
        if self._adapter_specs_cache.get("key") != key:
            base = self.model.get_base_model() if self.adapter_config is not None else self.model
            with torch.device("meta"):  # the served class itself (a VLM or remote-code model too), no memory
                build = getattr(type(base), "_from_config", None)
                skeleton = build(base.config) if build is not None else AutoModelForCausalLM.from_config(base.config)
                skeleton = get_peft_model(skeleton, LoraConfig(**kwargs))
            specs = {}
            for name, param in skeleton.named_parameters():
                wire = adapter_wire_name(name, "default") if "lora_" in name else None
                if wire is not None:
                    specs[wire] = (tuple(param.shape), param.dtype)
            self._adapter_specs_cache = {"key": key, "specs": specs}
        return self._adapter_specs_cache["specs"]

    def load_adapter(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
        """Apply an adapter-only push: wrap the base with the pushed LoRA config (the first push, or a changed
        config), then copy the adapter tensors (and any ``modules_to_save`` weights, under base names) into it.

        Generation then runs base + adapter through PEFT (unmerged), which equals generating with the merged
        weights up to float rounding. Every tensor is checked (names, shapes, dtypes, finite values, and that the
        adapter is complete) before anything changes; a refused push leaves the previous adapter serving.
        """
        from peft import LoraConfig, get_peft_model

        from posttrain.generation.weights import (
            WeightUpdateError,
            adapter_wire_name,
            check_tensors,
            server_lora_kwargs,
        )

        kwargs = server_lora_kwargs(config)
        lora = {n: t for n, t in tensors.items() if ".lora_" in n or n.startswith("lora_")}
        base = {n: t for n, t in tensors.items() if n not in lora}
        specs = self._adapter_specs(kwargs)
        check_tensors(lora, specs)
        missing = sorted(set(specs) - set(lora))
        if missing:
            raise WeightUpdateError(
                f"The adapter push lacks {len(missing)} of the adapter's {len(specs)} LoRA tensors (first: "
                f"{missing[0]!r}); an adapter-only push must send the whole adapter.",
                missing[0],
            )
        check_tensors(base, self.weight_specs())
        if self.adapter_config != kwargs:
            model = self.model.unload() if self.adapter_config is not None else self.model
            self.model = get_peft_model(model, LoraConfig(**kwargs)).eval()
            self.adapter_config = kwargs
            logger.info("Serving a LoRA adapter (r=%s, target_modules=%s) on the base model.", kwargs.get("r"),
                        kwargs.get("target_modules"))  # fmt: skip
        params = {}
        for name, param in self.model.named_parameters():
            wire = adapter_wire_name(name, "default") if "lora_" in name else None
            if wire is not None:
                params[wire] = param
        targets = self._base_targets()
        with torch.no_grad():
            for name, tensor in lora.items():
                params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))
            for name, tensor in base.items():
                targets[name].copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
        return len(tensors)

    def reset_prefix_cache(self) -> None:
        """No-op: the group sampler keeps no cache between requests."""

    def close(self) -> None:
        """Nothing to release."""
