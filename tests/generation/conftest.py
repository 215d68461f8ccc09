"""Fixtures for the generation tests (helpers live in ``generation_helpers``)."""

from __future__ import annotations

import pytest
from generation_helpers import EOS, PAD, make_model

from posttrain.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def llama(tokenizer):
    """Sharpened tiny llama whose greedy completions of ``prompts`` end with EOS after 11-21 tokens (or not)."""
    return make_model(tokenizer, "llama", eos_bias=1.0)


@pytest.fixture(scope="session")
def qwen(tokenizer):
    return make_model(tokenizer, "qwen2", eos_bias=1.0)


@pytest.fixture()
def prompts() -> list[list[int]]:
    """Byte prompts of different lengths (1-25 tokens), so batches are left-padded."""
    return [list(b"hello there"), list(b"a"), list(b"the quick brown fox jumps"), list(b"zz"),
            list(b"Question: 2+2?"), list(b"xyz")]  # fmt: skip


@pytest.fixture()
def greedy():
    from posttrain.generation import SamplingConfig

    return SamplingConfig(24, do_sample=False, eos_token_ids=[EOS], pad_token_id=PAD)
