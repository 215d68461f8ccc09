"""keep_sampling_mask in the trainers' scoring forward: completion log-probs and entropies over the sampler's kept
support are the same on the plain [prompt | completion] chunked path, the shared-prompt (tree-mask) path and the
full-logits path, values and gradients, and equal a masked log-softmax of the model's own logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models.completion_scoring import completion_inputs, completion_token_stats, shared_prompt_token_stats
from posttrain.models.forward import forward_token_stats

TEMPERATURE = 0.7


def _grouped_batch(vocab: int) -> dict:
    """2 groups × 3 completions of varied lengths sharing a prompt each (the shared layout applies)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for user_len, lengths in ((14, (7, 1, 10)), (17, (3, 10, 6))):
        prompt = torch.randint(3, vocab, (user_len,), generator=g).tolist()
        rows += [(prompt, torch.randint(3, vocab, (n,), generator=g).tolist()) for n in lengths]
    p = max(len(x) for x, _ in rows)
    c = max(len(y) for _, y in rows)
    lengths = torch.tensor([len(y) for _, y in rows])
    return {
        "prompt_ids": torch.tensor([[0] * (p - len(x)) + x for x, _ in rows]),
        "prompt_mask": torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x, _ in rows]),
        "completion_ids": torch.tensor([y + [0] * (c - len(y)) for _, y in rows]),
        "completion_mask": (torch.arange(c)[None] < lengths[:, None]).long(),
        "completion_lengths": lengths,
    }


def _reference_logits(model, batch) -> torch.Tensor:
    """(B, C, V) float64 temperature-scaled logits predicting each completion token, from the model's own forward."""
    input_ids, attention_mask, position_ids, _ = completion_inputs(batch)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    c = batch["completion_ids"].shape[1]
    return logits[:, -c - 1 : -1].double() / TEMPERATURE


def _add_mask(batch: dict, z: torch.Tensor) -> dict:
    """Per token, by position: kept ids (the label and 3 others), a threshold near the row's median, or unknown."""
    b, c, _ = z.shape
    g = torch.Generator().manual_seed(1)
    ids = torch.full((b, c, 16), -1, dtype=torch.int32)
    threshold = torch.full((b, c), float("-inf"))
    for i in range(b):
        for t in range(c):
            kind = (i + t) % 3
            if kind == 0:
                others = torch.randint(0, z.shape[-1], (3,), generator=g)
                ids[i, t, :4] = torch.cat([batch["completion_ids"][i, t : t + 1], others]).to(torch.int32)
                threshold[i, t] = float("inf")
            elif kind == 1:  # halfway between two scores (as the sampler puts it), here around the median
                values = z[i, t].sort().values
                mid = values.shape[0] // 2
                threshold[i, t] = float((values[mid - 1] + values[mid]) / 2)
    return {**batch, "sampling_mask_ids": ids, "sampling_mask_threshold": threshold}


def _expected(batch: dict, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, threshold, labels = batch["sampling_mask_ids"], batch["sampling_mask_threshold"], batch["completion_ids"]
    keep = z >= threshold[..., None].double()
    keep.scatter_(-1, torch.where(ids >= 0, ids, labels[..., None]).long(), True)
    keep.scatter_(-1, labels[..., None], True)
    log_p = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
    logp = log_p.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p.masked_fill(~keep, 0.0)).sum(-1)
    valid = batch["completion_mask"].bool()
    return logp.masked_fill(~valid, 0.0).float(), entropy.float()


@pytest.mark.parametrize("path", ["chunked", "shared", "full_logits"])
def test_masked_scoring_paths_agree_with_the_masked_softmax_and_each_other(tiny_model_path, path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = _grouped_batch(model.config.vocab_size)
    z = _reference_logits(model, batch)
    batch = _add_mask(batch, z)
    logp_ref, entropy_ref = _expected(batch, z)
    valid = batch["completion_mask"].bool()
    if path == "shared":
        stats = shared_prompt_token_stats(model, batch, temperature=TEMPERATURE, compute_entropy=True)
        assert stats is not None, "the grouped batch must take the shared layout"
    elif path == "chunked":
        stats = completion_token_stats(model, batch, temperature=TEMPERATURE, compute_entropy=True)
    else:
        input_ids, attention_mask, position_ids, completion_attention = completion_inputs(batch)
        stats = forward_token_stats(
            model, input_ids, attention_mask, position_ids=position_ids, temperature=TEMPERATURE,
            logits_to_keep=completion_attention.shape[1], labels_mask=completion_attention, compute_entropy=True,
            chunked=False, sampling_mask=(batch["sampling_mask_ids"], batch["sampling_mask_threshold"]),
        )  # fmt: skip
        assert not stats.chunked
    torch.testing.assert_close(stats.logps.detach(), logp_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(stats.entropy[valid], entropy_ref[valid], atol=2e-5, rtol=1e-5)
    unmasked = completion_token_stats(
        model, {k: v for k, v in batch.items() if not k.startswith("sampling_mask")}, temperature=TEMPERATURE
    )
    assert (stats.logps.detach()[valid] > unmasked.logps.detach()[valid] - 1e-6).all()  # renormalised over less


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_masked_gradients_agree_across_paths(tiny_model_path, entropy_grad):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = _grouped_batch(model.config.vocab_size)
    batch = _add_mask(batch, _reference_logits(model, batch))
    input_ids, attention_mask, position_ids, completion_attention = completion_inputs(batch)
    weights = torch.randn(batch["completion_ids"].shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for path in ("chunked", "shared", "full_logits"):
        model.zero_grad()
        common = dict(temperature=TEMPERATURE, compute_entropy=True, entropy_requires_grad=entropy_grad)
        if path == "full_logits":
            stats = forward_token_stats(
                model, input_ids, attention_mask, position_ids=position_ids, logits_to_keep=completion_attention.shape[1],
                labels_mask=completion_attention, chunked=False,
                sampling_mask=(batch["sampling_mask_ids"], batch["sampling_mask_threshold"]), **common,
            )  # fmt: skip
        else:
            stats = completion_token_stats(model, batch, share_prompts=path == "shared", **common)
        out = stats.entropy * stats.mask if entropy_grad else stats.logps * weights
        out.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert torch.isfinite(grads[-1]).all()
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[2], grads[0], atol=1e-5, rtol=1e-4)
