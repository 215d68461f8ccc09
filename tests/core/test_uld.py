"""Hand-computed values of the cross-tokenizer (ULD / GOLD) math: byte-offset alignment, the two merge
strategies, the sorted-probability L1 and the hybrid matched/unmatched loss."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.uld import (
    align_by_byte_offsets,
    hybrid_uld_loss,
    merge_group_probs,
    uld_sorted_l1,
    vocabulary_mapping,
)


def test_alignment_groups_close_at_shared_boundaries():
    # text "abcd": student "ab" "c" "d", teacher "a" "bcd"
    s, t = align_by_byte_offsets([(0, 2), (2, 3), (3, 4)], [(0, 1), (1, 4)])
    assert s == [[0, 1, 2]] and t == [[0, 1]]
    # "abcd": student "ab" "cd", teacher "a" "b" "cd" -> {ab | a b}, {cd | cd}
    s, t = align_by_byte_offsets([(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 4)])
    assert s == [[0], [1]] and t == [[0, 1], [2]]
    # a leftover tail (teacher longer) forms a final group
    s, t = align_by_byte_offsets([(0, 1)], [(0, 1), (1, 2)])
    assert s == [[0], []] and t == [[0], [1]]


def test_merge_strategies():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    ids = [0, 1, 2]
    observed = merge_group_probs(probs, [[0, 1], [2]], ids, "observed")
    assert torch.allclose(observed[0], probs[0] * 0.6) and torch.equal(observed[1], probs[2])
    bayesian = merge_group_probs(probs, [[0, 1, 2]], ids, "bayesian")
    assert torch.allclose(bayesian[0], probs[2] * 0.5 * 0.6)
    assert merge_group_probs(probs, [[]], ids).tolist() == [[0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="merge strategy"):
        merge_group_probs(probs, [[0]], ids, "greedy")


def test_sorted_l1_by_hand_with_different_vocabularies():
    student = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]])
    teacher = torch.tensor([[0.6, 0.4], [0.9, 0.1]])
    # row 0: sorted [.7 .2 .1] vs [.6 .4 0] -> .1 + .2 + .1 = .4; row 1: [.5 .25 .25] vs [.9 .1 0] -> .4+.15+.25 = .8
    assert uld_sorted_l1(student, teacher).item() == pytest.approx((0.4 + 0.8) / 2)
    # invariant to permuting either vocabulary
    assert uld_sorted_l1(student[:, [2, 0, 1]], teacher[:, [1, 0]]).item() == pytest.approx(0.6)


def test_sorted_l1_gradient():
    student = torch.tensor([[0.2, 0.8]], requires_grad=True)
    uld_sorted_l1(student, torch.tensor([[0.5, 0.5]])).backward()
    assert student.grad.tolist() == [[-1.0, 1.0]]  # 0.8 above 0.5 (+1), 0.2 below 0.5 (-1)


def test_vocabulary_mapping_and_hybrid_loss_by_hand():
    student_vocab = {"a": 0, "b": 1, "x": 2}
    teacher_vocab = {"b": 0, "a": 1, "yy": 2, "zz": 3}
    teacher_ids, student_ids = vocabulary_mapping(student_vocab, teacher_vocab)
    assert teacher_ids.tolist() == [0, 1] and student_ids.tolist() == [1, 0]
    student = torch.tensor([[0.5, 0.3, 0.2]])  # a b x
    teacher = torch.tensor([[0.2, 0.4, 0.3, 0.1]])  # b a yy zz
    total, matched, unmatched = hybrid_uld_loss(student, teacher, teacher_ids, student_ids, beta=0.0)
    # matched (forward KL on columns): teacher (b .2, a .4) vs student (b .3, a .5)
    expect_matched = 0.2 * math.log(0.2 / 0.3) + 0.4 * math.log(0.4 / 0.5)
    # unmatched: student [x .2] vs teacher sorted [.3 .1] -> |.2-.3| + |0-.1| = .2
    assert matched.item() == pytest.approx(expect_matched, rel=1e-5)
    assert unmatched.item() == pytest.approx(0.2, rel=1e-5)
    # adaptive weights: 2 of 4 teacher tokens matched
    assert total.item() == pytest.approx(0.5 * expect_matched + 0.5 * 0.2, rel=1e-5)
    fixed, _, _ = hybrid_uld_loss(student, teacher, teacher_ids, student_ids, beta=0.0, matched_weight=1.0,
                                  unmatched_weight=2.0)  # fmt: skip
    assert fixed.item() == pytest.approx(expect_matched + 0.4, rel=1e-5)
