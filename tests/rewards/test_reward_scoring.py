"""RewardScorer: TRL's calling convention, async concurrency, None handling, validation errors, reward models."""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np
import pytest
import torch

from posttrain.rewards import (
    RewardFunctionError,
    RewardScorer,
    get_soft_overlong_punishment,
    think_format_reward,
    validate_reward_func_signature,
)

PROMPTS = ["Say hi.", "Say bye."]
COMPLETIONS = ["<think>x</think>hi", "bye"]
IDS = [[1, 2, 3], [4]]


def score(scorer: RewardScorer, **extra) -> torch.Tensor:
    kwargs = dict(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, columns={})
    kwargs.update(extra)
    return scorer.score(**kwargs)


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def test_sync_functions_weights_and_names():
    overlong = get_soft_overlong_punishment(max_completion_len=3, soft_punish_cache=2)
    scorer = RewardScorer([think_format_reward, length_reward, overlong], reward_weights=[1.0, 0.5, 2.0])
    assert scorer.names == ["think_format_reward", "length_reward", "soft_overlong_punishment_reward"]
    assert torch.equal(scorer.weights, torch.tensor([1.0, 0.5, 2.0]))
    rewards = score(scorer)
    assert rewards.dtype == torch.float32 and rewards.shape == (2, 3)
    assert rewards.tolist() == [[1.0, 3.0, -1.0], [0.0, 1.0, 0.0]]


def test_keyword_arguments_follow_trl():
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return [0.0, 0.0]

    state, env = object(), ["env0", "env1"]
    scorer = RewardScorer([spy])
    columns = {"solution": ["1", "2"], "task": ["math", "code"], "prompt": ["dup", "dup"], "completion_ids": [[9]]}
    score(scorer, columns=columns, trainer_state=state)
    assert set(seen) == {
        "prompts", "completions", "completion_ids", "solution", "task", "trainer_state", "log_extra", "log_metric"
    }  # fmt: skip
    assert seen["prompts"] == PROMPTS and seen["completion_ids"] == IDS and seen["solution"] == ["1", "2"]
    assert seen["trainer_state"] is state
    seen.clear()
    score(scorer, environments=env)
    assert seen["environments"] is env


def test_log_extra_and_log_metric_are_passed_through():
    extra, metrics = {}, {}

    def logging_reward(completions, log_extra=None, log_metric=None, **kwargs):
        log_extra("golden", ["a", "b"])
        log_metric("accuracy", 0.5)
        return [1.0, 0.0]

    score(
        RewardScorer([logging_reward]),
        log_extra=lambda k, v: extra.__setitem__(k, v),
        log_metric=lambda k, v: metrics.__setitem__(k, v),
    )
    assert extra == {"golden": ["a", "b"]} and metrics == {"accuracy": 0.5}


def test_async_functions_run_concurrently_alongside_sync_ones():
    """All three async functions are in flight at once (counted, not timed, so machine load cannot flake it)."""
    state = {"running": 0, "peak": 0}

    async def track():
        state["running"] += 1
        state["peak"] = max(state["peak"], state["running"])
        await asyncio.sleep(0.05)
        state["running"] -= 1

    async def slow_a(completions, **kwargs):
        await track()
        return [1.0] * len(completions)

    async def slow_b(completions, **kwargs):
        await track()
        return [2.0, None]

    class AsyncCallable:
        __name__ = "async_callable"

        async def __call__(self, completions, **kwargs):
            await track()
            return [3.0] * len(completions)

    scorer = RewardScorer([slow_a, length_reward, slow_b, AsyncCallable()])
    assert scorer.names == ["slow_a", "length_reward", "slow_b", "async_callable"]
    rewards = score(scorer)
    assert state["peak"] == 3, f"async reward functions ran sequentially (peak concurrency {state['peak']})"
    assert rewards[:, 0].tolist() == [1.0, 1.0] and rewards[:, 1].tolist() == [3.0, 1.0]
    assert rewards[0, 2] == 2.0 and math.isnan(rewards[1, 2])
    assert rewards[:, 3].tolist() == [3.0, 3.0]


def test_none_becomes_nan_and_accepted_return_types():
    def with_none(completions, **kwargs):
        return [None, 0.5]

    def as_numpy(completions, **kwargs):
        return np.array([1.0, 2.0], dtype=np.float32)

    def as_tensor(completions, **kwargs):
        return torch.tensor([3, 4])

    def as_tuple_of_ints_and_bools(completions, **kwargs):
        return (1, True)

    rewards = score(RewardScorer([with_none, as_numpy, as_tensor, as_tuple_of_ints_and_bools]))
    assert math.isnan(rewards[0, 0]) and rewards[1, 0] == 0.5
    assert rewards[:, 1:].tolist() == [[1.0, 3.0, 1.0], [2.0, 4.0, 1.0]]


@pytest.mark.parametrize(
    ("output", "pattern"),
    [
        ([1.0], r"'bad' returned 1 values for 2 completions.*one value per completion"),
        (0.5, r"'bad' returned float 0.5.*Never return a single number"),
        (["good", 1.0], r"'bad' returned non-numeric or non-finite values at \[0\]='good'"),
        ([float("nan"), 1.0], r"'bad' returned non-numeric or non-finite values at \[0\]=nan.*None instead of NaN"),
        ([1.0, float("inf")], r"\[1\]=inf"),
        (np.zeros((2, 1)), r"'bad' returned an array of shape \(2, 1\)"),
        ({"a": 1}, r"'bad' returned dict"),
    ],
)
def test_bad_return_values_raise_naming_the_function(output, pattern):
    def bad(completions, **kwargs):
        return output

    with pytest.raises(RewardFunctionError, match=pattern):
        score(RewardScorer([length_reward, bad]))


