"""Adapter-only (LoRA) weight sync over loopback: the posttrain engine applies a pushed adapter to its base with PEFT,
generates what it generates after a merged push of the same policy, for a fraction of the bytes; refused adapters
change nothing; GRPO in server mode trains with it and logs ``perf/weight_sync_bytes``."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward
from transformers import AutoModelForCausalLM

from posttrain.generation.base import SamplingConfig
from posttrain.generation.client import GenerationClient
from posttrain.generation.vllm_server import VLLMServerBackend
from posttrain.generation.weights import ADAPTER_FORMAT, adapter_weights, payload_metadata, push_payload
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

EOS, PAD = 258, 259
PROMPTS = [list(b"hello there"), list(b"a"), list(b"the quick brown fox")]
SAMPLING = SamplingConfig(8, temperature=0.9, top_k=50, eos_token_ids=[EOS], pad_token_id=PAD)


def _peft_policy(path, r=4, target_modules=("q_proj", "v_proj"), seed=0):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                            LoraConfig(r=r, lora_alpha=8, target_modules=list(target_modules)))  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_" in name:  # a trained-looking adapter (lora_B starts at zero: no effect)
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return policy


def _generate(url, seed=5):
    backend = VLLMServerBackend(base_url=url, seed=seed)
    try:
        return backend.generate(PROMPTS, SAMPLING, 3)
    finally:
        backend.close()


def test_adapter_push_generates_as_merged_push_for_far_fewer_bytes(tiny_model_path):
    policy = _peft_policy(tiny_model_path)
    merged_engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    adapter_engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    with serve_in_thread(merged_engine) as merged_url, serve_in_thread(adapter_engine) as adapter_url:
        base_out = _generate(adapter_url)
        merged = VLLMServerBackend(base_url=merged_url)
        merged.sync_weights(policy)
        adapter = VLLMServerBackend(base_url=adapter_url, adapter_only=True)
        adapter.sync_weights(policy)
        assert adapter.version == 1 and adapter_engine.adapter_config["r"] == 4
        assert merged_engine.adapter_config is None
        # The tiny model is ~1 MB of weights; the r=4 adapter on q/v of 2 layers is a few KB.
        assert adapter.last_sync_bytes * 20 < merged.last_sync_bytes, (adapter.last_sync_bytes, merged.last_sync_bytes)
        want, got = _generate(merged_url), _generate(adapter_url)
        assert got.completion_ids == want.completion_ids and got.finished == want.finished
        for a, b in zip(got.logprobs, want.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
        assert got.completion_ids != base_out.completion_ids  # the adapter changed what is generated
        # A later push loads new adapter values into the same wrapped model (no second wrapping).
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.mul_(-1.0)
        merged.sync_weights(policy)
        adapter.sync_weights(policy)
        want, got = _generate(merged_url), _generate(adapter_url)
        assert got.completion_ids == want.completion_ids
        for a, b in zip(got.logprobs, want.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
        assert sum("lora_A" in n for n, _ in adapter_engine.model.named_parameters()) == 4  # 2 layers x q, v
        # A full push afterwards replaces the policy: the adapter is removed and the served weights are the base's.
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        adapter.adapter_only = False
        adapter.sync_weights(plain)
        assert adapter_engine.adapter_config is None
        assert _generate(adapter_url).completion_ids == base_out.completion_ids
        merged.close()
        adapter.close()


def test_payload_carries_the_lora_config_and_wire_names(tiny_model_path):
    import json

    from posttrain.generation.weights import deserialize

    policy = _peft_policy(tiny_model_path)
    with push_payload(policy, adapter_only=True) as chunks:
        chunks = list(chunks)
    meta = payload_metadata(chunks[0])
    assert meta["format"] == ADAPTER_FORMAT
    config = json.loads(meta["adapter_config"])
    assert config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    names = sorted(deserialize(chunks[0]))
    assert names[0] == "model.layers.0.self_attn.q_proj.lora_A.weight" and len(names) == 8
    # The trainer's base weights never leave it, and its adapter is untouched (no merge).
    assert not any(n.endswith("q_proj.weight") for n in names)
    assert not policy.base_model.model.model.layers[0].self_attn.q_proj.merged


def test_refused_adapter_push_changes_nothing(tiny_model_path):
    from posttrain.generation.weights import serialize_chunks

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    policy = _peft_policy(tiny_model_path)
    with serve_in_thread(engine) as url, GenerationClient(url, request_timeout=60) as client:
        before = _generate(url)
        with adapter_weights(policy) as (meta, items):
            tensors = dict(items)
        # Incomplete: one LoRA tensor missing.
        partial = dict(tensors)
        partial.pop("model.layers.1.self_attn.v_proj.lora_B.weight")
        with pytest.raises(Exception, match=r"lacks 1 of the adapter's 8 LoRA tensors"):
            client.load_weights(serialize_chunks(partial, metadata=meta))
        # Wrong shape (another rank than the config says).
        bad = dict(tensors)
        bad["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(3, 64)
        with pytest.raises(Exception, match=r"q_proj.lora_A.weight.*shape"):
            client.load_weights(serialize_chunks(bad, metadata=meta))
        assert engine.adapter_config is None and client.health()["version"] == 0
        assert _generate(url).completion_ids == before.completion_ids
        # Chunks of one update may not mix adapter and full weights.
        chunks = list(serialize_chunks(tensors, chunk_bytes=1024, metadata=meta))
        plain = list(serialize_chunks({"model.norm.weight": engine.model.model.norm.weight.detach()}))
        with pytest.raises(Exception, match=r"adapter config differs"):
            client.load_weights([chunks[0], plain[0]])
        assert engine.adapter_config is None


def test_adapter_only_needs_a_peft_lora_policy(tiny_model_path):
    from posttrain.generation.weights import adapter_config_dict

    with pytest.raises(ValueError, match="needs a PEFT"):
        adapter_config_dict(AutoModelForCausalLM.from_pretrained(tiny_model_path))
    from peft import LoraConfig, get_peft_model

    pissa = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                           LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights="pissa"))  # fmt: skip
    with pytest.raises(ValueError, match="rewrites the base weights"):
        adapter_config_dict(pissa)


@pytest.mark.slow
def test_grpo_server_mode_lora_adapter_only(tiny_model_path, tmp_path):
    """GRPO with a LoRA policy in server mode, adapter-only sync: two steps train, every push is the adapter (the
    logged ``perf/weight_sync_bytes`` is a small fraction of the model), and the server ends up serving the
    trainer's adapter."""
    from peft import LoraConfig

    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    full_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    with serve_in_thread(engine) as url:
        args = GRPOConfig(
            output_dir=str(tmp_path), report_to="none", save_strategy="no", logging_steps=1,
            gradient_checkpointing=False, write_report=False, disable_tqdm=True, per_device_train_batch_size=4,
            num_generations=2, max_completion_length=6, max_steps=2, learning_rate=5e-2, seed=7,
            use_vllm=True, vllm_mode="server", vllm_server_base_url=url, steps_per_generation=1,
            vllm_sync_adapter_only=True, vllm_weight_sync_probe=True, vllm_weight_sync_probe_atol=1e-3,
        )  # fmt: skip
        trainer = GRPOTrainer(tiny_model_path, varied_reward, args,
                              train_dataset=Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)]),
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # fmt: skip
        trainer.train()
        assert trainer.backend.version == 2 and engine.adapter_config is not None
        logged = [e["perf/weight_sync_bytes"] for e in trainer.state.log_history if "perf/weight_sync_bytes" in e]
        assert logged and all(0 < b * 20 < full_bytes for b in logged), (logged, full_bytes)


