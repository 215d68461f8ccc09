"""Offline tiny models and a byte-level tokenizer, built locally in seconds.

Tests, examples, benchmarks and the demo use these instead of hub checkpoints: no network is needed, everything is
deterministic from a seed, and the result is saved with ``save_pretrained`` so trainers load it by path exactly as
they would load a hub id.

The tokenizer maps each UTF-8 byte to one token (ids 0-255), then adds ChatML special tokens and reasoning/tool
tags. Its chat template is ChatML with ``{% generation %}`` markers (assistant-only masks) and tool-call support.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# Reasoning and tool tags are added tokens but not "special": decoding with skip_special_tokens keeps them, as with
# Qwen's tokenizers, so format rewards can see them.
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
BIG_VOCAB_SIZE = 151_936  # Qwen2.5's embedding rows

_TEMPLATE_PATH = Path(__file__).resolve().parent.parent / "data" / "templates" / "chatml_training.jinja"


def chatml_template() -> str:
    """The ChatML chat template (with generation markers and tools) used by the tiny tokenizer."""
    return _TEMPLATE_PATH.read_text()


def build_tiny_tokenizer(padding_side: Literal["left", "right"] = "right"):
    """Build the byte-level ``PreTrainedTokenizerFast`` with ChatML specials and chat template.

    Byte ids are 0-255; ``<|endoftext|>`` = 256, ``<|im_start|>`` = 257, ``<|im_end|>`` = 258 (EOS),
    ``<|pad|>`` = 259, then the reasoning/tool tags.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()  # 256 printable stand-ins for the 256 byte values
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        padding_side=padding_side,
        model_max_length=4096,
    )
    fast.chat_template = chatml_template()
    return fast


# Merges of the second tiny tokenizer (a different vocabulary for cross-tokenizer distillation tests).
MERGED_PAIRS = [("a", "b"), ("c", "a"), ("b", "c"), ("ab", "c"), ("Q", "1"), ("x", "y")]


