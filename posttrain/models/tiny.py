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


def build_tiny_vlm(seed: int = 0, image_size: int = 16, patch_size: int = 8):
    """Random tiny LLaVA (CLIP vision tower + Qwen2 text model) and its ``LlavaProcessor``; ``(model, processor)``.

    The processor pairs a ``CLIPImageProcessor`` (images resized and cropped to ``image_size``) with the byte-level
    tokenizer plus a special ``<image>`` token, which the processor expands to ``(image_size / patch_size)²`` image
    tokens (4 by default), and carries :data:`VLM_CHAT_TEMPLATE`. Offline, deterministic from ``seed``.
    """
    import torch
    import transformers
    from tokenizers import AddedToken
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, Qwen2Config

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True)
    # Without torchvision, CLIPImageProcessor falls back (with a warning) to the PIL backend: use it directly.
    image_processor_cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    image_processor = image_processor_cls(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",  # drop CLIP's CLS feature...
        num_additional_image_tokens=1,  # ...which the processor counts here
        chat_template=VLM_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )
    vision_config = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=image_size,
        patch_size=patch_size, projection_dim=32,
    )  # fmt: skip
    text_config = Qwen2Config(
        vocab_size=((len(tokenizer) + 63) // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        use_sliding_window=False,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_index=tokenizer.convert_tokens_to_ids(
            IMAGE_TOKEN), vision_feature_select_strategy="default", vision_feature_layer=-1,
        projector_hidden_act="gelu", tie_word_embeddings=True,
    )  # fmt: skip
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    finally:
        torch.random.set_rng_state(rng_state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model, processor


def save_tiny_vlm(output_dir: str | os.PathLike, **kwargs) -> str:
    """Build the tiny LLaVA and ``save_pretrained`` it with its processor into ``output_dir``; returns the path."""
    model, processor = build_tiny_vlm(**kwargs)
    output_dir = str(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    return output_dir