def test_new_adapter_config_rewraps_and_matches_merged(tiny_model_path):
    """A push with another LoRA config (another trainer run: r=2 on the MLP) replaces the served adapter (unload,
    wrap again) and serves what a merged push of that policy serves."""
    merged_engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    adapter_engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    with serve_in_thread(merged_engine) as merged_url, serve_in_thread(adapter_engine) as adapter_url:
        merged = VLLMServerBackend(base_url=merged_url)
        adapter = VLLMServerBackend(base_url=adapter_url, adapter_only=True)
        for policy in (_peft_policy(tiny_model_path), _peft_policy(tiny_model_path, r=2, target_modules=("up_proj",),
                                                                   seed=1)):  # fmt: skip
            merged.sync_weights(policy)
            adapter.sync_weights(policy)
            want, got = _generate(merged_url), _generate(adapter_url)
            assert got.completion_ids == want.completion_ids
            for a, b in zip(got.logprobs, want.logprobs):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
        assert adapter_engine.adapter_config["r"] == 2
        names = [n for n, _ in adapter_engine.model.named_parameters() if "lora_" in n]
        assert names and all("up_proj" in n for n in names)  # the r=4 q/v adapter is gone
        merged.close()
        adapter.close()


def test_vllm_engine_refuses_adapter_pushes_and_other_servers_fall_back(tiny_model_path, caplog):
    """An engine without ``load_adapter`` (the vLLM engine) answers 400 to an adapter payload and keeps serving;
    against vLLM / ``trl vllm-serve`` protocols the client falls back to the merged push with one warning."""
    import logging

    from posttrain.generation.weights import serialize_chunks

    class NoAdapters:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            if name == "load_adapter":
                raise AttributeError(name)
            return getattr(self._inner, name)

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    policy = _peft_policy(tiny_model_path)
    with serve_in_thread(NoAdapters(engine)) as url, GenerationClient(url, request_timeout=60) as client:
        with adapter_weights(policy) as (meta, items):
            chunks = list(serialize_chunks(items, metadata=meta))
        with pytest.raises(Exception, match=r"does not apply adapter-only.*vllm_sync_adapter_only=False"):
            client.load_weights(chunks)
        assert client.health()["version"] == 0 and engine.adapter_config is None
        backend = VLLMServerBackend(base_url=url, protocol="trl", adapter_only=True)
        with caplog.at_level(logging.WARNING, logger="posttrain.generation.vllm_server"):
            assert backend.use_adapter_sync(policy) is False
            assert backend.use_adapter_sync(policy) is False
        assert sum("pushing the merged weights instead" in r.getMessage() for r in caplog.records) == 1
        backend.close()


def test_modules_to_save_are_pushed_as_full_base_weights(tiny_model_path):
    """``modules_to_save`` copies (here the final norm) go with the adapter under the base names; the served model
    then generates as after a merged push."""
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                            LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["norm"]))  # fmt: skip
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    with adapter_weights(policy) as (_, items):
        names = [n for n, _ in items]
    assert "model.norm.weight" in names and sum("lora_" in n for n in names) == 4
    merged_engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    adapter_engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    with serve_in_thread(merged_engine) as merged_url, serve_in_thread(adapter_engine) as adapter_url:
        for backend in (VLLMServerBackend(base_url=merged_url), VLLMServerBackend(base_url=adapter_url,
                                                                                 adapter_only=True)):  # fmt: skip
            backend.sync_weights(policy)
            backend.close()
        want, got = _generate(merged_url), _generate(adapter_url)
    assert got.completion_ids == want.completion_ids
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
