"""Math-correctness rewards: ``accuracy_reward``, ``reasoning_accuracy_reward``, ``get_cosine_scaled_reward``.

Correctness is decided by ``math_verify`` (imported lazily; ``pip install posttrain[math]``). The gold ``solution``
is parsed with math_verify's default extraction; when that finds nothing the row is unscorable and gets ``None``
(skipped by the trainer) rather than 0.0, so bad gold answers are excluded instead of punishing the policy. The
completion is parsed with LaTeX extraction only (``\\boxed{}`` tried first via ``boxed_match_priority=0``, units
normalised, ``try_extract_without_anchor=False`` so stray numbers are not taken as the answer, first match wins).

math_verify implements its timeouts with ``signal.alarm``, which only works in the main thread: parse 10 s and
verify 5 s there, no timeouts in other threads (e.g. the async reward loop).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from posttrain.rewards.text import completion_texts

_PARSE_TIMEOUT, _VERIFY_TIMEOUT = 10, 5


def _math_verify() -> tuple[Any, Any, Any, Any]:
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as e:
        raise ImportError(
            "accuracy_reward, reasoning_accuracy_reward and get_cosine_scaled_reward need the `math-verify` package: "
            "pip install 'posttrain[math]' (or pip install math-verify)."
        ) from e
    return NormalizationConfig, LatexExtractionConfig, parse, verify


def _timeouts() -> tuple[int | None, int | None]:
    if threading.current_thread() is threading.main_thread():
        return _PARSE_TIMEOUT, _VERIFY_TIMEOUT
    # Timeouts are off by design here; silence math_verify's "timeout is disabled" warnings.
    logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
    logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    return None, None


class _Verifier:
    """Parses gold and answer with TRL's configs and verifies them; one instance per batch."""

    def __init__(self):
        normalization_config, latex_config, self.parse, self.verify = _math_verify()
        self.answer_config = [
            latex_config(
                normalization_config=normalization_config(units=True),
                boxed_match_priority=0,
                try_extract_without_anchor=False,
            )
        ]
        self.parse_timeout, self.verify_timeout = _timeouts()

    def __call__(self, content: str, solution: str) -> tuple[float | None, str, str]:
        """Returns ``(reward, gold_parsed, answer_parsed)``; reward is ``None`` when the gold is unparseable."""
        gold = self.parse(solution, parsing_timeout=self.parse_timeout)
        if len(gold) == 0:
            return None, "[unparseable]", "[skipped]"
        answer = self.parse(
            content,
            extraction_config=self.answer_config,
            extraction_mode="first_match",
            parsing_timeout=self.parse_timeout,
        )
        reward = float(self.verify(gold, answer, timeout_seconds=self.verify_timeout))
        return reward, str(gold), str(answer) if answer else "[unparseable]"


def _log(log_extra: Callable[[str, list], None] | None, solution: list, gold: list, answer: list) -> None:
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", gold)
        log_extra("answer_parsed", answer)


