"""Bytes per weight update, full (merged) push vs LoRA adapter-only push (``vllm_sync_adapter_only``).

For the tiny test model the payloads are serialized exactly as a push sends them (``push_payload``: safetensors
chunks, headers included). For real model shapes (Qwen2.5-0.5B / 1.5B / 7B configs, written here, nothing is
downloaded) the model is built on the meta device and the payload size is the tensors' bytes (what a push sends, less
a header of a few KB): the full push is every parameter in the model's dtype (tied embeddings once), the adapter push
the LoRA A/B matrices (float32, as PEFT keeps them).

Run: ``python benchmarks/bench_weight_sync_bytes.py [--r 16] [--targets q_proj,k_proj,v_proj,o_proj]``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocab, tied)
    "Qwen2.5-0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "Qwen2.5-1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "Qwen2.5-7B": (3584, 18944, 28, 28, 4, 152064, False),
}


def _peft(model: torch.nn.Module, r: int, targets: list[str]) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))


def tiny(r: int, targets: list[str]) -> dict[str, int]:
    from transformers import AutoModelForCausalLM

    from posttrain.generation.weights import push_payload
    from posttrain.models.tiny import save_tiny_model

    with tempfile.TemporaryDirectory() as path:
        save_tiny_model(path)
        policy = _peft(AutoModelForCausalLM.from_pretrained(path), r, targets)
    out = {}
    for name, adapter_only in (("full", False), ("adapter", True)):
        with push_payload(policy, adapter_only=adapter_only) as chunks:
            out[name] = sum(len(c) for c in chunks)
    return out


def shaped(name: str, r: int, targets: list[str]) -> dict[str, int]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from posttrain.generation.weights import adapter_weights, policy_weights

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[name]
    config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         tie_word_embeddings=tied, torch_dtype="bfloat16")  # fmt: skip
    with torch.device("meta"):
        policy = _peft(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), r, targets)
    with policy_weights(policy) as items:
        full = sum(t.numel() * t.element_size() for _, t in items)
    with adapter_weights(policy) as (_, items):
        adapter = sum(t.numel() * t.element_size() for _, t in items)
    return {"full": full, "adapter": adapter}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    args = parser.parse_args()
    targets = args.targets.split(",")
    print(f"LoRA r={args.r} on {targets}")
    print(f"{'model':<14} {'full push':>14} {'adapter push':>14} {'ratio':>8}")
    rows = [("tiny (exact)", tiny(args.r, targets))] + [(n, shaped(n, args.r, targets)) for n in SHAPES]
    for name, sizes in rows:
        print(f"{name:<14} {sizes['full']:>14,} {sizes['adapter']:>14,} {sizes['full'] / sizes['adapter']:>7.0f}x")


if __name__ == "__main__":
    main()
