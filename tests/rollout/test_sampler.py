"""RepeatSampler / repeat_iterable_dataset ordering and TRL's generation-batch rules and error messages."""

from __future__ import annotations

import pytest

from posttrain.rollout.sampler import (
    RepeatSampler,
    check_eval_batch,
    repeat_iterable_dataset,
    resolve_generation_batch,
)


def test_repeat_sampler_order_without_shuffle():
    # 7 rows, 3 prompts per chunk: the incomplete last chunk (row 6) is dropped.
    sampler = RepeatSampler(list(range(7)), mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=False)
    expected = [0, 0, 1, 1, 2, 2] * 2 + [3, 3, 4, 4, 5, 5] * 2
    assert list(sampler) == expected
    assert len(sampler) == len(expected) == 24


def test_drop_last_false_keeps_the_short_last_chunk_in_both_samplers():
    # TRL's plain-Trainer dataloader (Online DPO, A2PO, GKD) keeps an epoch's short last batch: 7 rows at 3 per chunk.
    sampler = RepeatSampler(list(range(7)), mini_repeat_count=2, batch_size=3, shuffle=False, drop_last=False)
    expected = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert list(sampler) == expected and len(sampler) == 14
    rows = [{"prompt": str(i)} for i in range(7)]
    stream = repeat_iterable_dataset(rows, 2, batch_size=3, shuffle=False, drop_last=False)
    assert [r["prompt"] for r in stream] == [str(i) for i in expected]
    shuffled = list(RepeatSampler(list(range(7)), mini_repeat_count=2, batch_size=3, seed=3, drop_last=False))
    assert sorted(shuffled) == expected  # every row of the epoch, twice, still in consecutive pairs
    assert all(shuffled[i] == shuffled[i + 1] for i in range(0, 14, 2))


def test_drop_last_false_refuses_replayed_chunks():
    with pytest.raises(ValueError, match="repeat_count=1"):
        RepeatSampler(list(range(7)), mini_repeat_count=2, batch_size=3, repeat_count=2, drop_last=False)
    with pytest.raises(ValueError, match="repeat_count=1"):
        repeat_iterable_dataset([], 2, batch_size=3, repeat_count=2, drop_last=False)


def test_repeat_sampler_shuffle_is_seeded_and_keeps_groups():
    data = list(range(10))
    a = list(RepeatSampler(data, mini_repeat_count=3, batch_size=2, shuffle=True, seed=7))
    b = list(RepeatSampler(data, mini_repeat_count=3, batch_size=2, shuffle=True, seed=7))
    assert a == b
    assert sorted(set(a)) == data  # every prompt once per epoch
    groups = [a[i : i + 3] for i in range(0, len(a), 3)]
    assert all(len(set(g)) == 1 for g in groups)  # G copies of one prompt, consecutive
    assert a != list(RepeatSampler(data, mini_repeat_count=3, batch_size=2, shuffle=True, seed=8))


def test_repeat_sampler_set_epoch_changes_the_permutation_reproducibly():
    sampler = RepeatSampler(list(range(16)), mini_repeat_count=1, shuffle=True, seed=0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch0 != epoch1
    resumed = RepeatSampler(list(range(16)), mini_repeat_count=1, shuffle=True, seed=0)
    resumed.set_epoch(1)
    assert list(resumed) == epoch1  # a resumed run sees the same prompts in a later epoch


def test_repeat_iterable_dataset_matches_sampler_order():
    rows = [{"prompt": str(i)} for i in range(7)]
    out = [r["prompt"] for r in repeat_iterable_dataset(rows, 2, batch_size=3, repeat_count=2, shuffle=False)]
    assert out == [str(i) for i in [0, 0, 1, 1, 2, 2] * 2 + [3, 3, 4, 4, 5, 5] * 2]


def test_repeat_iterable_dataset_shuffles_datasets_streams():
    from datasets import Dataset

    stream = Dataset.from_list([{"prompt": str(i)} for i in range(8)]).to_iterable_dataset()
    first = [r["prompt"] for r in repeat_iterable_dataset(stream, 2, batch_size=4, shuffle=True, seed=3)]
    again = [r["prompt"] for r in repeat_iterable_dataset(stream, 2, batch_size=4, shuffle=True, seed=3)]
    assert first == again and sorted(set(first)) == [str(i) for i in range(8)]
    assert all(first[i] == first[i + 1] for i in range(0, len(first), 2))


def test_batch_defaults_follow_gradient_accumulation():
    plan = resolve_generation_batch(
        per_device_train_batch_size=4, gradient_accumulation_steps=3, num_generations=4, world_size=2
    )
    assert (plan.steps_per_generation, plan.generation_batch_size) == (3, 24)
    assert plan.prompts_per_generation == 6 and plan.local_rows == 12


def test_generation_batch_size_sets_steps_per_generation():
    plan = resolve_generation_batch(
        per_device_train_batch_size=2, gradient_accumulation_steps=1, num_generations=2, generation_batch_size=8
    )
    assert plan.steps_per_generation == 4
    plan = resolve_generation_batch(
        per_device_train_batch_size=2, gradient_accumulation_steps=1, num_generations=2, steps_per_generation=3
    )
    assert plan.generation_batch_size == 6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(generation_batch_size=8, steps_per_generation=2),
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time",
        ),
        (dict(generation_batch_size=6), "generation_batch_size (6) must be divisible by the global batch size (4)."),
        (dict(num_generations=3), "generation_batch_size (4) must be divisible by num_generations (3)."),
        (
            dict(num_generations=1),
            "GRPO requires at least 2 generations per prompt to calculate the advantages. You provided 1, which is "
            "less than the minimum required.",
        ),
    ],
)
def test_batch_rule_errors_use_trl_messages(kwargs, message):
    base = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=2)
    with pytest.raises(ValueError) as err:
        resolve_generation_batch(**{**base, **kwargs})
    assert str(err.value) == message


def test_eval_batch_rule():
    check_eval_batch(4, 2, 8)
    with pytest.raises(ValueError, match=r"The global eval batch size \(3 \* 1\) must be divisible by the number"):
        check_eval_batch(3, 1, 2)
