"""Helpers for the generation tests: tiny models with a sharper output distribution, a reference ``model.generate``
call, the sampling distribution written out from its formulas, and a chi-square goodness-of-fit p-value.

A freshly initialised tiny model predicts an almost uniform distribution over its ~320 tokens, which makes
top-k/top-p boundaries and greedy paths uninformative; scaling the final norm sharpens it. An optional forward hook
on the LM head adds a bias to EOS so completions end at different lengths.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from posttrain.models.tiny import build_tiny_model

EOS = 258
PAD = 259


def make_model(tokenizer, arch: str = "llama", sharpen: float = 8.0, eos_bias: float = 0.0, seed: int = 0):
    model = build_tiny_model(arch, tokenizer=tokenizer, seed=seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpen)
    if eos_bias:
        bias = torch.zeros(model.config.vocab_size)
        bias[EOS] = eos_bias
        model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    return model.eval()


def hf_generate(model, prompts, g, **gen_kwargs):
    """model.generate on left-padded, G-times repeated prompts; completions cut after the first EOS."""
    rows = [p for p in prompts for _ in range(g)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    gen_kwargs = {"top_k": 0, "pad_token_id": PAD, "eos_token_id": EOS, "disable_compile": True, **gen_kwargs}
    out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=GenerationConfig(**gen_kwargs))
    completions = []
    for ids in out[:, width:].tolist():
        completions.append(ids[: ids.index(EOS) + 1] if EOS in ids else ids)
    return completions


def hand_logprobs(logits, previous, *, temperature=1.0, top_k=0, top_p=1.0, min_p=None, penalty=1.0):
    """Log-probs of the sampling distribution for one position, written out from the formulas (float64).

    CTRL repetition penalty on ``previous`` tokens (divide positive logits, multiply negative ones), then
    temperature, top-k, top-p (keep the top tokens until their mass reaches top_p), min-p (drop p < min_p·p_max).
    """
    x = logits.double().clone()
    if penalty != 1.0:
        idx = torch.tensor(sorted(set(previous)))
        x[idx] = torch.where(x[idx] < 0, x[idx] * penalty, x[idx] / penalty)
    x = x / temperature
    if top_k:
        x[x < x.topk(top_k).values[-1]] = -float("inf")
    if top_p < 1.0:
        p_sorted, order = torch.softmax(x, -1).sort(descending=True)
        mass_before = p_sorted.cumsum(-1) - p_sorted
        x[order[mass_before >= top_p]] = -float("inf")
    if min_p is not None:
        p = torch.softmax(x, -1)
        x[p < min_p * p.max()] = -float("inf")
    return torch.log_softmax(x, -1)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value; categories expected < 5 times are pooled."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "sampled a token the distribution gives probability 0"
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    return torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), chi2 / 2).item()
