"""release_freed_host_memory: glibc's malloc_trim gives freed heap pages back, a no-op elsewhere, and the group
sampler calls it after its first generate on CPU."""

from __future__ import annotations

import platform
import sys

import torch
from generation_helpers import EOS, PAD

import posttrain.generation.group_sampler as gs
from posttrain.generation import GroupSampler, SamplingConfig, host_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_freed_fragmented_heap_pages_go_back_to_the_os():
    if not GLIBC:  # nothing to trim with: the call says so (the glibc path is what CI's Linux runs)
        assert host_memory.release_freed_host_memory() is False
        return
    keep, freed = [], []
    for i in range(2000):  # 100 KB blocks: below glibc's mmap threshold, so they live in the heap
        (keep if i % 10 == 0 else freed).append(torch.ones(25_000))
    del freed  # ~170 MiB free, pinned in the heap by the survivors between them
    before = _rss_mib()
    assert host_memory.release_freed_host_memory()
    assert before - _rss_mib() > 100
    del keep


def test_no_op_without_glibc(monkeypatch):
    host_memory._malloc_trim.cache_clear()
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("musl", ""))
    try:
        assert host_memory.release_freed_host_memory() is False
    finally:
        host_memory._malloc_trim.cache_clear()


def test_group_sampler_trims_after_its_first_generate_only(llama, prompts, monkeypatch):
    calls = []
    monkeypatch.setattr(gs, "release_freed_host_memory", lambda: calls.append(1))
    sampling = SamplingConfig(8, eos_token_ids=[EOS], pad_token_id=PAD)
    sampler = GroupSampler(llama, max_batch_tokens=64)
    sampler.generate(prompts, sampling, num_generations=2)
    assert calls == [1]  # once, after all batches of the call
    sampler.generate(prompts, sampling, num_generations=2)
    assert calls == [1]  # later generations reuse the freed heap blocks
