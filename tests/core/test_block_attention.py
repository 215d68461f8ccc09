"""Block attention equals dense masked attention at every queried position, in values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.core.block_attention import BlockIndex, block_attention, bucket_blocks


def test_block_attention_by_hand():
    # One pack of 3 tokens, head dim 1: token 0 sees itself; token 2 sees tokens 0 and 2 (a branch), not 1.
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).view(1, 1, 3, 3)
    blocks = BlockIndex.from_mask(mask, [(0, [0, 1], [0, 1]), (0, [2], [0, 2])])
    q = torch.tensor([1.0, 1.0, 2.0]).view(1, 1, 3, 1)
    k = torch.tensor([0.0, 1.0, 1.0]).view(1, 1, 3, 1)
    v = torch.tensor([10.0, 20.0, 30.0]).view(1, 1, 3, 1)
    out = block_attention(q, k, v, blocks, scale=1.0).flatten()
    # token 1: scores (0, 1) -> weights (1, e) / (1 + e); token 2: scores (0, 2) -> (1, e^2) / (1 + e^2)
    e = math.e
    expected = [10.0, (10 + 20 * e) / (1 + e), (10 + 30 * e**2) / (1 + e**2)]
    torch.testing.assert_close(out, torch.tensor(expected), rtol=1e-6, atol=1e-5)


def _random_tree(seed: int, packs: int = 2, length: int = 23):
    """Packs of [prompt | branch | branch | ...] with padding at the end: the dense tree mask and its blocks."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(packs, 1, length, length, dtype=torch.bool)
    blocks = []
    for n in range(packs):
        prompt = int(torch.randint(1, 6, (1,), generator=g))
        spans, start = [], prompt
        while True:
            width = int(torch.randint(1, 6, (1,), generator=g))
            if start + width > length - 2:
                break
            spans.append((start, start + width))
            start += width
        for i in range(prompt):
            mask[n, 0, i, : i + 1] = True
        blocks.append((n, list(range(prompt)), list(range(prompt))))
        for a, b in spans:
            for i in range(a, b):
                mask[n, 0, i, :prompt] = True
                mask[n, 0, i, a : i + 1] = True
            chunk = 3  # long branches split into several query blocks, as the layout does
            for first in range(a, b, chunk):
                last = min(first + chunk, b)
                blocks.append((n, list(range(first, last)), [*range(prompt), *range(a, last)]))
        for pad in range(start, length):
            mask[n, 0, pad, pad] = True  # padding: not queried by any block
    return mask, blocks, start


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gqa", [False, True])
def test_block_attention_equals_dense_masked_sdpa(seed, gqa):
    mask, blocks, _ = _random_tree(seed)
    index = BlockIndex.from_mask(mask, blocks)
    queried = torch.zeros(mask.shape[0], mask.shape[2], dtype=torch.bool)
    for n, queries, _ in blocks:
        queried[n, queries] = True
    g = torch.Generator().manual_seed(100 + seed)
    heads, kv_heads = 4, 2 if gqa else 4
    q = torch.randn(2, heads, 23, 8, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, 23, 8, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, 23, 8, generator=g, requires_grad=True)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=gqa)
    out = block_attention(q, k, v, index, scale=0.3, enable_gqa=gqa)
    assert out.shape == dense.shape
    sel = queried[:, None, :, None].expand_as(dense)
    torch.testing.assert_close(out[sel], dense[sel], rtol=1e-5, atol=1e-6)
    assert (out[~sel] == 0).all()  # positions no block queries (padding) stay zero
    weight = torch.randn(dense.shape, generator=g) * sel
    grads_dense = torch.autograd.grad((dense * weight).sum(), (q, k, v))
    grads_block = torch.autograd.grad((out * weight).sum(), (q, k, v))
    for a, b in zip(grads_block, grads_dense):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_block_index_pads_and_points_outputs():
    mask, blocks, _ = _random_tree(0)
    index = BlockIndex.from_mask(mask, blocks)
    count = len(blocks)
    widest_q = max(len(q) for _, q, _ in blocks)
    widest_k = max(len(k) for _, _, k in blocks)
    assert index.allowed.shape == (count, 1, widest_q, widest_k)
    assert index.area == count * widest_q * widest_k
    assert index.allowed.any(dim=-1).all()  # no empty softmax row, padded slots included
    real = sorted((n, p) for n, queries, _ in blocks for p in queries)
    assert sorted(zip(index.out_pack.tolist(), index.out_pos.tolist())) == real


