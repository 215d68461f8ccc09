"""The shared-prompt training forward equals the plain [prompt | completion] forward in values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models.completion_scoring import (
    choose_shared_prompt_layout,
    completion_token_stats,
    shared_prompt_token_stats,
)
from posttrain.models.prefix_sharing import IGNORE_INDEX, build_shared_prompt_layout
from posttrain.models.tree_attention import TreeAttentionMask


def _batch(prompts: list[list[int]], completions: list[list[int]], width: int | None = None) -> dict:
    """A rollout micro-batch: left-padded prompts, right-padded completions (pad id 0)."""
    p = max(len(x) for x in prompts)
    c = width or max(max(len(x) for x in completions), 1)
    prompt_ids = torch.tensor([[0] * (p - len(x)) + x for x in prompts])
    prompt_mask = torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts])
    completion_ids = torch.tensor([x + [0] * (c - len(x)) for x in completions])
    lengths = torch.tensor([len(x) for x in completions])
    completion_mask = (torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "completion_lengths": lengths,
    }


def _layout(batch: dict, **kwargs):
    """build_shared_prompt_layout of a ``_batch`` micro-batch."""
    return build_shared_prompt_layout(
        batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_lengths"], **kwargs
    )


def test_layout_by_hand():
    # Two prompts sharing the prefix [5, 6]; two completions of prompt A, one of prompt B.
    batch = _batch([[5, 6, 7], [5, 6, 7], [5, 6, 8, 9]], [[11, 12], [13], [14, 15]])
    layout = _layout(batch)
    # root [5, 6] | A's completions, each led by A's last token 7 | B's middle [8] | B's completion led by 9
    assert layout.input_ids.tolist() == [[5, 6, 7, 11, 12, 7, 13, 8, 9, 14, 15]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 2, 3, 4, 5]]
    x = IGNORE_INDEX
    assert layout.labels.tolist() == [[x, x, x, 11, 12, x, 13, x, x, 14, 15]]
    mask = layout.attention_mask[0, 0].int().tolist()
    assert mask[4] == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # A's first completion: root + its own segment
    assert mask[6] == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]  # A's second completion does not see the first
    assert mask[10] == [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1]  # B's completion: root, B's middle, its own segment
    assert layout.num_tokens == 11 and layout.plain_tokens == 3 * (4 + 2)
    values = torch.arange(11, dtype=torch.float32).unsqueeze(0)
    assert layout.to_rows(values, (3, 2)).tolist() == [[3.0, 4.0], [6.0, 0.0], [9.0, 10.0]]


def test_layout_splits_packs_and_pads():
    batch = _batch([[1, 2, 3], [4, 5]], [[6, 7, 8], [9]])
    layout = _layout(batch, max_pack_tokens=4)
    assert layout.input_ids.shape == (2, 6)
    assert layout.input_ids.tolist() == [[1, 2, 3, 6, 7, 8], [4, 5, 9, 0, 0, 0]]
    mask = layout.attention_mask[1, 0]
    assert mask[3:].int().tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert not mask[:3, 3:].any()  # real tokens never attend to padding


def _dense_tree_mask(parents: list[int], segment_of: list[int], length: int) -> torch.Tensor:
    """Reference: the full-matrix construction (ancestor closure gathered at every (query, key) pair, then causal)."""
    num_segments = len(parents)
    ancestors = torch.eye(num_segments + 1, dtype=torch.bool)
    for seg, parent in enumerate(parents):
        if parent >= 0:
            ancestors[seg] |= ancestors[parent]
    segment = torch.full((length,), num_segments, dtype=torch.long)
    segment[: len(segment_of)] = torch.tensor(segment_of, dtype=torch.long)
    allowed = ancestors[segment.unsqueeze(1), segment.unsqueeze(0)] & torch.ones(length, length).bool().tril()
    pad = torch.arange(length) >= len(segment_of)
    allowed[pad] = False
    allowed[pad, pad] = True
    return allowed


@pytest.mark.parametrize("seed", range(4))
def test_block_built_mask_equals_the_dense_construction(seed, monkeypatch):
    import posttrain.models.prefix_sharing as ps

    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, 50, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
    prompts, completions = [], []
    for _ in range(int(torch.randint(2, 5, (1,), generator=g))):  # groups with a common system prefix (or none)
        prompt = system + torch.randint(1, 50, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            prompts.append(prompt)
            completions.append(
                torch.randint(1, 50, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
            )
    built = []
    original = ps._PackBuilder.mask
    monkeypatch.setattr(
        ps._PackBuilder, "mask", lambda self, length, out=None: built.append(self) or original(self, length, out)
    )
    batch = _batch(prompts, completions)
    layout = _layout(batch, max_pack_tokens=24)
    length = layout.input_ids.shape[1]
    assert len(built) == layout.attention_mask.shape[0]
    for k, builder in enumerate(built):
        expected = _dense_tree_mask(builder.parents, builder.segment_of, length)
        assert torch.equal(layout.attention_mask[k, 0], expected)


def test_empty_prompt_falls_back():
    batch = _batch([[], [3]], [[4], [5]])
    assert _layout(batch) is None


def _grouped_batch(seed: int, vocab: int) -> dict:
    """2 groups × 4 completions; the prompts share a 24-token system prefix; varied lengths incl. an empty one."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (24,), generator=g).tolist()
    prompts, completions = [], []
    for user_len in (5, 9):
        prompt = system + torch.randint(3, vocab, (user_len,), generator=g).tolist()
        for length in (7, 1, 12, 0) if user_len == 5 else (3, 12, 6, 2):
            prompts.append(prompt)
            completions.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return _batch(prompts, completions)


