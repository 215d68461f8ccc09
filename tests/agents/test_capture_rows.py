"""``captured_rows``: captured chat calls → training rows whose mask covers exactly the model's sampled tokens."""

from __future__ import annotations

import pytest

from posttrain.agents.capture import AgentRolloutFunc, captured_rows


def _call(index, prompt, *choices, version=0):
    return {"index": index, "prompt_token_ids": list(prompt), "version": version,
            "completions": [{"token_ids": list(ids), "logprobs": [-0.1 * (k + 1) for k in range(len(ids))],
                             "finish_reason": "stop"} for ids in choices]}  # fmt: skip


def test_extending_calls_merge_into_one_row_masked_on_model_tokens():
    calls = [
        _call(0, [1, 2, 3], [10, 11]),
        _call(1, [1, 2, 3, 10, 11, 50, 51, 52], [12], version=1),  # the agent appended a tool output
        _call(2, [1, 2, 3, 10, 11, 50, 51, 52, 12, 60], [13, 14], version=1),
    ]
    (row,) = captured_rows(calls)
    assert row.prompt_ids == [1, 2, 3]
    assert row.completion_ids == [10, 11, 50, 51, 52, 12, 60, 13, 14]
    assert row.env_mask == [1, 1, 0, 0, 0, 1, 0, 1, 1]
    assert row.logprobs == pytest.approx([-0.1, -0.2, 0, 0, 0, -0.1, 0, -0.1, -0.2])
    assert row.versions == [0, 1, 1] and row.version == 0 and row.calls == [0, 1, 2]
    model_tokens = [t for t, m in zip(row.completion_ids, row.env_mask) if m]
    assert model_tokens == [10, 11, 12, 13, 14]


def test_rewritten_history_starts_new_rows():
    calls = [
        _call(0, [1, 2], [10, 11]),
        _call(1, [1, 2, 10, 11, 7], [12]),
        _call(2, [1, 2, 99, 7], [13]),  # the history was rewritten: 10, 11 re-tokenised as 99
        _call(3, [1, 2, 99, 7, 13, 8], [14]),
        _call(4, [5], [15]),  # a fresh conversation
    ]
    rows = captured_rows(calls)
    assert [r.prompt_ids for r in rows] == [[1, 2], [1, 2, 99, 7], [5]]
    assert [r.completion_ids for r in rows] == [[10, 11, 7, 12], [13, 8, 14], [15]]
    assert [r.env_mask for r in rows] == [[1, 1, 0, 1], [1, 0, 1], [1]]
    assert [r.calls for r in rows] == [[0, 1], [2, 3], [4]]


def test_the_choice_the_agent_continued_with_is_kept():
    calls = [_call(0, [1], [20], [30, 31]), _call(1, [1, 30, 31, 4], [40])]  # n=2: the agent took choice 1
    (row,) = captured_rows(calls)
    assert row.completion_ids == [30, 31, 4, 40] and row.env_mask == [1, 1, 0, 1]
    assert row.logprobs == pytest.approx([-0.1, -0.2, 0.0, -0.1])


def test_calls_are_ordered_by_capture_index_and_checked():
    calls = [_call(1, [1, 5, 6], [7]), _call(0, [1], [5])]
    (row,) = captured_rows(calls)
    assert row.completion_ids == [5, 6, 7] and row.env_mask == [1, 0, 1]
    bad = _call(0, [1], [5])
    bad["completions"][0]["logprobs"] = []
    with pytest.raises(ValueError, match=r"calls\[0\].completions\[0\] needs one log-prob per token"):
        captured_rows([bad])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        captured_rows([{"completions": []}])


def test_multi_row_policy_and_argument_checks():
    rows = captured_rows([_call(0, [1], [2]), _call(1, [3], [4])])
    assert AgentRolloutFunc(lambda *a: 0.0)._row(rows, "r").completion_ids == [4]
    with pytest.raises(ValueError, match="gave 2 training rows"):
        AgentRolloutFunc(lambda *a: 0.0, multi_row="error")._row(rows, "r")
    with pytest.raises(ValueError, match="multi_row must be one of"):
        AgentRolloutFunc(lambda *a: 0.0, multi_row="first")
    with pytest.raises(TypeError, match="agent must be"):
        AgentRolloutFunc("python agent.py")
