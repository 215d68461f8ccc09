"""Fixtures for the agent tests (the scripted policy lives in ``agent_helpers``)."""

from __future__ import annotations

import pytest

from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_causal_lm():
    """One tiny Qwen2 model shared by the scripted policies (its weights are never changed by these tests)."""
    return build_tiny_model("qwen2", tokenizer=build_tiny_tokenizer())


@pytest.fixture()
def scripted(tiny_causal_lm):
    """``scripted(script, **sampler_kwargs) -> (GroupSampler, tokenizer, ScriptedLM)`` over the shared tiny model."""
    from agent_helpers import scripted_sampler

    def make(script, **sampler_kwargs):
        tokenizer = build_tiny_tokenizer(padding_side="left")
        return scripted_sampler(script, model=tiny_causal_lm, tokenizer=tokenizer, **sampler_kwargs)

    return make