@pytest.mark.invariance
@pytest.mark.parametrize("fixture", ["tiny_model_path", "tiny_llama_path"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_forward_equals_plain_forward(fixture, attn, request):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture), attn_implementation=attn)
    batch = _grouped_batch(0, model.config.vocab_size)
    advantages = torch.randn(batch["completion_ids"].shape)
    results = []
    for share in (False, True):
        model.zero_grad()
        if share:
            stats = shared_prompt_token_stats(model, batch, temperature=0.7, compute_entropy=True)
            assert stats is not None, "the grouped batch must take the shared layout"
        else:
            stats = completion_token_stats(model, batch, temperature=0.7, compute_entropy=True)
        (stats.logps * advantages).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((stats.logps.detach(), stats.entropy, stats.mask, grads))
    (lp0, h0, m0, g0), (lp1, h1, m1, g1) = results
    assert torch.equal(m0, m1)
    assert (lp0[~m0] == 0).all() and (lp1[~m1] == 0).all()
    torch.testing.assert_close(lp1, lp0, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h1, h0, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(g1, g0, atol=1e-5, rtol=1e-4)


@pytest.mark.invariance
def test_shared_forward_entropy_gradient_matches(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = _grouped_batch(1, model.config.vocab_size)
    grads = []
    for share in (False, True):
        model.zero_grad()
        stats = completion_token_stats(
            model, batch, compute_entropy=True, entropy_requires_grad=True, share_prompts=share
        )
        (stats.entropy * stats.mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_shared_forward_declines_without_tree_masks(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = _grouped_batch(2, model.config.vocab_size)
    model.config._attn_implementation = "flash_attention_2"  # only read by the check; no forward is run
    assert shared_prompt_token_stats(model, batch) is None


def test_shared_forward_declines_when_nothing_is_shared(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    distinct = _batch([[3, 4, 5], [6, 7, 8], [9, 10, 11]], [[12] * 8, [13] * 8, [14] * 8])
    assert shared_prompt_token_stats(model, distinct) is None


def test_shared_forward_declines_rows_longer_than_a_sliding_window(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = _grouped_batch(2, model.config.vocab_size)  # rows of up to 33 + 12 tokens
    assert shared_prompt_token_stats(model, batch) is not None
    model.config.use_sliding_window, model.config.sliding_window = True, 16
    assert shared_prompt_token_stats(model, batch) is None
    model.config.sliding_window = 4096  # a window longer than every row changes nothing
    assert shared_prompt_token_stats(model, batch) is not None


def _grpo_batch(vocab: int, seed: int = 0, prompt_lengths: tuple[int, int] = (12, 9)) -> dict:
    """GRPO's usual micro-batch: 2 prompts × 8 completions of (nearly) the full width; varied lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for prompt_len in prompt_lengths:
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        for length in (20, 20, 19, 20, 5, 20, 17, 20):
            prompts.append(prompt)
            completions.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return _batch(prompts, completions)


def _system_prompt_batch(vocab: int, seed: int = 0) -> dict:
    """2 groups × 8 behind a shared 20-token system prompt, completions of 1-40 tokens: one pack for both groups,
    block attention in several buckets (short and long completions, the prompts' own runs)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (20,), generator=g).tolist()
    prompts, completions = [], []
    for user_len in (6, 9):
        prompt = system + torch.randint(3, vocab, (user_len,), generator=g).tolist()
        for length in (40, 3, 35, 12, 40, 1, 28, 40):
            prompts.append(prompt)
            completions.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return _batch(prompts, completions)


@pytest.mark.invariance
@pytest.mark.parametrize("fixture", ["tiny_model_path", "tiny_llama_path"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("make_batch", [_grpo_batch, _system_prompt_batch])
def test_block_attention_forward_equals_plain_forward(fixture, checkpointing, make_batch, request, monkeypatch):
    import posttrain.models.tree_attention as tree_attention

    calls = []
    original = tree_attention.block_attention
    monkeypatch.setattr(tree_attention, "block_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture), attn_implementation="sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    batch = make_batch(model.config.vocab_size)
    layout = choose_shared_prompt_layout(model, batch)
    assert isinstance(layout.attention_mask, TreeAttentionMask), "the batch must take block attention"
    if make_batch is _system_prompt_batch:
        assert layout.input_ids.shape[0] == 1 and len(layout.attention_mask.blocks) > 1
    assert layout.cost_ratio(model.config.hidden_size) < 0.8
    advantages = torch.randn(batch["completion_ids"].shape)
    results = []
    for share in (False, True):
        model.zero_grad()
        stats = completion_token_stats(model, batch, compute_entropy=True, share_prompts=share)
        (stats.logps * advantages).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((stats.logps.detach(), stats.entropy, grads))
    layers = model.config.num_hidden_layers
    assert len(calls) == layers * (2 if checkpointing else 1)  # the recompute runs block attention too
    (lp0, h0, g0), (lp1, h1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h1, h0, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(g1, g0, atol=1e-5, rtol=1e-4)


def test_block_attention_declines_when_prompt_copies_would_dominate(tiny_model_path):
    import posttrain.models.prefix_sharing as ps

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 250, (300,), generator=g).tolist()  # every block would copy these 300 keys
    prompts = [system + [7, 8]] * 8 + [system + [9]] * 8
    completions = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (90, 5, 60, 33, 90, 12, 70, 90) * 2]
    batch = _batch(prompts, completions)
    layout = choose_shared_prompt_layout(model, batch)
    assert layout is not None and type(layout.attention_mask) is torch.Tensor  # shared prompt, dense tree attention
    plan_buckets = ps.plan_shared_prompt_layout(
        ps.MicroBatchRows.from_tensors(
            batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_lengths"]
        )
    ).attention_blocks[0]
    gathered = sum(len(b) * max(len(k) for _, _, k in b) for b in plan_buckets)
    assert gathered > ps.BLOCK_ATTENTION_MAX_GATHER * layout.input_ids.numel()


def test_compiled_models_keep_the_plain_tree_mask(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = _grpo_batch(256, prompt_lengths=(40, 45))  # long enough prompts that the dense tree also pays
    assert isinstance(choose_shared_prompt_layout(model, batch).attention_mask, TreeAttentionMask)
    compiled = torch.compile(model)  # wrapping only; nothing is traced until it runs
    assert type(choose_shared_prompt_layout(compiled, batch).attention_mask) is torch.Tensor
    model.compile()
    assert type(choose_shared_prompt_layout(model, batch).attention_mask) is torch.Tensor


def test_eager_models_keep_the_dense_tree_mask(tiny_model_path):
    batch = _grpo_batch(256, prompt_lengths=(40, 45))  # long enough prompts that the dense tree also pays
    for attn, kind in (("sdpa", TreeAttentionMask), ("eager", torch.Tensor)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attn)
        layout = choose_shared_prompt_layout(model, batch)
        assert layout is not None and type(layout.attention_mask) is kind


def test_tree_mask_runs_dense_sdpa_for_other_shapes(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    mask = choose_shared_prompt_layout(model, _grpo_batch(model.config.vocab_size)).attention_mask
    packs, _, length, _ = mask.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(packs, 2, length, 8, generator=g) for _ in range(3))
    plain = mask.as_subclass(torch.Tensor)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(full, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=plain))
    # a caller that slices the keys (or broadcasts the mask) gets the dense attention with the plain mask
    sliced = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., :length], dropout_p=0.0)
    assert type(sliced) is torch.Tensor and sliced.shape == full.shape
    assert type(mask.float()) is torch.Tensor and type(mask[0]) is torch.Tensor  # other ops: plain tensors
