"""The lean decode forward: used only after it matched the model's own forward bitwise, off for good otherwise, and
sampling through it gives the very tokens and log-probs of the model's forward."""

from __future__ import annotations

import functools

import pytest
import torch
from generation_helpers import EOS, PAD, make_model

from posttrain.generation import GroupSampler, SamplingConfig, lean_decode


def _sample(model, prompts, seed: int = 0):
    sampling = SamplingConfig(20, temperature=0.9, top_p=0.95, eos_token_ids=[EOS], pad_token_id=PAD)
    torch.manual_seed(seed)
    return GroupSampler(model).generate(prompts, sampling, num_generations=3)


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_verified_lean_path_samples_what_the_models_forward_samples(request, prompts, arch):
    model = request.getfixturevalue(arch)
    lean_decode._VERDICTS.pop(model, None)
    lean = _sample(model, prompts)
    assert lean_decode._VERDICTS[model] is True  # checked at the first decode step and kept
    lean_again = _sample(model, prompts)  # the verified path from its first step on
    lean_decode._VERDICTS[model] = False  # the model's own forward at every step
    try:
        plain = _sample(model, prompts)
    finally:
        lean_decode._VERDICTS.pop(model, None)
    for out in (lean, lean_again):
        assert out.completion_ids == plain.completion_ids
        assert out.logprobs == plain.logprobs  # bitwise: the same kernels in the same order
        assert out.finished == plain.finished


def test_calls_go_through_the_lean_path_once_verified(qwen, prompts, monkeypatch):
    lean_decode._VERDICTS.pop(qwen, None)
    _sample(qwen, prompts)
    calls = []
    forward = qwen.forward

    @functools.wraps(forward)  # keeps the signature the sampler reads its cache argument's name from
    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(qwen, "forward", counting)
    _sample(qwen, prompts)
    assert len(calls) == 1  # the prefill only: every decode step skipped the model's forward


def test_a_model_whose_forward_differs_is_rejected_and_sampled_correctly(tokenizer, prompts):
    model = make_model(tokenizer, "qwen2", eos_bias=1.0)
    inner = model.model
    original = type(inner).forward

    def scaled_forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        # An architecture that scales its embeddings in forward (as Gemma does): the lean path would miss it.
        inputs_embeds = self.embed_tokens(input_ids) * 2.0
        return original(self, inputs_embeds=inputs_embeds, **kwargs)

    inner.forward = scaled_forward.__get__(inner)
    out = _sample(model, prompts)
    assert lean_decode._VERDICTS[model] is False
    reference = _sample(model, prompts)  # the model's forward throughout
    assert out.completion_ids == reference.completion_ids and out.logprobs == reference.logprobs


def test_a_model_without_the_standard_layout_keeps_its_forward(qwen):
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = qwen

    decoder = lean_decode.LeanDecoder(Wrapper(), full_forward=lambda *a: "full", cache_kw="cache")
    assert not decoder.active
    assert decoder(None, None, None, None) == "full"


def test_only_a_plain_float32_linear_head_writes_into_the_callers_buffer():
    """The lean step's ``torch.mm(..., out=)`` is ``F.linear``'s own product only for a bias-free float32
    ``nn.Linear`` without hooks; any other head is called as a module (the verification still compares both)."""
    plain = torch.nn.Linear(4, 6, bias=False)
    assert lean_decode._plain_float_head(plain)
    assert not lean_decode._plain_float_head(torch.nn.Linear(4, 6))  # bias
    assert not lean_decode._plain_float_head(torch.nn.Linear(4, 6, bias=False).to(torch.bfloat16))
    hooked = torch.nn.Linear(4, 6, bias=False)
    hooked.register_forward_hook(lambda module, args, out: out * 2)
    assert not lean_decode._plain_float_head(hooked)

    class Scaled(torch.nn.Linear):
        pass

    assert not lean_decode._plain_float_head(Scaled(4, 6, bias=False))
    x, out = torch.randn(3, 4), torch.empty(3, 6)
    with torch.no_grad():  # decoding runs without autograd (out= takes no graph)
        assert torch.equal(torch.mm(x, plain.weight.T, out=out), plain(x))  # the same bits as the module's forward