def test_exceptions_are_wrapped_with_the_function_name():
    def crashes(completions, **kwargs):
        raise KeyError("solution")

    async def crashes_async(completions, **kwargs):
        raise RuntimeError("remote judge down")

    with pytest.raises(RewardFunctionError, match=r"'crashes' raised KeyError: 'solution'.*on_error='none'") as info:
        score(RewardScorer([crashes]))
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RewardFunctionError, match="'crashes_async' raised RuntimeError: remote judge down"):
        score(RewardScorer([crashes_async]))

    def no_kwargs(completions):
        return [0.0, 0.0]

    with pytest.raises(RewardFunctionError, match="'no_kwargs' raised TypeError.*unexpected keyword"):
        score(RewardScorer([no_kwargs]))


def test_on_error_none_records_failures_and_counts_them(caplog):
    def crashes(completions, **kwargs):
        raise ValueError("boom")

    def half_nan(completions, **kwargs):
        return [float("nan"), 2.0]

    async def wrong_length(completions, **kwargs):
        return [1.0]

    scorer = RewardScorer([crashes, half_nan, wrong_length, length_reward], on_error="none")
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.scoring"):
        rewards = score(scorer)
        rewards = score(scorer)
    assert torch.isnan(rewards[:, 0]).all() and torch.isnan(rewards[:, 2]).all()
    assert math.isnan(rewards[0, 1]) and rewards[1, 1] == 2.0
    assert rewards[:, 3].tolist() == [3.0, 1.0]
    assert scorer.failure_counts == {"crashes": 4, "half_nan": 2, "wrong_length": 4, "length_reward": 0}
    warned = [r.getMessage() for r in caplog.records]
    assert sum("'crashes'" in m for m in warned) == 1  # warned once per function, then only counted


def test_rows_nobody_scores_warn_once(caplog):
    """Logged through `logging` with TRL's phrase first (TRL logs it with logger.warning), once per scorer."""

    def only_first(completions, **kwargs):
        return [1.0, None]

    def never(completions, **kwargs):
        return [None, None]

    scorer = RewardScorer([only_first, never])
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.scoring"):
        rewards = score(scorer, columns={"solution": ["1", "2"]})
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert messages[0].startswith("All reward functions returned None for the following kwargs:\n")
    assert "'prompts': 'Say bye.'" in messages[0] and "1 of 2 completions" in messages[0]
    assert torch.isnan(rewards[1]).all() and rewards[0, 0] == 1.0
    caplog.clear()
    score(scorer)
    assert not [r for r in caplog.records if "returned None" in r.getMessage()]
    assert scorer.unscorable_count == 2


def test_reward_model_scores_prompt_plus_completion():
    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(padding_side="left")  # the scorer must still pad on the right
    model = build_tiny_model("qwen2", "sequence-classification", tokenizer=tokenizer)
    model.config.pad_token_id = None
    model.train()
    scorer = RewardScorer([model, length_reward], reward_processing_classes=[tokenizer, None])
    assert model.config.pad_token_id == tokenizer.pad_token_id and not model.training
    assert scorer.names[1] == "length_reward" and scorer.names[0]

    rewards = score(scorer)

    def expected(text: str) -> float:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            return model(**ids).logits[0, 0].item()

    assert rewards[:, 0].tolist() == pytest.approx([expected(p + c) for p, c in zip(PROMPTS, COMPLETIONS)], abs=1e-5)

    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    rewards = scorer.score(prompts=prompts, completions=completions, completion_ids=IDS, columns={})
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    assert rewards[:, 0].tolist() == pytest.approx([expected(t) for t in texts], abs=1e-5)


def test_constructor_validation():
    with pytest.raises(
        ValueError, match=r"Number of reward weights \(1\) must match number of reward functions \(2\)"
    ):
        RewardScorer([length_reward, think_format_reward], reward_weights=[1.0])
    with pytest.raises(ValueError, match="number of reward processing classes"):
        RewardScorer([length_reward], reward_processing_classes=[None, None])
    with pytest.raises(TypeError, match="resolve_reward_funcs"):
        RewardScorer(["accuracy_reward"])
    with pytest.raises(ValueError, match="on_error"):
        RewardScorer([length_reward], on_error="ignore")
    with pytest.raises(ValueError, match="completion_ids has 1 entries"):
        RewardScorer([length_reward]).score(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]], columns={})


def test_validate_reward_func_signature():
    def flexible(completions, **kwargs):
        return []

    def needs_solution(completions, solution, **kwargs):
        return []

    def strict(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, solution):
        return []

    def too_narrow(completions, solution):
        return []

    def positional_only(completions, /, **kwargs):
        return []

    validate_reward_func_signature(flexible)
    validate_reward_func_signature(needs_solution, ["prompt", "solution"])
    validate_reward_func_signature(strict, ["solution"])
    with pytest.raises(ValueError, match=r"'too_narrow'.*does not accept \*\*kwargs.*does not declare prompts"):
        validate_reward_func_signature(too_narrow, ["solution"])
    with pytest.raises(ValueError, match=r"requires 'solution'.*Add a dataset column named 'solution'"):
        validate_reward_func_signature(needs_solution, ["prompt", "answer"])
    with pytest.raises(ValueError, match=r"does not declare environments"):
        validate_reward_func_signature(strict, ["solution"], environments=True)
    with pytest.raises(ValueError, match="positional-only"):
        validate_reward_func_signature(positional_only)
