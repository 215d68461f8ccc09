"""``chunked_uld_loss`` (the micro-batch's ULD a chunk of aligned groups at a time, from logits functions) equals the
per-row assembly ``merge_group_probs`` → ``uld_sorted_l1`` / ``hybrid_uld_loss`` → mean over rows, in value and in
gradients, for both merge strategies, with and without the hybrid mapping, for chunk sizes from 1 position to the
whole batch (uneven last chunks, groups of several positions); and no chunk builds more than ``chunk_size`` rows of
logits."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.uld import (
    GroupPlan,
    chunked_uld_loss,
    group_plan,
    hybrid_uld_loss,
    merge_group_probs,
    uld_sorted_l1,
)

V_S, V_T, H = 13, 17, 6
# two rows: (student groups, teacher groups) over each row's positions; ids index the vocabularies
ROWS = [
    ([[0, 1], [2], [3, 4, 5]], [[0], [1, 2], [3]], [3, 5, 1, 7, 2, 9], [4, 6, 1, 8]),
    ([[0], [1], [2, 3]], [[0, 1], [2], [3]], [2, 2, 11, 0], [16, 3, 5, 7]),
]
MAPPING = (torch.tensor([1, 3, 4, 8, 16]), torch.tensor([0, 2, 3, 7, 12]))  # teacher ids -> student ids


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    s_hidden = torch.randn(2, 7, H, generator=g, dtype=torch.float64, requires_grad=True)  # rows padded to 7
    s_weight = torch.randn(V_S, H, generator=g, dtype=torch.float64, requires_grad=True)
    t_hidden = torch.randn(2, 5, H, generator=g, dtype=torch.float64)
    t_weight = torch.randn(V_T, H, generator=g, dtype=torch.float64)
    return s_hidden, s_weight, t_hidden, t_weight


def _naive(s_hidden, s_weight, t_hidden, t_weight, strategy, mapping, temps):
    losses = []
    for r, (sg, tg, s_ids, t_ids) in enumerate(ROWS):
        s_probs = torch.softmax(s_hidden[r, : len(s_ids)] @ s_weight.T / temps[0], -1)
        t_probs = torch.softmax(t_hidden[r, : len(t_ids)] @ t_weight.T / temps[1], -1)
        s_al, t_al = merge_group_probs(s_probs, sg, s_ids, strategy), merge_group_probs(t_probs, tg, t_ids, strategy)
        losses.append(uld_sorted_l1(s_al, t_al) if mapping is None else hybrid_uld_loss(s_al, t_al, *mapping, beta=0.5)[0])
    return torch.stack(losses).mean()


def _chunked(s_hidden, s_weight, t_hidden, t_weight, strategy, mapping, temps, chunk):
    s_flat, t_flat = s_hidden.reshape(-1, H), t_hidden.reshape(-1, H)
    s_plans, t_plans, weights = [], [], []
    for r, (sg, tg, s_ids, t_ids) in enumerate(ROWS):
        s_plans.append(group_plan(sg, s_ids, strategy, offset=r * s_hidden.shape[1]))
        t_plans.append(group_plan(tg, t_ids, strategy, offset=r * t_hidden.shape[1]))
        weights += [1.0 / (len(sg) * len(ROWS))] * len(sg)
    return chunked_uld_loss(
        lambda p: s_flat[p] @ s_weight.T, lambda p: t_flat[p] @ t_weight.T, GroupPlan.concat(s_plans),
        GroupPlan.concat(t_plans), torch.tensor(weights, dtype=torch.float64), student_temperature=temps[0],
        teacher_temperature=temps[1], mapping=mapping, beta=0.5, chunk_size=chunk,
    )  # fmt: skip


@pytest.mark.parametrize("strategy", ["observed", "bayesian"])
@pytest.mark.parametrize("hybrid", [False, True])
def test_chunked_equals_per_row_assembly(strategy, hybrid):
    data = _data()
    mapping = MAPPING if hybrid else None
    temps = (0.7, 1.3)
    expected = _naive(*data, strategy, mapping, temps)
    grads = torch.autograd.grad(expected, data[:2])
    for chunk in (1, 2, 3, 5, 100):
        total, matched, unmatched = _chunked(*data, strategy, mapping, temps, chunk)
        torch.testing.assert_close(total, expected)
        for got, want in zip(torch.autograd.grad(total, data[:2]), grads):
            torch.testing.assert_close(got, want)
        if hybrid:
            w_m = 5 / V_T
            torch.testing.assert_close(w_m * matched + (1 - w_m) * unmatched, total.detach())
            assert not matched.requires_grad


def test_no_chunk_builds_more_than_chunk_rows_of_logits():
    data = _data()
    seen = []

    def s_fn(positions):
        seen.append(positions.numel())
        return data[0].reshape(-1, H)[positions] @ data[1].T

    t_flat = data[2].reshape(-1, H)
    plans = [group_plan(sg, s_ids, "observed", r * 7) for r, (sg, _, s_ids, _) in enumerate(ROWS)]
    t_plans = [group_plan(tg, t_ids, "observed", r * 5) for r, (_, tg, _, t_ids) in enumerate(ROWS)]
    total, _, _ = chunked_uld_loss(s_fn, lambda p: t_flat[p] @ data[3].T, GroupPlan.concat(plans),
                                   GroupPlan.concat(t_plans), torch.full((6,), 1 / 6, dtype=torch.float64),
                                   chunk_size=3)  # fmt: skip
    total.backward()
    # every call (forward and the recompute in backward) asks for at most 3 positions; 10 student positions in all
    assert seen and max(seen) <= 3 and sum(seen) == 2 * 10


def test_group_plan_and_errors():
    plan = group_plan([[0, 1, 2], [3]], [5, 6, 7, 8], "bayesian", offset=10)
    assert plan.base.tolist() == [12, 13] and plan.scalar_positions.tolist() == [[10, 11], [0, 0]]
    assert plan.scalar_tokens.tolist() == [[5, 6], [0, 0]] and plan.scalar_mask.tolist() == [[True, True], [False, False]]
    assert group_plan([[0, 1, 2]], [5, 6, 7], "observed").base.tolist() == [0]
    with pytest.raises(ValueError, match="non-empty"):
        group_plan([[]], [], "observed")
    with pytest.raises(ValueError, match="one entry per group"):
        chunked_uld_loss(lambda p: p, lambda p: p, plan, plan.select(0, 1), torch.ones(2))
