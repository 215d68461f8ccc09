"""PreallocatedLayer: the group sampler's cache gives bitwise the same completions and log-probs as DynamicLayer."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import EOS, PAD
from transformers.cache_utils import DynamicLayer

import posttrain.generation.kv_cache as kv_cache
from posttrain.generation import GroupSampler, SamplingConfig
from posttrain.generation.kv_cache import PreallocatedLayer


def _pair(reserve: int = 3):
    return DynamicLayer(), PreallocatedLayer(reserve)


def _kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def test_layer_operations_match_dynamic_layer():
    """Prefill, decode past the reserve (buffers grow), expand, drop rows, crop: identical keys/values."""
    plain, prealloc = _pair(reserve=2)
    steps = [("update", _kv(2, 5, 0)), ("update", _kv(2, 1, 1)), ("repeat", 3), ("update", _kv(6, 1, 2)),
             ("update", _kv(6, 1, 3)), ("select", torch.tensor([0, 2, 5])), ("update", _kv(3, 1, 4)),
             ("crop", -2), ("update", _kv(3, 2, 5))]  # fmt: skip
    for op, arg in steps:
        for layer in (plain, prealloc):
            if op == "update":
                out = layer.update(*arg)
            elif op == "repeat":
                layer.batch_repeat_interleave(arg)
            elif op == "select":
                layer.batch_select_indices(arg)
            else:
                layer.crop(arg)
        assert prealloc.get_seq_length() == plain.get_seq_length()
        assert torch.equal(prealloc.keys, plain.keys) and torch.equal(prealloc.values, plain.values)
        if op == "update":
            assert torch.equal(out[0], plain.keys)
    assert prealloc._keys.shape[-2] >= prealloc.get_seq_length()
    prealloc.reset()
    assert prealloc.get_seq_length() == 0 and not prealloc.is_initialized


@pytest.mark.parametrize("do_sample", [False, True])
def test_sampler_output_is_unchanged(llama, prompts, do_sample, monkeypatch):
    sampling = SamplingConfig(24, do_sample=do_sample, repetition_penalty=1.2, eos_token_ids=[EOS], pad_token_id=PAD)
    outs = []
    for prealloc in (True, False):
        if not prealloc:
            monkeypatch.setattr(kv_cache, "preallocate_cache", lambda cache, reserve: cache)
        sampler = GroupSampler(llama, generator=torch.Generator().manual_seed(3))
        outs.append(sampler.generate(prompts, sampling, num_generations=3))
    assert outs[0].completion_ids == outs[1].completion_ids
    assert outs[0].logprobs == outs[1].logprobs
    assert any(outs[0].finished) and not all(outs[0].finished)  # rows were dropped mid-generation