def test_block_index_rejects_bad_blocks():
    mask = torch.eye(3, dtype=torch.bool).view(1, 1, 3, 3)
    with pytest.raises(ValueError, match="at least one block"):
        BlockIndex.from_mask(mask, [])
    with pytest.raises(ValueError, match="no queries or no keys"):
        BlockIndex.from_mask(mask, [(0, [0], [])])
    with pytest.raises(ValueError, match="must attend to one of the block's keys"):
        BlockIndex.from_mask(mask, [(0, [1], [0])])  # token 1 only sees itself, which the block leaves out


def test_bucket_blocks_by_hand():
    shapes = [(32, 400), (32, 50), (32, 410), (32, 60)]  # two short-key blocks, two long-key ones
    # one call: 4 x 32 x 410 + 1000 = 53 480; split {50, 60} | {400, 410}: 2*32*60 + 2*32*410 + 2000 = 32 080;
    # splitting further saves 220 in scores but costs another 1000 per call
    buckets, cost = bucket_blocks(shapes, call_area=1000)
    assert buckets == [[1, 3], [0, 2]] and cost == 32_080
    buckets, cost = bucket_blocks(shapes, call_area=100, max_buckets=4)
    assert buckets == [[1], [3], [0], [2]] and cost == 32 * (50 + 60 + 400 + 410) + 400
    buckets, cost = bucket_blocks(shapes, call_area=100, max_buckets=1)
    assert buckets == [[1, 3, 0, 2]] and cost == 4 * 32 * 410 + 100
    # padded queries count too: a 1-query block with many keys is cheap to keep apart from 32-query ones
    buckets, _ = bucket_blocks([(32, 40), (1, 300), (32, 41)], call_area=100)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1]]


@pytest.mark.parametrize("seed", range(2))
def test_block_attention_over_several_buckets_equals_one(seed):
    mask, blocks, _ = _random_tree(seed)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 23, 8, generator=g, requires_grad=True) for _ in range(3))
    one = block_attention(q, k, v, BlockIndex.from_mask(mask, blocks))
    shapes = [(len(qs), len(ks)) for _, qs, ks in blocks]
    groups, _ = bucket_blocks(shapes, call_area=1)
    assert len(groups) > 1
    several = block_attention(q, k, v, [BlockIndex.from_mask(mask, [blocks[i] for i in grp]) for grp in groups])
    torch.testing.assert_close(several, one, rtol=1e-6, atol=1e-6)
    weight = torch.randn(one.shape, generator=g)
    for a, b in zip(
        torch.autograd.grad((several * weight).sum(), (q, k, v)), torch.autograd.grad((one * weight).sum(), (q, k, v))
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _graph_ops(tensor: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [tensor.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


def test_block_attention_gradients_repeat_bit_for_bit():
    # A shared prompt gathered by many blocks: its keys' and values' gradients add many blocks' contributions. The
    # backward of advanced indexing (IndexBackward0) adds them on CPU with parallel atomic adds in an order set by
    # thread timing (a seeded GRPO run drifted in the last bits); index_select's backward adds them in index order.
    prompt, branches, width, heads, dim = 24, 16, 30, 4, 16
    length = prompt + branches * width
    mask = torch.zeros(1, 1, length, length, dtype=torch.bool)
    blocks = [(0, list(range(prompt)), list(range(prompt)))]
    for i in range(prompt):
        mask[0, 0, i, : i + 1] = True
    for b in range(branches):
        a = prompt + b * width
        for i in range(a, a + width):
            mask[0, 0, i, :prompt] = True
            mask[0, 0, i, a : i + 1] = True
        blocks.append((0, list(range(a, a + width)), [*range(prompt), *range(a, a + width)]))
    index = BlockIndex.from_mask(mask, blocks)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, dim, generator=g, requires_grad=True) for _ in range(3))
    weight = torch.randn(1, heads, length, dim, generator=g)
    assert "IndexBackward0" not in _graph_ops(block_attention(q, k, v, index))

    def grads() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad((block_attention(q, k, v, index) * weight).sum(), (q, k, v))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = grads()
        torch.set_num_threads(max(2, threads))
        for _ in range(3):  # the same bits on more threads (with atomic adds this held only by luck of timing)
            for a, b in zip(grads(), serial):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)
