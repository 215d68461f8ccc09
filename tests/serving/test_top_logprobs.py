"""``logprobs=N`` on ``/v1/completions`` returns vLLM's top-N log-probs (issue 36, item 5).

vLLM's OpenAI server answers ``logprobs=N`` with ``logprobs.tokens``, ``token_logprobs`` (the sampled tokens') and
``top_logprobs``: per token a dict of the sampled token and the N most likely ones (N or N + 1 entries), ``-9999.0``
standing for ``-inf``. The values are the sampler's processed log-softmax (temperature, top-k, ... applied).
"""

from __future__ import annotations

import httpx
import pytest
import torch

from posttrain.serving.app import LOGPROB_FLOOR

PROMPTS = [[5, 6, 7], [8, 9]]


def _reference(model, prompt, completion, temperature, top_k, n):
    """Top-n (ids, log-probs) per completion token under log_softmax(top_k(logits / temperature)), full forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (C, V)
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    values, indices = torch.log_softmax(logits, dim=-1).topk(n, dim=-1)
    return indices.tolist(), values.tolist()


@pytest.mark.parametrize(("n", "top_k"), [(1, 0), (4, 0), (8, 5)])
def test_top_logprobs_equal_the_samplers_log_softmax(server_url, engine, n, top_k):
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 5, "temperature": 0.7, "top_k": top_k, "seed": 4,
            "logprobs": n, "ignore_eos": True}  # fmt: skip
    resp = httpx.post(f"{server_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        lp = choice["logprobs"]
        tokens, completion = lp["tokens"], choice["token_ids"]
        assert tokens == [f"token_id:{t}" for t in completion] and len(lp["token_logprobs"]) == len(completion) == 5
        assert len(lp["top_logprobs"]) == len(completion)
        prompt = choice["prompt_token_ids"]
        ref_ids, ref_values = _reference(engine.model, prompt, completion, 0.7, top_k, n)
        for step, (token, token_lp, top) in enumerate(zip(completion, lp["token_logprobs"], lp["top_logprobs"])):
            keys = list(top)
            assert keys[0] == f"token_id:{token}" and top[keys[0]] == token_lp  # the sampled token first
            expected = {f"token_id:{t}": max(v, LOGPROB_FLOOR) for t, v in zip(ref_ids[step], ref_values[step])}
            assert len(top) == n + (f"token_id:{token}" not in expected)
            rest = {k: v for k, v in top.items() if k in expected}
            assert set(rest) == set(expected)
            for key, value in expected.items():
                assert top[key] == pytest.approx(value, abs=1e-4)
            after_sampled = list(top.values())[1:]  # then the top-N by decreasing log-prob
            assert after_sampled == sorted(after_sampled, reverse=True)
        if top_k and n > top_k:  # tokens top-k filtered out are reported as -9999.0, never -inf (invalid JSON)
            assert all(sum(v == LOGPROB_FLOOR for v in top.values()) >= n - top_k for top in lp["top_logprobs"])


def test_logprobs_zero_and_null_are_unchanged(server_url):
    body = {"prompt": PROMPTS, "max_tokens": 3, "seed": 2}
    zero = httpx.post(f"{server_url}/v1/completions", json={**body, "logprobs": 0}).json()
    four = httpx.post(f"{server_url}/v1/completions", json={**body, "logprobs": 4}).json()
    null = httpx.post(f"{server_url}/v1/completions", json=body).json()
    for z, f, nul in zip(zero["choices"], four["choices"], null["choices"]):
        assert z["logprobs"]["top_logprobs"] is None and nul["logprobs"] is None
        assert z["token_ids"] == f["token_ids"] == nul["token_ids"]  # asking for top-N changes no sampled token
        assert z["logprobs"]["token_logprobs"] == f["logprobs"]["token_logprobs"]


def test_in_process_group_sampler_gives_the_same_top_logprobs(server_url, engine):
    from posttrain.generation.base import SamplingConfig
    from posttrain.generation.group_sampler import GroupSampler

    body = {"prompt": PROMPTS, "n": 3, "max_tokens": 4, "seed": 8, "logprobs": 3, "temperature": 1.3}
    remote = httpx.post(f"{server_url}/v1/completions", json=body).json()["choices"]
    sampler = GroupSampler(engine.model, generator=torch.Generator().manual_seed(8), top_logprobs=3)
    s = SamplingConfig(max_new_tokens=4, temperature=1.3, eos_token_ids=engine.eos_token_ids, pad_token_id=0)
    local = sampler.generate(PROMPTS, s, 3)
    assert [c["token_ids"] for c in remote] == local.completion_ids
    for choice, row, tops in zip(remote, local.completion_ids, sampler.last_top_logprobs):
        assert len(tops) == len(row) and all(len(step) == 3 for step in tops)
        for entry, step in zip(choice["logprobs"]["top_logprobs"], tops):
            assert all(entry[f"token_id:{t}"] == v for t, v in step)


@pytest.mark.parametrize("n", [21, 1000])
def test_more_than_twenty_is_refused(server_url, n):
    resp = httpx.post(f"{server_url}/v1/completions", json={"prompt": [1, 2], "logprobs": n})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"
