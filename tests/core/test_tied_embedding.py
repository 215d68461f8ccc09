"""Tied input-embedding / LM-head gradients added in place into ``weight.grad`` (posttrain.core.tied_embedding):
the same gradients as autograd's own accumulation — tied and untied models, one and several micro-batches, padding
and repeated tokens — and the path stays off where something else owns the gradient (process group, wrappers,
hooks, frozen or low-precision weights, the opt-out variable)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from posttrain.core import tied_embedding
from posttrain.models import forward
from posttrain.models.tiny import build_tiny_model


def _batches(vocab: int, pad: int, n: int = 3):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 12, (3, 9), generator=gen)  # few distinct ids: many repeated rows in the lookup
        ids[0, :2] = pad  # left padding
        ids[1, 4] = pad  # the pad id as a real, attended token: its embedding row still gets no lookup gradient
        ids[2, 5] = vocab - 1
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        out.append((ids, mask))
    return out


def _graph_has(tensor: torch.Tensor, name: str) -> bool:
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def _accumulated_grads(model, batches, offload=False, **kwargs):
    model.zero_grad(set_to_none=True)
    engaged = []
    for ids, mask in batches:
        with _copying_saved_tensor_hooks() if offload else contextlib.nullcontext():
            stats = forward.forward_token_stats(model, ids, mask, compute_entropy=True, **kwargs)
        engaged.append(_graph_has(stats.logps, "_LookupGradInPlaceBackward"))
        loss = -(stats.logps * stats.mask).sum() / stats.mask.sum() + 0.1 * stats.logps.pow(2).mean()
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, engaged


def _copying_saved_tensor_hooks():
    """As activation offloading: every saved tensor comes back from backward as a different tensor object."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t)


@pytest.mark.parametrize(
    "micro_batches,checkpointing,offload", [(1, False, False), (3, False, False), (2, True, False), (2, False, True)]
)
def test_tied_in_place_grads_equal_autograd_accumulation(monkeypatch, micro_batches, checkpointing, offload):
    model = build_tiny_model("qwen2", vocab_size=320)
    if checkpointing:  # as the trainers' default gradient_checkpointing=True: a hook on the input embedding
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
        model.train()
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    pad = model.get_input_embeddings().padding_idx
    assert pad is not None
    batches = _batches(320, pad, micro_batches)
    ours, engaged = _accumulated_grads(model, batches, offload, chunk_size=5)
    assert all(engaged)
    monkeypatch.setenv(tied_embedding.ENV_DISABLE, "0")
    theirs, engaged_off = _accumulated_grads(model, batches, offload, chunk_size=5)
    assert not any(engaged_off)
    full_logits, _ = _accumulated_grads(model, batches, chunked=False)
    assert ours.keys() == theirs.keys()
    for name in ours:
        # same sum, different rounding order (a repeated token's rows are added one by one into the head's gradient)
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(ours[name], full_logits[name], rtol=1e-4, atol=1e-6, msg=name)
    weight = model.get_input_embeddings().weight
    assert ours["model.embed_tokens.weight"][pad].abs().sum() > 0  # the head still trains the pad row
    assert not torch.equal(ours["model.embed_tokens.weight"], torch.zeros_like(weight))


def test_untied_model_is_not_rerouted_and_grads_are_unchanged(monkeypatch):
    model = build_tiny_model("llama", vocab_size=320)
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    batches = _batches(320, model.config.pad_token_id, 2)
    ours, engaged = _accumulated_grads(model, batches, chunk_size=5)
    assert not any(engaged)
    monkeypatch.setenv(tied_embedding.ENV_DISABLE, "0")
    theirs, _ = _accumulated_grads(model, batches, chunk_size=5)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_off_where_autograd_must_own_the_gradient(monkeypatch):
    model = build_tiny_model("qwen2", vocab_size=320)
    head = forward.resolve_lm_head(model)
    embedding = model.get_input_embeddings()
    assert forward._tied_embedding_for_in_place_grad(model, head) is embedding

    with torch.no_grad():
        assert forward._tied_embedding_for_in_place_grad(model, head) is None

    class Wrapper(torch.nn.Module):  # DDP / DeepSpeed / FSDP1 hold the model as .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert forward._tied_embedding_for_in_place_grad(Wrapper(model), head) is None

    with monkeypatch.context() as m:
        m.setattr(torch.distributed, "is_initialized", lambda: True)
        assert forward._tied_embedding_for_in_place_grad(model, head) is None

    handle = embedding.register_forward_hook(lambda module, args, output: output + 1)  # e.g. NEFTune
    assert forward._tied_embedding_for_in_place_grad(model, head) is None
    handle.remove()

    handle = embedding.weight.register_hook(lambda grad: grad)
    assert forward._tied_embedding_for_in_place_grad(model, head) is None
    handle.remove()

    embedding.weight.requires_grad_(False)
    assert forward._tied_embedding_for_in_place_grad(model, head) is None
    embedding.weight.requires_grad_(True)

    with monkeypatch.context() as m:
        m.setenv(tied_embedding.ENV_DISABLE, "0")
        assert forward._tied_embedding_for_in_place_grad(model, head) is None

    assert forward._tied_embedding_for_in_place_grad(model, head) is embedding
    model.to(torch.bfloat16)
    assert forward._tied_embedding_for_in_place_grad(model, forward.resolve_lm_head(model)) is None


def test_chunked_head_weight_grad_in_place_accumulates_into_existing_grad():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 4, generator=gen, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(11, 4, generator=gen))
    labels = torch.randint(0, 11, (7,), generator=gen)
    from posttrain.core.logprobs import chunked_logprobs_from_hidden

    logp, _ = chunked_logprobs_from_hidden(hidden, weight, labels, chunk_size=3)
    (expected,) = torch.autograd.grad(logp.sum(), weight)
    weight.grad = torch.ones_like(weight)
    buffer = weight.grad
    logp, _ = chunked_logprobs_from_hidden(hidden, weight, labels, chunk_size=3, weight_grad_in_place=True)
    logp.sum().backward()
    assert weight.grad is buffer  # added into, not replaced
    torch.testing.assert_close(weight.grad, expected + 1)
    with pytest.raises(ValueError, match="float32 leaf"):
        chunked_logprobs_from_hidden(hidden, weight.detach().bfloat16(), labels, weight_grad_in_place=True)