def build_tiny_merged_tokenizer(padding_side: Literal["left", "right"] = "right"):
    """A second offline tokenizer whose vocabulary differs from :func:`build_tiny_tokenizer`'s: the same specials
    first (ids 0-3: ``<|pad|>``, ``<|im_start|>``, ``<|im_end|>`` (EOS), ``<|endoftext|>``), then the 256 bytes
    shifted to ids 4-259, then BPE merges (``ab``, ``ca``, ``bc``, ``abc``, ``Q1``, ``xy``) at ids 260-265 — so
    "abcabc" is two tokens here and six there, and byte ``b`` has id ``b + 4``. Same ChatML template.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = _bytes_to_unicode()
    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({byte_to_char[b]: b + len(specials) for b in range(256)})
    for left, right in MERGED_PAIRS:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGED_PAIRS), fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])  # ids 0-3
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        padding_side=padding_side,
        model_max_length=4096,
    )
    fast.chat_template = chatml_template()
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-unicode table (the ByteLevel pre-tokenizer's alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def build_tiny_model(
    arch: Literal["qwen2", "llama"] = "qwen2",
    task: Literal["causal-lm", "sequence-classification"] = "causal-lm",
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    tokenizer=None,
):
    """Random-initialised tiny model, deterministic from ``seed``.

    Args:
        arch: ``"qwen2"`` or ``"llama"``.
        task: ``"causal-lm"`` or ``"sequence-classification"`` (one label, for reward models).
        vocab_size: Embedding rows; defaults to the tokenizer's size rounded up to 64. Use ``BIG_VOCAB_SIZE``
            (151 936) to measure memory as with real Qwen-sized vocabularies.
        tie_word_embeddings: Defaults to ``True`` for qwen2 (as Qwen2.5-0.5B) and ``False`` for llama.
    """
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
    )

    tokenizer = tokenizer or build_tiny_tokenizer()
    n_tok = len(tokenizer)
    vocab_size = vocab_size or ((n_tok + 63) // 64) * 64
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({n_tok} tokens).")
    if tie_word_embeddings is None:
        tie_word_embeddings = arch == "qwen2"
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        num_labels=1,
    )
    classes = {
        ("qwen2", "causal-lm"): (Qwen2Config, Qwen2ForCausalLM),
        ("qwen2", "sequence-classification"): (Qwen2Config, Qwen2ForSequenceClassification),
        ("llama", "causal-lm"): (LlamaConfig, LlamaForCausalLM),
        ("llama", "sequence-classification"): (LlamaConfig, LlamaForSequenceClassification),
    }
    if (arch, task) not in classes:
        raise ValueError(f"Unknown tiny model {arch!r}/{task!r}. Valid: {sorted(classes)}.")
    config_cls, model_cls = classes[(arch, task)]
    config = config_cls(**common)
    if arch == "qwen2":
        config.use_sliding_window = False
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config)
    finally:
        torch.random.set_rng_state(rng_state)
    gen_config = getattr(model, "generation_config", None)
    if gen_config is not None:
        gen_config.pad_token_id = tokenizer.pad_token_id
        gen_config.eos_token_id = tokenizer.eos_token_id
        gen_config.bos_token_id = None
    return model


def save_tiny_model(
    output_dir: str | os.PathLike,
    arch: Literal["qwen2", "llama"] = "qwen2",
    task: Literal["causal-lm", "sequence-classification"] = "causal-lm",
    **model_kwargs,
) -> str:
    """Build a tiny model and its tokenizer and ``save_pretrained`` both into ``output_dir``; returns the path."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(arch, task, tokenizer=tokenizer, **model_kwargs)
    output_dir = str(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral")


def build_tiny_moe_model(
    arch: Literal["qwen2_moe", "qwen3_moe", "mixtral"] = "qwen3_moe",
    *,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    expert_intermediate_size: int | None = None,
    output_router_logits: bool = False,
    router_spread: float | None = None,
    seed: int = 0,
    tokenizer=None,
):
    """Random-initialised tiny mixture-of-experts causal LM (every layer sparse), deterministic from ``seed``.

    Args:
        arch: ``"qwen2_moe"`` (with its shared expert; ``norm_topk_prob=False`` as Qwen1.5-MoE), ``"qwen3_moe"``
            (``norm_topk_prob=True``) or ``"mixtral"`` (always renormalised; no router jitter).
        num_experts: Routed experts per layer; ``num_experts_per_tok``: top-k.
        expert_intermediate_size: Each expert's MLP width (default ``hidden_size``).
        output_router_logits: The config flag that makes the forward return the load-balancing aux loss.
        router_spread: Near-tied routers on purpose: every expert's router row is set to one shared row plus
            Gaussian noise of this standard deviation (e.g. ``1e-7``; the rows are ~0.02). The router logits are
            then nearly tied, and the sampler's KV-cache decode and the training forward route some tokens to
            different experts — the mismatch routing replay (``keep_routing``) removes. None: random routers.
    """
    import torch
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if arch not in MOE_ARCHS:
        raise ValueError(f"Unknown tiny MoE model {arch!r}. Valid: {list(MOE_ARCHS)}.")
    tokenizer = tokenizer or build_tiny_tokenizer()
    width = expert_intermediate_size or hidden_size
    common = dict(
        vocab_size=((len(tokenizer) + 63) // 64) * 64,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        num_experts_per_tok=num_experts_per_tok,
        output_router_logits=output_router_logits,
        router_aux_loss_coef=0.001,
    )
    if arch == "mixtral":
        config = MixtralConfig(
            **common, num_local_experts=num_experts, intermediate_size=width, router_jitter_noise=0.0
        )
        model_cls = MixtralForCausalLM
    else:
        qwen = dict(
            num_experts=num_experts,
            moe_intermediate_size=width,
            intermediate_size=2 * hidden_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
        )
        if arch == "qwen2_moe":
            config = Qwen2MoeConfig(**common, **qwen, shared_expert_intermediate_size=width, norm_topk_prob=False)
            model_cls = Qwen2MoeForCausalLM
        else:
            config = Qwen3MoeConfig(**common, **qwen, norm_topk_prob=True)
            model_cls = Qwen3MoeForCausalLM
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config)
        if router_spread is not None:
            with torch.no_grad():
                for module in model.modules():
                    if "Router" in type(module).__name__:
                        shared = module.weight[0].clone()  # (H,)
                        module.weight.copy_(shared + router_spread * torch.randn_like(module.weight))
    finally:
        torch.random.set_rng_state(rng_state)
    gen_config = getattr(model, "generation_config", None)
    if gen_config is not None:
        gen_config.pad_token_id = tokenizer.pad_token_id
        gen_config.eos_token_id = tokenizer.eos_token_id
        gen_config.bos_token_id = None
    return model


IMAGE_TOKEN = "<image>"
# ChatML whose list contents render each {"type": "image"} block as one <image> placeholder (the processor expands it
# to one token per image patch) and each {"type": "text"} block as its text.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for block in message['content'] %}"
    "{% if block['type'] == 'image' %}<image>{% elif block['type'] == 'text' %}{{ block['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


VLM_FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "llava_next", "gemma3", "idefics3")


