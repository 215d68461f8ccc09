"""get_backend: lazy name table, callables and instances, clear vLLM errors."""

from __future__ import annotations

import importlib.util

import pytest

from posttrain.generation import (
    DEFAULT_BACKEND,
    GroupSampler,
    RolloutFuncBackend,
    TransformersBackend,
    backend_names,
    get_backend,
)


def test_names_and_default(llama, tokenizer):
    assert backend_names() == ["posttrain", "rollout_func", "transformers", "vllm_colocate", "vllm_server"]
    assert DEFAULT_BACKEND == "posttrain"
    sampler = get_backend(model=llama, tokenizer=tokenizer, max_batch_tokens=1000, return_logprobs=False)
    assert isinstance(sampler, GroupSampler) and sampler.max_batch_tokens == 1000 and not sampler.return_logprobs
    backend = get_backend("transformers", llama, tokenizer)
    assert isinstance(backend, TransformersBackend) and backend.model is llama


def test_rollout_func_entry(tokenizer):
    def rollout(prompts, trainer):
        return {}

    backend = get_backend("rollout_func", None, tokenizer, rollout_func=rollout, trainer="T")
    assert isinstance(backend, RolloutFuncBackend) and backend.rollout_func is rollout and backend.trainer == "T"
    assert backend.tokenizer is tokenizer


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="Unknown generation backend 'vlm'. Valid names: posttrain, rollout_func"):
        get_backend("vlm")


def test_callables_and_instances_pass_through(llama, tokenizer):
    sampler = GroupSampler(llama)
    assert get_backend(sampler) is sampler
    built = get_backend(TransformersBackend, llama, tokenizer, return_logprobs=False)
    assert isinstance(built, TransformersBackend) and not built.return_logprobs


def test_vllm_colocate_fails_clearly_without_vllm_or_gpu(monkeypatch):
    real_find_spec = importlib.util.find_spec
    if real_find_spec("vllm") is None:
        with pytest.raises(ImportError, match=r"pip install posttrain\[vllm\]"):
            get_backend("vllm_colocate")
    # Pretend vLLM is installed: on a machine without CUDA the error says a GPU is required.
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RuntimeError, match="requires a CUDA GPU"):
        get_backend("vllm_colocate")
