"""The shared scored forward pass: chunked log-probs ≡ naive full-logits log-probs (values, gradients, metrics)."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.forward import (
    forward_token_stats,
    prepare_attention_mask,
    token_logprobs,
    token_stats_from_logits,
)
from posttrain.models.tiny import build_tiny_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine threads only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SMALL = dict(
    vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, eos_token_id=1, pad_token_id=0, bos_token_id=None,
)  # fmt: skip


def naive_logps(model, input_ids, attention_mask=None, temperature=1.0, **kwargs):
    """Reference: full (B, T, V) logits → log_softmax → gather; position 0 gets 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0)), logits


def grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def batch(seed=0, b=3, t=10, vocab=256):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding on one row
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100  # a "prompt"
    return ids, mask, labels


@pytest.mark.invariance
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied and untied embeddings
def test_chunked_equals_naive_values_and_gradients(arch):
    model = build_tiny_model(arch)
    ids, mask, labels = batch()
    temperature = 0.7
    stats = forward_token_stats(
        model, ids, mask, labels=labels, temperature=temperature, compute_entropy=True, compute_accuracy=True,
        chunk_size=7,
    )  # fmt: skip
    assert stats.chunked
    scored = labels != -100
    scored[:, 0] = False
    assert torch.equal(stats.mask, scored)
    (stats.logps * torch.linspace(0.5, 2.0, ids.shape[1])).sum().backward()
    g_chunked = grads(model)

    ref, logits = naive_logps(model, ids, mask, temperature)
    ref = ref * scored
    (ref * torch.linspace(0.5, 2.0, ids.shape[1])).sum().backward()
    g_ref = grads(model)

    torch.testing.assert_close(stats.logps, ref.detach(), atol=1e-5, rtol=1e-5)
    assert stats.logps[:, 0].eq(0).all() and stats.logps[~scored].eq(0).all()
    assert g_chunked.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g_chunked[name], g_ref[name], atol=1e-5, rtol=1e-4, msg=name)
    # metrics: entropy and top-1 accuracy at scored positions, from the same temperature-scaled logits
    z = logits[:, :-1].detach()
    ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(stats.entropy[:, 1:][scored[:, 1:]], ent[scored[:, 1:]], atol=1e-5, rtol=1e-5)
    hits = z.argmax(-1) == ids[:, 1:]
    assert torch.equal(stats.correct[:, 1:][scored[:, 1:]], hits[scored[:, 1:]])
    assert not stats.correct[~scored].any()