def vlm_chat_template(image_text: str = IMAGE_TOKEN) -> str:
    """:data:`VLM_CHAT_TEMPLATE` with each ``{"type": "image"}`` block rendered as ``image_text`` (the family's
    placeholder, which its processor expands)."""
    return VLM_CHAT_TEMPLATE.replace("<image>", image_text)


def build_tiny_vlm(seed: int = 0, image_size: int = 16, patch_size: int = 8, family: str = "llava"):
    """A random tiny vision-language model of ``family`` and its processor; ``(model, processor)``.

    ``family`` is one of :data:`VLM_FAMILIES`: ``"llava"`` (the default: CLIP vision tower + Qwen2 text model,
    ``LlavaProcessor``), ``"qwen2_vl"`` / ``"qwen2_5_vl"`` (flattened patches with ``image_grid_thw``, multimodal RoPE,
    per-token ``mm_token_type_ids``; processed by :mod:`posttrain.models.image_only_processors`' image-only
    processors, because transformers' Qwen2-VL processors require a torchvision video processor), ``"llava_next"``
    (any-resolution tiles with ``image_sizes``), ``"gemma3"`` (SigLIP + Gemma 3, ``token_type_ids``) and
    ``"idefics3"`` (SmolVLM's architecture: SigLIP-like encoder, pixel shuffle, ``pixel_attention_mask``). Each
    processor pairs the family's PIL image processor with the byte-level tokenizer plus the family's image tokens and
    carries a ChatML chat template whose image blocks render as the family's placeholder. Offline, deterministic from
    ``seed``; ``image_size`` / ``patch_size`` apply to the CLIP-based LLaVA families.
    """
    builders = {
        "llava": _tiny_llava,
        "llava_next": _tiny_llava_next,
        "qwen2_vl": _tiny_qwen2_vl,
        "qwen2_5_vl": _tiny_qwen2_vl,
        "gemma3": _tiny_gemma3,
        "idefics3": _tiny_idefics3,
    }
    if family not in builders:
        raise ValueError(f"family={family!r} is not a tiny VLM family; choose one of {', '.join(VLM_FAMILIES)}.")
    import torch

    kwargs = {"image_size": image_size, "patch_size": patch_size} if family.startswith("llava") else {}
    if family.startswith("qwen"):
        kwargs["version"] = family
    config_fn, processor = builders[family](**kwargs)
    tokenizer = processor.tokenizer
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = config_fn()
    finally:
        torch.random.set_rng_state(rng_state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model, processor


def _tokenizer_with(tokens: list[str]):
    from tokenizers import AddedToken

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens], special_tokens=True)
    return tokenizer


def _vocab(tokenizer) -> int:
    return ((len(tokenizer) + 63) // 64) * 64


def _qwen2_text(tokenizer, **extra) -> dict:
    return dict(
        vocab_size=_vocab(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        use_sliding_window=False, **extra,
    )  # fmt: skip


def _clip_image_processor(image_processor_cls_name: str, image_size: int, **kwargs):
    import transformers

    # Without torchvision, the image processors fall back (with a warning) to the PIL backend: use it directly.
    cls = getattr(transformers, f"{image_processor_cls_name}Pil", None) or getattr(
        transformers, image_processor_cls_name
    )
    return cls(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}, **kwargs)


def _clip_vision(image_size: int, patch_size: int):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=image_size,
        patch_size=patch_size, projection_dim=32,
    )  # fmt: skip