def accuracy_reward(
    completions: list,
    solution: list[str],
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r"""1.0 when the completion's final answer is mathematically equal to ``solution``, else 0.0.

    Args:
        completions: Standard (``str``) or conversational completions (``completion[0]["content"]`` is read).
        solution: Gold answers, one per completion (the dataset's ``solution`` column).
        log_extra: Trainer-provided callable; logs the columns ``solution``, ``gold_parsed``, ``answer_parsed``.
        **kwargs: Other columns and trainer arguments, ignored.

    Returns:
        One value per completion: 1.0 / 0.0, or ``None`` when the gold solution cannot be parsed (row skipped).

    Example:
        >>> accuracy_reward([r"My answer is \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"], [r"\frac{1}{3}"] * 2)
        [1.0, 0.0]
    """
    verifier = _Verifier()
    rewards, gold_strs, answer_strs = [], [], []
    for content, sol in zip(completion_texts(completions), solution, strict=True):
        reward, gold, answer = verifier(content, sol)
        rewards.append(reward)
        gold_strs.append(gold)
        answer_strs.append(answer)
    _log(log_extra, solution, gold_strs, answer_strs)
    return rewards


def reasoning_accuracy_reward(
    completions: list,
    solution: list[str],
    reasoning_delimiters: list[str] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """:func:`accuracy_reward` on the text after the reasoning; 0.0 when the reasoning never ends.

    For the first delimiter (in list order) present in the completion, only the text after its *last* occurrence is
    graded, so answers written inside the reasoning do not count. A completion with no delimiter scores 0.0 (not
    ``None``): unfinished reasoning is penalised. Unparseable gold → ``None``.

    Args:
        completions: Standard or conversational completions.
        solution: Gold answers, one per completion.
        reasoning_delimiters: Strings that end the reasoning; defaults to ``["</think>"]``.
        log_extra: Trainer-provided callable; logs ``solution``, ``gold_parsed``, ``answer_parsed``.
    """
    delimiters = ["</think>"] if reasoning_delimiters is None else list(reasoning_delimiters)
    verifier = _Verifier()
    rewards, gold_strs, answer_strs = [], [], []
    for content, sol in zip(completion_texts(completions), solution, strict=True):
        delimiter = next((d for d in delimiters if d in content), None)
        if delimiter is None:
            rewards.append(0.0)
            gold_strs.append("[incomplete reasoning]")
            answer_strs.append("[incomplete reasoning]")
            continue
        reward, gold, answer = verifier(content.split(delimiter)[-1], sol)
        rewards.append(reward)
        gold_strs.append(gold)
        answer_strs.append(answer)
    _log(log_extra, solution, gold_strs, answer_strs)
    return rewards


class CosineScaledReward:
    """Correctness scaled by completion length on a cosine schedule (see :func:`get_cosine_scaled_reward`).

    A callable class rather than a closure so it pickles (async rollout workers ship reward functions to other
    processes); ``__name__`` is the metric key.
    """

    __name__ = "cosine_scaled_reward"

    def __init__(
        self,
        max_len: int,
        min_value_wrong: float = -1.0,
        max_value_wrong: float = -0.5,
        min_value_correct: float = 0.5,
        max_value_correct: float = 1.0,
    ):
        if max_len <= 0:
            raise ValueError(f"max_len must be a positive number of tokens, got {max_len}.")
        self.max_len = max_len
        self.min_value_wrong = min_value_wrong
        self.max_value_wrong = max_value_wrong
        self.min_value_correct = min_value_correct
        self.max_value_correct = max_value_correct

    def __call__(
        self, completions: list, solution: list[str], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float | None]:
        rewards: list[float | None] = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if correct is None:
                rewards.append(None)
                continue
            # Clamp at 1: cos is periodic, so past max_len the schedule would climb back up.
            progress = min(len(ids) / self.max_len, 1.0)
            if correct:
                lo, hi = self.min_value_correct, self.max_value_correct
            else:
                # Swapped bounds: a short wrong answer is punished hardest, a long one (exploration) least.
                lo, hi = self.max_value_wrong, self.min_value_wrong
            rewards.append(float(lo + 0.5 * (hi - lo) * (1.0 + math.cos(progress * math.pi))))
        return rewards

    def __repr__(self) -> str:
        return (
            f"get_cosine_scaled_reward(max_len={self.max_len}, min_value_wrong={self.min_value_wrong}, "
            f"max_value_wrong={self.max_value_wrong}, min_value_correct={self.min_value_correct}, "
            f"max_value_correct={self.max_value_correct})"
        )


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> CosineScaledReward:
    r"""Reward that favours short correct answers and long wrong ones (exploration), on a cosine schedule.

    With :math:`p = \min(|y| / L_{max}, 1)` (``|y|`` = completion tokens):

    .. math:: R = v_{min} + \tfrac12 (v_{max} - v_{min}) (1 + \cos(p \pi))

    correct: :math:`(v_{min}, v_{max})` = (``min_value_correct``, ``max_value_correct``) — short → 1.0;
    wrong: :math:`(v_{min}, v_{max})` = (``max_value_wrong``, ``min_value_wrong``) — short → -1.0, long → -0.5.
    Correctness comes from :func:`accuracy_reward`; unparseable gold → ``None``.
    Paper: "Demystifying Long Chain-of-Thought Reasoning in LLMs" (Yeo et al., 2025), Appendix C.1.

    Returns:
        A picklable callable ``(completions, solution, completion_ids, **kwargs)`` named ``cosine_scaled_reward``.

    Example:
        >>> f = get_cosine_scaled_reward(max_len=100)
        >>> f([r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"], [r"\frac{1}{3}"] * 2, [[1] * 50, [1] * 50])
        [0.75, -0.75]
    """
    return CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)
