"""code_reward: program extraction, test-case formats, pass fractions, and the harness's resistance to fake passes."""

from __future__ import annotations

import json
import pickle

import pytest

from posttrain.rewards import (
    CodeReward,
    code_reward,
    extract_code,
    get_code_reward,
    normalize_test_cases,
    run_test_cases,
)

pytestmark = pytest.mark.usefixtures("sandbox_lock")  # host-wide checks: one sandbox test at a time

ADD = "def add(a, b):\n    return a + b\n"
ADD_BUGGY = "def add(a, b):\n    return a + b if a < 5 else 0\n"
SUM_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(7, 1) == 8"]


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{code}```\nDone."


def test_extract_code_prefers_the_last_python_block():
    text = "```python\nfirst()\n```\ntext\n```\nplain()\n```\n```py\nlast()\n```\n```bash\nls\n```"
    assert extract_code(text) == "last()\n"
    assert extract_code("```\nonly_plain()\n```") == "only_plain()\n"
    assert extract_code("no fences at all") == "no fences at all"
    assert extract_code("```python\ncut_off_at_the_length_limit()") == "cut_off_at_the_length_limit()"


def test_normalize_test_case_formats():
    assert normalize_test_cases(None) is None
    assert normalize_test_cases([]) is None
    assert normalize_test_cases("  ") is None
    assert normalize_test_cases(ADD_TESTS) == ("asserts", ADD_TESTS)
    assert normalize_test_cases("assert f(1) == 1\nassert f(2) == (\n    2)") == (
        "asserts",
        ["assert f(1) == 1", "assert f(2) == (\n    2)"],
    )
    io = [{"input": "1 2\n", "output": "3\n"}]
    assert normalize_test_cases(io) == ("io", [("1 2\n", "3\n")])
    assert normalize_test_cases(json.dumps(io)) == ("io", [("1 2\n", "3\n")])
    assert normalize_test_cases({"inputs": ["1 2"], "outputs": ["3"]}) == ("io", [("1 2", "3")])
    info = {"language": "python", "test_cases": [{"input": "1 2", "output": "3", "type": "stdin_stdout"}]}
    assert normalize_test_cases(info) == ("io", [("1 2", "3")])
    assert normalize_test_cases({"language": "cpp", "test_cases": io}) is None


def test_unknown_test_format_names_the_column():
    with pytest.raises(ValueError, match="Column 'verification_info'.*unknown format"):
        normalize_test_cases([{"stdin": "1"}], column="verification_info")
    with pytest.raises(ValueError, match="'inputs' has 2 entries but 'outputs' has 1"):
        normalize_test_cases({"inputs": ["1", "2"], "outputs": ["1"]})