def _tiny_llava(image_size: int, patch_size: int):
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, Qwen2Config

    tokenizer = _tokenizer_with([IMAGE_TOKEN])
    processor = LlavaProcessor(
        image_processor=_clip_image_processor("CLIPImageProcessor", image_size),
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",  # drop CLIP's CLS feature...
        num_additional_image_tokens=1,  # ...which the processor counts here
        chat_template=VLM_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )
    config = LlavaConfig(
        vision_config=_clip_vision(image_size, patch_size), text_config=Qwen2Config(**_qwen2_text(tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_select_strategy="default",
        vision_feature_layer=-1, projector_hidden_act="gelu", tie_word_embeddings=True,
    )  # fmt: skip
    return (lambda: LlavaForConditionalGeneration(config)), processor


def _tiny_llava_next(image_size: int, patch_size: int):
    """LLaVA-NeXT: each image becomes a base tile plus the any-resolution grid it fits best (``image_sizes``)."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor, Qwen2Config

    tokenizer = _tokenizer_with([IMAGE_TOKEN])
    pinpoints = [[image_size, image_size], [image_size, 2 * image_size], [2 * image_size, image_size]]
    processor = LlavaNextProcessor(
        image_processor=_clip_image_processor("LlavaNextImageProcessor", image_size, image_grid_pinpoints=pinpoints),
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=VLM_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )
    config = LlavaNextConfig(
        vision_config=_clip_vision(image_size, patch_size), text_config=Qwen2Config(**_qwen2_text(tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_select_strategy="default",
        vision_feature_layer=-1, image_grid_pinpoints=pinpoints, tie_word_embeddings=True,
    )  # fmt: skip
    return (lambda: LlavaNextForConditionalGeneration(config)), processor


def _tiny_qwen2_vl(version: str = "qwen2_vl"):
    """Qwen2-VL / Qwen2.5-VL: 4-pixel patches merged 2x2, images resized to 64-256 pixels."""
    import transformers

    from posttrain.models.image_only_processors import ImageOnlyQwen2_5_VLProcessor, ImageOnlyQwen2VLProcessor

    names = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
    tokenizer = _tokenizer_with(list(names))
    ids = dict(zip(names, tokenizer.convert_tokens_to_ids(list(names))))
    text = _qwen2_text(tokenizer, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    text["max_position_embeddings"] = 512
    if version == "qwen2_5_vl":
        vision = dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=8, fullatt_block_indexes=[0],
        )  # fmt: skip
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        processor_cls = ImageOnlyQwen2_5_VLProcessor
    else:
        vision = dict(
            depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
            temporal_patch_size=2, in_chans=3,
        )  # fmt: skip
        config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        processor_cls = ImageOnlyQwen2VLProcessor
    config = config_cls(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
    )  # fmt: skip
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=64, max_pixels=256, patch_size=4, merge_size=2, temporal_patch_size=2
    )
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=vlm_chat_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )
    return (lambda: model_cls(config)), processor


def _tiny_gemma3():
    """Gemma 3: a SigLIP tower pooled to 4 soft tokens per 16-pixel image, ``token_type_ids`` marking them."""
    import transformers

    names = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    from transformers import PreTrainedTokenizerFast

    base = _tokenizer_with(names)
    # Gemma3Processor reads the named tokens tokenizer.boi_token / image_token / eoi_token (saved with the tokenizer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, bos_token=None, eos_token=base.eos_token, pad_token=base.pad_token,
        unk_token=None, padding_side=base.padding_side, model_max_length=base.model_max_length,
        extra_special_tokens={"boi_token": names[0], "image_token": names[1], "eoi_token": names[2]},
    )  # fmt: skip
    tokenizer.chat_template = base.chat_template
    ids = dict(zip(names, tokenizer.convert_tokens_to_ids(names)))
    text = transformers.Gemma3TextConfig(
        vocab_size=_vocab(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids[names[0]],
        eoi_token_index=ids[names[2]], image_token_index=ids[names[1]], tie_word_embeddings=True,
    )  # fmt: skip
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
        chat_template=vlm_chat_template(names[0]),
    )  # fmt: skip

    def build():
        import torch

        model = transformers.Gemma3ForConditionalGeneration(config)
        # transformers initialises Gemma 3's input projection to zeros (a checkpoint brings learnt weights): with it
        # every image embeds to 0 and a random tiny model could never see its images. Draw it like other weights.
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=text.initializer_range)
        return model

    return build, processor


def _tiny_idefics3():
    """Idefics3 (SmolVLM's architecture): 16-pixel images, 4-pixel patches, pixel shuffle by 2 -> 4 tokens each."""
    import transformers

    tokenizer = _tokenizer_with(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"])
    text = transformers.LlamaConfig(
        vocab_size=_vocab(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    vision = transformers.Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
    )
    config = transformers.Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=True,
    )  # fmt: skip
    image_processor = transformers.Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 16}, max_image_size={"longest_edge": 16}
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=VLM_CHAT_TEMPLATE
    )
    return (lambda: transformers.Idefics3ForConditionalGeneration(config)), processor


def save_tiny_vlm(output_dir: str | os.PathLike, **kwargs) -> str:
    """Build a tiny VLM (:func:`build_tiny_vlm`'s arguments, ``family="llava"`` by default) and ``save_pretrained``
    it with its processor into ``output_dir``; returns the path."""
    model, processor = build_tiny_vlm(**kwargs)
    output_dir = str(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    return output_dir
