"""TRL's built-in rewards on hand-written completions, in standard and conversational format."""

from __future__ import annotations

import pickle
import sys
import threading

import pytest

from posttrain.rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)

THIRD = r"\frac{1}{3}"


def conv(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("wrap", [lambda t: t, conv], ids=["standard", "conversational"])
def test_accuracy_reward_boxed_answers(wrap):
    completions = [wrap(r"My answer is \boxed{\frac{1}{3}}"), wrap(r"My answer is \boxed{\frac{1}{2}}")]
    assert accuracy_reward(completions, [THIRD, THIRD]) == [1.0, 0.0]


def test_accuracy_reward_latex_vs_plain_numbers_and_edge_cases():
    completions = [
        r"\boxed{0.5}",  # plain gold, boxed decimal
        r"The answer is $\frac{1}{2}$.",  # LaTeX answer equals the gold 0.5
        "The answer is 0.5",  # no LaTeX anchor: not extracted (try_extract_without_anchor=False)
        r"\boxed{3}",
        "",  # empty completion
        r"\boxed{4}",
    ]
    solutions = ["0.5", "$0.5$", "0.5", "3", "3", "$3$"]
    assert accuracy_reward(completions, solutions) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_accuracy_reward_unparseable_gold_is_none_and_logs_extra_columns():
    logged = {}
    rewards = accuracy_reward(
        [r"\boxed{1}", r"\boxed{1}"], ["hello world", "$1$"], log_extra=lambda k, v: logged.__setitem__(k, v)
    )
    assert rewards == [None, 1.0]
    assert logged["solution"] == ["hello world", "$1$"]
    assert logged["gold_parsed"][0] == "[unparseable]" and logged["answer_parsed"][0] == "[skipped]"
    assert set(logged) == {"solution", "gold_parsed", "answer_parsed"}


def test_accuracy_reward_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        accuracy_reward([r"\boxed{1}"], ["1", "2"])


def test_accuracy_reward_off_the_main_thread():
    # math_verify's signal-based timeouts only work in the main thread; elsewhere they must be disabled, not crash.
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", accuracy_reward([r"\boxed{2}"], ["2"])))
    thread.start()
    thread.join()
    assert out["r"] == [1.0]


def test_accuracy_reward_explains_missing_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"posttrain\[math\]"):
        accuracy_reward(["x"], ["1"])


@pytest.mark.parametrize("wrap", [lambda t: t, conv], ids=["standard", "conversational"])
def test_reasoning_accuracy_reward(wrap):
    completions = [
        wrap(r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{3}}"),
        wrap(r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{2}}"),
        wrap(r"<think> Reasoning with partial answers \boxed{\frac{1}{3}} but no final answer"),
        wrap(r"<think> \boxed{\frac{1}{3}} </think> a </think> The final answer is \boxed{\frac{1}{2}}"),
    ]
    assert reasoning_accuracy_reward(completions, [THIRD] * 4) == [1.0, 0.0, 0.0, 0.0]
    assert reasoning_accuracy_reward([wrap(r"</think> \boxed{1}")], ["not math at all"]) == [None]


def test_reasoning_accuracy_reward_custom_delimiters_in_list_order():
    delimiters = ["[END]", "</think>"]
    # "[END]" is first in the list, so only what follows its last occurrence is graded.
    text = r"\boxed{9} </think> \boxed{2} [END] \boxed{5} [END] \boxed{1}"
    assert reasoning_accuracy_reward([text, text], ["1", "2"], reasoning_delimiters=delimiters) == [1.0, 0.0]
    # Absent first delimiter: the next one in the list is used.
    text = r"\boxed{9} </think> \boxed{1}"
    assert reasoning_accuracy_reward([text], ["1"], reasoning_delimiters=delimiters) == [1.0]


@pytest.mark.parametrize("wrap", [lambda t: t, conv], ids=["standard", "conversational"])
def test_think_format_reward(wrap):
    cases = {
        "<think>\nThis is my reasoning.\n</think>\nThis is my answer.": 1.0,
        "<think>\nThis is my reasoning.\nThis is my answer.": 0.0,  # unclosed
        "<think>a<think>b</think>c</think>": 0.0,  # nested
        "<think>a</think> answer <think>again</think>": 0.0,  # a second block
        "Preamble <think>a</think>": 0.0,  # must start with the block
        "<think></think>": 1.0,
        "": 0.0,
    }
    assert think_format_reward([wrap(t) for t in cases]) == list(cases.values())


def test_soft_overlong_punishment_is_piecewise():
    reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert reward.__name__ == "soft_overlong_punishment_reward"
    lengths = [0, 80, 81, 90, 100, 101, 500]
    expected = [0.0, 0.0, -1 / 20, -0.5, -1.0, -1.0, -1.0]
    assert reward(completion_ids=[[1] * n for n in lengths]) == pytest.approx(expected)
    no_cache = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=0)
    assert no_cache(completion_ids=[[1] * 10, [1] * 11]) == [0.0, -1.0]
    with pytest.raises(ValueError, match="soft_punish_cache"):
        get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=-1)


def test_repetition_penalty_reward():
    reward = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    assert reward.__name__ == "repetition_penalty_reward"
    assert reward(completion_ids=[[1, 2, 3, 4], [5, 5, 5, 5, 5], [7], []]) == [0.0, -0.75, 0.0, 0.0]
    # 3-grams of [1,2,1,2,1,2]: (1,2,1),(2,1,2),(1,2,1),(2,1,2) -> 2 unique of 4 -> 0.5 * -0.5
    assert get_repetition_penalty_reward(3, -0.5)(completion_ids=[[1, 2, 1, 2, 1, 2]]) == [-0.25]
    with pytest.raises(ValueError, match="max_penalty 0.5 should not be positive"):
        get_repetition_penalty_reward(max_penalty=0.5)
    with pytest.raises(ValueError, match="ngram_size must be greater than 0"):
        get_repetition_penalty_reward(ngram_size=0)


@pytest.mark.parametrize("wrap", [lambda t: t, conv], ids=["standard", "conversational"])
def test_cosine_scaled_reward(wrap):
    reward = get_cosine_scaled_reward(max_len=100)
    assert reward.__name__ == "cosine_scaled_reward"
    right, wrong = wrap(r"\boxed{\frac{1}{3}}"), wrap(r"\boxed{\frac{1}{2}}")
    assert reward([right, wrong], [THIRD] * 2, [[1] * 50] * 2) == pytest.approx([0.75, -0.75])
    # Shortest: correct -> max_value_correct, wrong -> min_value_wrong; at/after max_len (clamped): the other bound.
    assert reward([right, wrong], [THIRD] * 2, [[], []]) == pytest.approx([1.0, -1.0])
    assert reward([right, wrong], [THIRD] * 2, [[1] * 100, [1] * 300]) == pytest.approx([0.5, -0.5])
    assert reward([right], ["not math"], [[1] * 10]) == [None]


def test_factories_pickle_and_keep_their_settings():
    for reward in (
        get_soft_overlong_punishment(512, 64),
        get_repetition_penalty_reward(4, -0.3),
        get_cosine_scaled_reward(64, min_value_correct=0.2),
    ):
        clone = pickle.loads(pickle.dumps(reward))
        assert type(clone) is type(reward) and clone.__name__ == reward.__name__
        assert vars(clone) == vars(reward)
    assert get_cosine_scaled_reward(64)(completions=[r"\boxed{1}"], solution=["1"], completion_ids=[[1] * 64]) == [
        pytest.approx(0.5)
    ]
