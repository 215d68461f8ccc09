"""Code-execution reward: run each completion's Python against its test cases in the sandbox.

``code_reward`` reads the test cases from whichever of the dataset columns ``test_cases``, ``tests`` or
``verification_info`` is present, extracts the program from the completion (the last fenced ```python block, else
the last fenced block, else the whole text), runs it with :mod:`posttrain.rewards.sandbox`, and returns the pass
fraction per completion (``None`` for rows without tests). Runs of a batch go through a bounded thread pool; each
sandboxed run is its own process, so threads only wait.

Test-case formats (per row):
    - assert statements: ``["assert f(1) == 2", ...]`` or one string holding several statements (MBPP/HumanEval
      style). Graded in this (trusted) process, see :mod:`posttrain.rewards._code_grading`: each ``assert`` is
      parsed with ``ast``; only its calls of the solution (``f(1)``) go into the sandbox, which runs the program
      once, evaluates them and returns their values as plain JSON data; the comparison with the expected value
      happens here. Expected values never enter the sandbox, and nothing the program prints, returns or patches
      can claim a pass. Other statements (imports, helpers) run in the sandbox as setup and are not tests;
      HumanEval's ``def check(candidate): ...`` + ``check(f)`` is inlined. The score is the fraction of asserts
      that pass.
    - stdin/stdout cases: ``[{"input": "1 2\\n", "output": "3\\n"}, ...]`` or ``{"inputs": [...], "outputs": [...]}``
      (APPS style). One run per case; a case passes when the program exits 0 and its stdout equals the expected
      output up to trailing whitespace on each line and trailing blank lines.
    - ``verification_info``: a dict (or its JSON string) with ``test_cases`` in either format above and optionally
      ``language`` (only Python is supported; other languages score ``None``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from posttrain.rewards import _code_grading
from posttrain.rewards.sandbox import Isolation, SandboxResult, run_files
from posttrain.rewards.text import completion_text

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}
_ANSWER_BYTES = 4 << 20  # output cap of an assert run: the answers to all its calls


def extract_code(text: str) -> str:
    """The program in a completion: the last fenced ```python block, else the last fenced block, else the text.

    An unclosed final fence (a completion cut at the length limit) counts as running to the end of the text.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    python_blocks = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python_blocks:
        return python_blocks[-1]
    if blocks:
        return blocks[-1][1]
    return text


def _split_statements(source: str) -> list[str]:
    """Top-level statements of a block of asserts, each as its own test (unparseable text stays one test)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return [source]
    return [ast.get_source_segment(source, node) or "" for node in tree.body]


def normalize_test_cases(tests: Any, *, column: str = "tests") -> tuple[str, list] | None:
    """Parse one row's tests into ``("asserts", [statement, ...])`` or ``("io", [(stdin, stdout), ...])``.

    Returns ``None`` when the row has no tests (``None``, empty) or they are for a language other than Python.

    Raises:
        ValueError: for a format this function does not know; the message names ``column`` and the formats.
    """
    if tests is None:
        return None
    if isinstance(tests, str):
        stripped = tests.strip()
        if not stripped:
            return None
        if stripped[0] in "[{":
            try:
                return normalize_test_cases(json.loads(stripped), column=column)
            except json.JSONDecodeError:
                pass
        return "asserts", _split_statements(tests)
    if isinstance(tests, dict):
        if "test_cases" in tests:
            language = str(tests.get("language", "python")).lower()
            if language not in _PYTHON_TAGS:
                return None
            return normalize_test_cases(tests["test_cases"], column=column)
        if "inputs" in tests and "outputs" in tests:
            inputs, outputs = list(tests["inputs"]), list(tests["outputs"])
            if len(inputs) != len(outputs):
                raise ValueError(
                    f"Column {column!r}: 'inputs' has {len(inputs)} entries but 'outputs' has {len(outputs)}; "
                    "they must pair up one to one."
                )
            return ("io", [(_as_text(i), _as_text(o)) for i, o in zip(inputs, outputs)]) if inputs else None
    if isinstance(tests, (list, tuple)):
        if not tests:
            return None
        if all(isinstance(t, str) for t in tests):
            return "asserts", [t for t in tests if t.strip()]
        if all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
            return "io", [(_as_text(t["input"]), _as_text(t["output"])) for t in tests]
    raise ValueError(
        f"Column {column!r} holds test cases in an unknown format: {tests!r:.300}. Use a list of assert statements "
        "(['assert f(1) == 2']), a list of stdin/stdout cases ([{'input': '1 2\\n', 'output': '3\\n'}]), "
        "{'inputs': [...], 'outputs': [...]}, or {'test_cases': <one of those>, 'language': 'python'}."
    )


def _as_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):  # some datasets store stdin/stdout as a list of lines
        return "\n".join(str(v) for v in value) + "\n"
    return str(value)


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


class _Runner:
    """Sandbox limits shared by the runs of one reward call."""

    def __init__(
        self,
        timeout: float,
        memory_mb: int,
        max_output_bytes: int,
        isolation: Isolation,
    ):
        self.timeout = timeout
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.isolation = isolation

    def run(self, files: dict[str, str], stdin: str | None, min_output_bytes: int = 0) -> SandboxResult:
        return run_files(
            files,
            "main.py",
            stdin=stdin,
            timeout=self.timeout,
            memory_mb=self.memory_mb,
            max_output_bytes=max(self.max_output_bytes, min_output_bytes),
            isolation=self.isolation,
        )

    def asserts(self, code: str, tests: list[str]) -> float | None:
        plan = _code_grading.plan_tests(tests)
        if not plan.tests:
            return None
        request = json.dumps({"ops": plan.ops})
        # Only the solution and the solution-dependent calls enter the sandbox; the answers come back as plain
        # data and the assertions are evaluated here.
        result = self.run(
            {"main.py": _code_grading.HARNESS, "solution.py": code},
            stdin=request,
            min_output_bytes=_ANSWER_BYTES,
        )
        solution_ran, answers = _code_grading.decode_answers(result.stdout)
        passed = _code_grading.grade(plan, solution_ran, answers)
        return sum(passed) / len(passed)

    def io_case(self, code: str, stdin: str, expected: str) -> float:
        # The cap must leave room for the expected answer itself.
        result = self.run({"main.py": code}, stdin=stdin, min_output_bytes=2 * len(expected.encode()) + 1024)
        return float(result.ok and _normalize_output(result.stdout) == _normalize_output(expected))


def run_test_cases(
    code: str,
    tests: Any,
    *,
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    isolation: Isolation = "auto",
    executor: Executor | None = None,
) -> float | None:
    """Fraction of ``tests`` that ``code`` passes, run in the sandbox.

    Args:
        code: The Python program (already extracted from the completion).
        tests: Assert statements, stdin/stdout cases, or a ``verification_info`` dict (see the module docstring).
        timeout: Wall-clock seconds per sandboxed run (all asserts share one run; each stdin/stdout case has its own).
        memory_mb: Memory limit per sandboxed run (all its processes; per process without a cgroup).
        max_output_bytes: Output cap per run (raised automatically to fit a long expected output).
        isolation: Sandbox isolation level (see :func:`posttrain.rewards.sandbox.run_python`).
        executor: Runs stdin/stdout cases in parallel when given; otherwise they run one after another.

    Returns:
        The pass fraction in [0, 1], or ``None`` when there are no (Python) tests.
    """
    parsed = normalize_test_cases(tests)
    if parsed is None:
        return None
    runner = _Runner(timeout, memory_mb, max_output_bytes, isolation)
    kind, cases = parsed
    if kind == "asserts":
        return runner.asserts(code, cases)
    if executor is None:
        scores = [runner.io_case(code, i, o) for i, o in cases]
    else:
        scores = [f.result() for f in [executor.submit(runner.io_case, code, i, o) for i, o in cases]]
    return sum(scores) / len(scores)


class CodeReward:
    """Pass-fraction reward over sandboxed test runs (see :func:`get_code_reward`).

    Picklable: the thread pool is created lazily and not pickled.
    """

    __name__ = "code_reward"

    def __init__(
        self,
        timeout: float = 5.0,
        memory_mb: int = 512,
        max_output_bytes: int = 65536,
        max_workers: int | None = None,
        isolation: Isolation = "auto",
    ):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}.")
        self.timeout = timeout
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.max_workers = max_workers or min(4, os.cpu_count() or 1)
        self.isolation = isolation
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_executor"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix="posttrain-sandbox")
            return self._executor

    def __call__(
        self,
        completions: list,
        test_cases: Sequence | None = None,
        tests: Sequence | None = None,
        verification_info: Sequence | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        columns = {"test_cases": test_cases, "tests": tests, "verification_info": verification_info}
        present = {name: values for name, values in columns.items() if values is not None}
        if not present:
            raise ValueError(
                "code_reward needs a dataset column with the test cases: 'test_cases', 'tests' or "
                "'verification_info' (one entry per prompt). None of them was passed."
            )
        for name, values in present.items():
            if len(values) != len(completions):
                raise ValueError(
                    f"Column {name!r} has {len(values)} entries for {len(completions)} completions; it must have "
                    "one per completion (the trainer repeats each prompt's columns per generation)."
                )
        runner = _Runner(self.timeout, self.memory_mb, self.max_output_bytes, self.isolation)
        pool = self._pool()
        jobs: list[tuple[int, str, Any]] = []  # (row, kind, future)
        rows_with_tests: set[int] = set()
        for row, completion in enumerate(completions):
            spec = next((values[row] for name, values in present.items() if values[row] is not None), None)
            column = next((name for name, values in present.items() if values[row] is not None), "tests")
            parsed = normalize_test_cases(spec, column=column)
            if parsed is None:
                continue
            rows_with_tests.add(row)
            code = extract_code(completion_text(completion, which="last_assistant"))
            kind, cases = parsed
            if kind == "asserts":
                jobs.append((row, kind, pool.submit(runner.asserts, code, cases)))
            else:
                jobs.extend((row, kind, pool.submit(runner.io_case, code, i, o)) for i, o in cases)
        totals: dict[int, list[float]] = {row: [] for row in rows_with_tests}
        for row, _, future in jobs:
            score = future.result()
            if score is not None:  # None: the row's statements hold no test (only setup)
                totals[row].append(score)
        return [sum(totals[r]) / len(totals[r]) if totals.get(r) else None for r in range(len(completions))]

    def __repr__(self) -> str:
        return (
            f"get_code_reward(timeout={self.timeout}, memory_mb={self.memory_mb}, "
            f"max_output_bytes={self.max_output_bytes}, max_workers={self.max_workers}, isolation={self.isolation!r})"
        )


def get_code_reward(
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    max_workers: int | None = None,
    isolation: Isolation = "auto",
) -> CodeReward:
    """Build a ``code_reward`` with custom sandbox limits.

    Args:
        timeout: Wall-clock seconds per sandboxed run.
        memory_mb: Memory limit per sandboxed run (all its processes; per process without a cgroup).
        max_output_bytes: Output cap per run.
        max_workers: Concurrent sandboxed runs; defaults to ``min(4, os.cpu_count())``.
        isolation: ``"auto"``, ``"strict"`` or the weak opt-in ``"basic"`` (see :mod:`posttrain.rewards.sandbox`).

    Returns:
        A picklable callable ``(completions, test_cases=None, tests=None, verification_info=None, **kwargs)``
        named ``code_reward``.
    """
    return CodeReward(timeout, memory_mb, max_output_bytes, max_workers, isolation)


_default: CodeReward | None = None
_default_lock = threading.Lock()


def code_reward(
    completions: list,
    test_cases: Sequence | None = None,
    tests: Sequence | None = None,
    verification_info: Sequence | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Fraction of its test cases each completion's program passes, run in the sandbox with default limits.

    Args:
        completions: Standard or conversational completions; the program is taken from the last assistant message
            (last fenced ```python block, else last fenced block, else the whole text).
        test_cases, tests, verification_info: The dataset column with the row's tests (the first one present is
            used); formats in the module docstring.
        **kwargs: Other columns and trainer arguments, ignored.

    Returns:
        Pass fraction in [0, 1] per completion, ``None`` for rows without (Python) tests.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = CodeReward()
    return _default(completions, test_cases=test_cases, tests=tests, verification_info=verification_info)