@pytest.mark.parametrize("isolation", ["auto"])
def test_assert_tests_give_pass_fractions(isolation):
    completions = [fenced(ADD), fenced(ADD_BUGGY), fenced("syntax error here ("), ""]
    rewards = get_code_reward(isolation=isolation)(completions, tests=[ADD_TESTS] * 4)
    assert rewards == [1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("isolation", ["auto"])
def test_stdin_stdout_cases_and_conversational_completions(isolation):
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"}, {"input": "0 0", "output": "1"}]
    conversational = [{"role": "user", "content": "?"}, {"role": "assistant", "content": fenced(SUM_STDIN)}]
    reward = get_code_reward(isolation=isolation)
    rewards = reward([fenced(SUM_STDIN), conversational], test_cases=[cases, cases])
    assert rewards == pytest.approx([2 / 3, 2 / 3])


def test_rows_without_tests_get_none_and_columns_can_mix():
    rewards = code_reward(
        [fenced(ADD), fenced(SUM_STDIN), fenced(ADD)],
        tests=[ADD_TESTS, None, None],
        verification_info=[None, json.dumps({"test_cases": [{"input": "2 3", "output": "5"}]}), None],
    )
    assert rewards == [1.0, 1.0, None]


def test_fake_passes_do_not_count():
    exits = [
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "print('\\nposttrain-pass-0000 0\\nposttrain-pass-0000 1')\n",
        "def add(a, b):\n    import os\n    os._exit(0)\n",
    ]
    rewards = code_reward([fenced(c) for c in exits], tests=[ADD_TESTS] * len(exits))
    assert rewards == [0.0, 0.0, 0.0, 0.0]


def test_a_hanging_test_keeps_credit_for_earlier_tests():
    code = "def f(x):\n    while x > 5:\n        pass\n    return x\n"
    tests = ["assert f(1) == 1", "assert f(2) == 2", "assert f(9) == 9"]
    reward = run_test_cases(code, tests, timeout=1.0)
    assert reward == pytest.approx(2 / 3)


def test_missing_test_column_is_an_error():
    with pytest.raises(ValueError, match="'test_cases', 'tests' or 'verification_info'"):
        code_reward(["x"], solution=["1"])
    with pytest.raises(ValueError, match="Column 'tests' has 1 entries for 2 completions"):
        code_reward(["x", "y"], tests=[ADD_TESTS])


def test_code_reward_factory_is_picklable_and_named():
    reward = get_code_reward(timeout=2.0, max_workers=2)
    assert isinstance(reward, CodeReward) and reward.__name__ == "code_reward"
    assert reward([fenced(ADD)], tests=[ADD_TESTS]) == [1.0]  # creates the thread pool
    clone = pickle.loads(pickle.dumps(reward))
    assert clone.timeout == 2.0 and clone.max_workers == 2
    assert clone([fenced(ADD_BUGGY)], tests=[ADD_TESTS]) == [0.5]
    assert pickle.loads(pickle.dumps(code_reward)) is code_reward
    with pytest.raises(ValueError, match="timeout"):
        get_code_reward(timeout=0)


def test_only_the_solution_calls_enter_the_sandbox():
    from posttrain.rewards._code_grading import plan_tests

    plan = plan_tests(
        [
            "import math",
            "assert add(1, 2) == 3",
            "assert abs(area(2.0) - 12.566) < 1e-3",
            "assert sorted(pair(9)) == [4, 5]",
            "EXPECTED = [7, 8]",
            "assert twice([3, 4]) == EXPECTED",
            "def check(candidate):\n    assert candidate(10) == 11\n    assert not candidate(-1)\ncheck(inc)",
        ]
    )
    shipped = [op["e"] for op in plan.ops if "e" in op]
    assert shipped == ["add(1, 2)", "area(2.0)", "pair(9)", "twice([3, 4])", "inc(10)", "inc(-1)"]
    # the literal assignment (an expected value) and the check() definition stay in the parent
    assert [op["x"] for op in plan.ops if "x" in op] == ["import math"]
    assert len(plan.tests) == 6


def test_parent_side_grading_of_common_assert_forms():
    code = (
        "import math\n"
        "def area(r):\n    return math.pi * r * r\n"
        "def pair(n):\n    return (n // 2 + 1, n // 2)\n"
        "def evens(n):\n    return {i for i in range(n) if i % 2 == 0}\n"
        "def counts(s):\n    return {c: s.count(c) for c in s}\n"
        "def nothing():\n    return None\n"
        "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n"
    )
    tests = [
        "assert math.isclose(area(1.0), 3.14159, rel_tol=1e-5)",
        "assert abs(area(2.0) - 12.566) < 1e-3",
        "assert sorted(pair(9)) == [4, 5]",
        "assert pair(9) == (5, 4)",
        "assert pair(9) == [5, 4]",  # a tuple is not a list: fails, as it would in Python
        "assert evens(5) == {0, 2, 4}",
        "assert counts('aab') == {'a': 2, 'b': 1}",
        "assert nothing() is None",
        "assert Solution().twoSum([2, 7], 9) == [0, 1]",
        "assert [x * 2 for x in pair(4)] == [6, 4]",
    ]
    assert run_test_cases(code, tests) == pytest.approx(9 / 10)


def test_loops_and_comprehensions_over_test_values_are_unrolled():
    tests = [
        "for a, b in [(1, 2), (3, 4)]:\n    assert add(a, b) == a + b",
        "assert all(add(i, i) == 2 * i for i in range(3))",
        "assert [add(x, 1) for x in (1, 2) if x > 1] == [3]",
    ]
    assert run_test_cases(ADD, tests) == 1.0
    assert run_test_cases(ADD_BUGGY, tests) == 1.0  # every value here is below 5: the buggy branch is never hit
    assert run_test_cases(ADD_BUGGY, ["for a in (1, 7):\n    assert add(a, 1) == a + 1"]) == 0.5


def test_humaneval_check_function_is_inlined():
    tests = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(7, 1) == 8\n\ncheck(add)\n"
    assert run_test_cases(ADD, tests) == 1.0
    assert run_test_cases(ADD_BUGGY, tests) == 0.5


def test_ungradable_asserts_fail_and_setup_only_rows_score_none(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="posttrain.rewards._code_grading"):
        score = run_test_cases(ADD, ["while True:\n    assert add(1, 1) == 2\n    break", "assert add(1, 2) == 3"])
    assert score == 0.5 and "counted as failed" in caplog.text
    assert run_test_cases(ADD, ["import math", "x = add(1, 2)"]) is None


def test_answers_are_strict_plain_json():
    from posttrain.rewards._code_grading import decode_answers

    ok, answers = decode_answers(
        '{"solution": "ok"}\n'
        '{"k": 0, "v": NaN}\n'  # not strict JSON
        '{"k": 1, "v": {"$": "tuple", "v": [1, 2]}}\n'
        '{"k": 1, "v": 5}\n'  # a second answer for the same call is ignored
        '{"k": 2, "v": {"$": "Anything", "v": 1}}\n'  # unknown tag: an error, never a value
        '{"k": 3, "v": {"a": 1}}\n'  # a bare object is not one of the encodings
        '{"k": 4, "v": {"$": "float", "v": "nan"}}\n'
        "not json\n"
    )
    assert ok
    assert 0 not in answers and answers[1] == (1, 2) and type(answers[1]) is tuple
    from posttrain.rewards._code_grading import _ERROR

    assert answers[2] is _ERROR and answers[3] is _ERROR
    assert answers[4] != answers[4]  # nan
    assert decode_answers('{"k": 0, "v": 3}\n') == (False, {0: 3})  # the solution never reported running