@pytest.mark.invariance
def test_plain_path_matches_chunked_and_default_mask_skips_padding():
    model = build_tiny_model("qwen2")
    ids, mask, _ = batch(1)
    chunked = forward_token_stats(model, ids, mask, compute_entropy=True, compute_accuracy=True)
    plain = forward_token_stats(model, ids, mask, compute_entropy=True, compute_accuracy=True, chunked=False)
    assert chunked.chunked and not plain.chunked
    for field in ("logps", "entropy"):
        torch.testing.assert_close(getattr(chunked, field), getattr(plain, field), atol=1e-5, rtol=1e-5)
    assert torch.equal(chunked.correct, plain.correct)
    assert chunked.logps[1, 7:].eq(0).all()  # padding is not scored when no labels are given
    assert chunked.logps[0, 1:].ne(0).all()
    # the same statistics from logits a caller already has
    given = token_stats_from_logits(
        model(ids, attention_mask=mask).logits, ids, mask, compute_entropy=True, compute_accuracy=True
    )
    torch.testing.assert_close(given.logps, plain.logps, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(given.entropy, plain.entropy, atol=1e-6, rtol=1e-6)
    assert torch.equal(given.correct, plain.correct) and torch.equal(given.mask, plain.mask)


@pytest.mark.parametrize("chunked", [True, False])
def test_logits_to_keep_returns_last_k_tokens(chunked):
    model = build_tiny_model("llama")
    ids, mask, _ = batch(2)
    full, _ = token_logprobs(model, ids, mask, chunked=chunked)
    last, ent = token_logprobs(model, ids, mask, logits_to_keep=4, compute_entropy=True, chunked=chunked)
    assert last.shape == (3, 4) and ent.shape == (3, 4)
    torch.testing.assert_close(last, full[:, -4:], atol=1e-6, rtol=1e-6)
    # a (B, K) completion mask selects inside the kept window
    comp = torch.tensor([[1, 1, 0, 0]] * 3)
    masked, _ = token_logprobs(model, ids, mask, logits_to_keep=4, labels_mask=comp, chunked=chunked)
    torch.testing.assert_close(masked, full[:, -4:] * comp, atol=1e-6, rtol=1e-6)


def test_head_with_bias_and_gradient_checkpointing():
    model = build_tiny_model("llama")
    old = model.lm_head
    model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask, labels = batch(3)
    stats = forward_token_stats(model, ids, mask, labels=labels)
    assert stats.chunked
    stats.logps.sum().backward()
    g = grads(model)
    ref = forward_token_stats(model, ids, mask, labels=labels, chunked=False)
    ref.logps.sum().backward()
    g_ref = grads(model)
    torch.testing.assert_close(stats.logps, ref.logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g["lm_head.bias"], g_ref["lm_head.bias"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g["lm_head.weight"], g_ref["lm_head.weight"], atol=1e-5, rtol=1e-4)


def _small(cls_name, **extra):
    import transformers

    config = getattr(transformers, f"{cls_name}Config")(**SMALL, **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{cls_name}ForCausalLM")(config).eval()


@pytest.mark.parametrize(
    "name, extra, chunked",
    [
        ("Cohere", {"logit_scale": 0.5}, True),  # logits * 0.5: folded into the temperature
        ("Granite", {"logits_scaling": 4.0}, True),  # logits / 4: folded into the temperature
        ("Gemma2", {"final_logit_softcapping": 5.0}, False),  # tanh soft-capping: plain path
    ],
)
def test_head_transforms(name, extra, chunked):
    model = _small(name, **extra)
    ids = torch.randint(2, 300, (2, 8))
    stats = forward_token_stats(model, ids, temperature=0.9)
    ref, _ = naive_logps(model, ids, temperature=0.9)
    assert stats.chunked is chunked
    torch.testing.assert_close(stats.logps, ref, atol=1e-5, rtol=1e-5)


def test_unknown_head_transform_is_detected_once_and_falls_back(caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    class Squashed(LlamaForCausalLM):  # a head transform no config field announces
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 3.0 * torch.tanh(out.logits / 3.0)
            return out

    torch.manual_seed(0)
    model = Squashed(LlamaConfig(**{k: v for k, v in SMALL.items() if k != "head_dim"})).eval()
    torch.nn.init.normal_(model.lm_head.weight, std=2.0)  # large logits, so tanh is visibly non-linear
    ids = torch.randint(2, 300, (2, 8))
    with caplog.at_level("WARNING"):
        first = forward_token_stats(model, ids)
        second = forward_token_stats(model, ids)
    assert not first.chunked and not second.chunked
    ref, _ = naive_logps(model, ids)
    torch.testing.assert_close(first.logps, ref, atol=1e-5, rtol=1e-5)
    assert sum("unknown head transform" in r.getMessage() for r in caplog.records) == 1


def test_moe_aux_loss_is_passed_through():
    model = _small(
        "Qwen2Moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        output_router_logits=True,
    )  # fmt: skip
    ids = torch.randint(2, 300, (2, 8))
    stats = forward_token_stats(model, ids)
    assert stats.chunked and stats.aux_loss is not None
    torch.testing.assert_close(stats.aux_loss, model(ids).aux_loss)


def test_peft_lora_chunked_and_lora_on_lm_head_falls_back():
    from peft import LoraConfig, get_peft_model

    ids, mask, labels = batch(4)
    cases = (
        ({"target_modules": ["q_proj", "v_proj"]}, True),
        ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, True),  # a trained copy of the head
        ({"target_modules": ["q_proj", "lm_head"]}, False),  # LoRA on the head: plain path
    )
    for config, chunked in cases:
        model = get_peft_model(build_tiny_model("llama"), LoraConfig(r=4, init_lora_weights=False, **config))
        if "modules_to_save" in config:  # make the trained copy differ from the original head
            torch.nn.init.normal_(model.base_model.model.lm_head.modules_to_save["default"].weight)
        stats = forward_token_stats(model, ids, mask, labels=labels)
        assert stats.chunked is chunked
        ref, _ = naive_logps(model, ids, mask)
        torch.testing.assert_close(stats.logps, ref * stats.mask, atol=1e-5, rtol=1e-5)
        stats.logps.sum().backward()
        assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
        with model.disable_adapter():  # the reference policy: same call, adapters off
            base = forward_token_stats(model, ids, mask, labels=labels).logps
            ref_base, _ = naive_logps(model, ids, mask)
        torch.testing.assert_close(base, ref_base * stats.mask, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(base, stats.logps)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_block_diagonal_mask_keeps_packed_sequences_apart(attn):
    model = build_tiny_model("qwen2")
    model.set_attn_implementation(attn)
    a, b = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 7))
    packed = torch.cat([a, b], 1)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
    seg = torch.tensor([0] * 5 + [1] * 7)
    block = (seg[:, None] == seg[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    labels = packed.clone()
    labels[0, 5] = -100  # the first token of the second sequence has no in-sequence context
    stats = forward_token_stats(model, packed, block[None, None], labels=labels, position_ids=position_ids)
    sep_a, _ = token_logprobs(model, a, None)
    sep_b, _ = token_logprobs(model, b, None)
    torch.testing.assert_close(stats.logps, torch.cat([sep_a, sep_b], 1), atol=1e-5, rtol=1e-5)


def test_prepare_attention_mask_per_implementation():
    model = build_tiny_model("qwen2")
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    assert prepare_attention_mask(model, mask) is mask  # sdpa: boolean masks are native
    model.config._attn_implementation = "flash_attention_2"
    assert prepare_attention_mask(model, mask) is None  # position_ids carry the boundaries
    model.config._attn_implementation = "eager"
    additive = prepare_attention_mask(model, mask)
    assert additive.dtype == torch.float32 and additive[0, 0, 0, 1] < -1e30 and additive[0, 0, 1, 0] == 0
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="flex_attention"):
        prepare_attention_mask(model, mask)
    two_d = torch.ones(2, 4)
    assert prepare_attention_mask(model, two_d) is two_d


def test_chunked_path_never_saves_full_vocabulary_logits():
    """Backward keeps no (N, V) tensor on the chunked path; the plain path keeps one (the logits)."""
    vocab = 4096
    model = build_tiny_model("llama", vocab_size=vocab)
    ids = torch.randint(0, 256, (2, 256))
    n_by_v = ids.numel() * vocab // 2  # anything half the size of the logits would be suspicious

    def largest_saved(chunked):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward_token_stats(model, ids, chunked=chunked, chunk_size=16).logps.sum().backward()
        model.zero_grad(set_to_none=True)
        return max(sizes)

    assert largest_saved(True) < n_by_v
    assert largest_saved(False) >= n_by_v


def test_bad_inputs_name_the_argument():
    model = build_tiny_model("qwen2")
    ids = torch.randint(0, 256, (2, 6))
    with pytest.raises(ValueError, match="logits_to_keep"):
        token_logprobs(model, ids, None, logits_to_keep=7)
    with pytest.raises(ValueError, match="labels_mask"):
        token_logprobs(model, ids, None, labels_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, None, temperature=0.0)


def test_auto_chunk_size_bounds_scratch_memory():
    """~16 MiB of float32 scratch (2 x chunk x V floats): full 1024-token chunks for small vocabularies, 65 for
    Llama's 32 000 rows, the 16-token floor for Qwen's 151 936 rows."""
    from posttrain.models.forward import auto_chunk_size

    assert auto_chunk_size(320) == 1024
    assert auto_chunk_size(32_000) == 16 * 2**20 // (8 * 32_000) == 65
    assert auto_chunk_size(151_936) == 16
    assert auto_chunk_size(10**9) == 16


def test_auto_chunk_sizes_tile_only_large_vocabularies():
    """Up to 32 768 rows the head is not tiled (the numbers of small models stay bitwise); above, 256-token chunks
    in 2048-row vocabulary blocks (2 × 256 × 2048 floats = 4 MiB of scratch)."""
    from posttrain.models.forward import auto_chunk_size, auto_chunk_sizes

    assert auto_chunk_sizes(320) == (1024, None)
    assert auto_chunk_sizes(32_000) == (auto_chunk_size(32_000), None)
    assert auto_chunk_sizes(32_768) == (64, None)
    assert auto_chunk_sizes(32_769) == (256, 2048)
    assert auto_chunk_sizes(151_936) == (256, 2048)


@pytest.mark.invariance
def test_large_vocabulary_tiled_head_matches_plain_path():
    """A 40 000-row vocabulary (tiled automatically): log-probs, entropies and gradients of every parameter equal
    the full-logits path; the compute-accuracy pass agrees with the logits' argmax."""
    torch.manual_seed(0)
    model = build_tiny_model("qwen2", vocab_size=40_000)
    ids = torch.randint(0, 40_000, (2, 300))
    grads = []
    stats = []
    for chunked in (True, False):
        out = forward_token_stats(model, ids, chunked=chunked, compute_entropy=True, compute_accuracy=True)
        assert out.chunked is chunked
        (out.logps * torch.linspace(0, 1, 300)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        stats.append(out)
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(stats[0].logps, stats[1].logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats[0].entropy, stats[1].entropy, atol=1e-4, rtol=1e-5)
    assert torch.equal(stats[0].correct, stats[1].correct)
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_plan_length_buckets_by_hand():
    from posttrain.models.forward import plan_length_buckets

    # Equal lengths: nothing to save. Two clear clusters: two groups, longest first, original row indices.
    assert plan_length_buckets([50] * 8, hidden_size=64) is None
    assert plan_length_buckets([10, 200, 12, 190, 11, 205, 9, 199], hidden_size=64) == [[5, 1, 7, 3], [2, 4, 0, 6]]
    assert plan_length_buckets([10, 200, 12], hidden_size=64) is None  # too few rows to split


@pytest.mark.invariance
@pytest.mark.parametrize("use_labels", [True, False])
def test_length_buckets_equal_one_padded_call(use_labels, monkeypatch):
    """Rows of very different lengths run in length groups: same log-probs, masks, entropies and gradients."""
    import posttrain.models.forward as forward

    # length groups are the fallback where the padding-free layout does not apply (tests/models/test_padding_free.py)
    monkeypatch.setattr(forward, "padding_free_layout", lambda *a, **k: None)
    torch.manual_seed(0)
    model = build_tiny_model()
    g = torch.Generator().manual_seed(3)
    lengths = [40, 6, 38, 5, 41, 7, 8, 39]
    ids = torch.randint(2, 256, (len(lengths), 41), generator=g)
    mask = (torch.arange(41).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    kwargs = {"labels": labels} if use_labels else {"labels_mask": labels != -100}
    out = []
    for buckets in (False, True):
        stats = forward_token_stats(
            model, ids, mask, compute_entropy=True, compute_accuracy=True, length_buckets=buckets, **kwargs
        )
        stats.logps.sum().backward()
        out.append((stats, grads(model)))
    (plain, g0), (bucketed, g1) = out
    assert bucketed.logps.shape == plain.logps.shape == ids.shape
    assert torch.equal(bucketed.mask, plain.mask) and torch.equal(bucketed.correct, plain.correct)
    torch.testing.assert_close(bucketed.logps, plain.logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bucketed.entropy, plain.entropy, atol=1e-5, rtol=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4)


def test_length_buckets_skip_left_padding(monkeypatch):
    import posttrain.models.forward as forward

    calls = []
    monkeypatch.setattr(forward, "_bucketed_token_stats", lambda *a: calls.append(a))
    model = build_tiny_model()
    mask = torch.ones(8, 30, dtype=torch.long)
    mask[::2, :25] = 0  # left padding
    forward_token_stats(model, torch.randint(2, 256, (8, 30)), mask, length_buckets=True)
    assert not calls


def test_sequence_scores_length_buckets_match_one_call():
    from posttrain.models.forward import sequence_scores

    torch.manual_seed(0)
    model = build_tiny_model(task="sequence-classification")
    lengths = [50, 6, 48, 5, 51, 7, 8, 49]
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(51).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = torch.randint(2, 256, (8, 51), generator=g).masked_fill(mask == 0, model.config.pad_token_id)
    out = []
    for buckets in (False, True):
        scores = sequence_scores(model, ids, mask, length_buckets=buckets)
        (scores * torch.arange(8.0)).sum().backward()
        out.append((scores.detach(), grads(model)))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-5, rtol=1e-5)
    for name in out[0][1]:
        torch.testing.assert_close(out[1][1][name], out[0][1][name], atol=1e-5, rtol=1e-4)
