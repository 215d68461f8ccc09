"""TransformersBackend: model.generate as TRL calls it, cut at EOS, with processed-score log-probs."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import EOS, PAD, hand_logprobs, hf_generate, make_model

from posttrain.generation import GroupSampler, SamplingConfig, TransformersBackend
from posttrain.generation.transformers_backend import generation_config_from_sampling, left_pad


@pytest.mark.invariance
def test_greedy_matches_generate_and_group_sampler(llama, tokenizer, prompts, greedy):
    out = TransformersBackend(llama, tokenizer).generate(prompts, greedy, num_generations=2)
    assert out.completion_ids == hf_generate(llama, prompts, 2, do_sample=False, max_new_tokens=24)
    assert out.prompt_ids == [p for p in prompts for _ in range(2)]
    assert out.finished == [c[-1] == EOS for c in out.completion_ids]
    assert any(out.finished) and not all(out.finished)
    ours = GroupSampler(llama).generate(prompts, greedy, num_generations=2)
    assert ours.completion_ids == out.completion_ids and ours.finished == out.finished
    flat = lambda rows: torch.tensor([x for row in rows for x in row])  # noqa: E731
    assert torch.allclose(flat(ours.logprobs), flat(out.logprobs), atol=1e-5)


def test_sampling_logprobs_are_the_processed_distribution(llama, tokenizer, prompts):
    knobs = dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05, penalty=1.2)
    sampling = SamplingConfig(
        6, temperature=0.8, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
        eos_token_ids=[EOS], pad_token_id=PAD,
    )  # fmt: skip
    out = TransformersBackend(llama, tokenizer).generate(prompts[:3], sampling, num_generations=3)
    assert len(out) == 9
    for prompt, ids, lps in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        assert len(lps) == len(ids) and (ids[-1] == EOS or len(ids) == 6)
        with torch.no_grad():
            logits = llama(torch.tensor([prompt + ids])).logits[0]  # (P + T, V)
        for t, (token, lp) in enumerate(zip(ids, lps)):
            want = hand_logprobs(logits[len(prompt) + t - 1], prompt + ids[:t], **knobs)[token]
            assert abs(want.item() - lp) < 1e-4


def test_generation_kwargs_are_merged_last_and_mode_is_restored(tokenizer, prompts):
    model = make_model(tokenizer, "llama").train()
    sampling = SamplingConfig(
        24, do_sample=False, eos_token_ids=[EOS], pad_token_id=PAD,
        generation_kwargs={"max_new_tokens": 10, "no_repeat_ngram_size": 2},
    )  # fmt: skip
    out = TransformersBackend(model, tokenizer, return_logprobs=False).generate(prompts, sampling)
    assert out.logprobs is None and model.training
    for prompt, ids in zip(prompts, out.completion_ids):
        assert len(ids) <= 10
        bigrams = list(zip(prompt + ids, (prompt + ids)[1:]))
        for i in range(len(prompt) - 1, len(bigrams)):  # each generated token makes no bigram seen before
            assert bigrams[i] not in bigrams[:i]


def test_generation_config_fields(tokenizer):
    sampling = SamplingConfig(
        7, temperature=0.5, top_p=0.8, top_k=None, min_p=0.1, repetition_penalty=1.1, eos_token_ids=[EOS, 256],
        pad_token_id=PAD, cache_implementation="static", generation_kwargs={"top_p": 0.95},
    )  # fmt: skip
    config = generation_config_from_sampling(sampling, tokenizer)
    assert config.max_new_tokens == 7 and config.do_sample and config.temperature == 0.5
    assert config.top_k == 0  # None means "off", not GenerationConfig's default of 50
    assert config.top_p == 0.95  # generation_kwargs win
    assert config.min_p == 0.1 and config.repetition_penalty == 1.1 and config.disable_compile
    assert list(config.eos_token_id) == [EOS, 256] and config.pad_token_id == PAD
    assert config.cache_implementation == "static"


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
