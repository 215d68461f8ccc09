"""Token-level shaping rewards: DAPO's soft overlong punishment and the n-gram repetition penalty.

Both are factories returning picklable callable class instances (not closures) whose ``__name__`` is TRL's metric
key, and both read only ``completion_ids`` (lengths and n-grams are counted in tokens).
"""

from __future__ import annotations

from typing import Any


class SoftOverlongPunishment:
    """DAPO Eq. 13 on the completion length (see :func:`get_soft_overlong_punishment`)."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if max_completion_len <= 0:
            raise ValueError(f"max_completion_len must be a positive number of tokens, got {max_completion_len}.")
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise ValueError(
                f"soft_punish_cache must be in [0, max_completion_len={max_completion_len}], got {soft_punish_cache}."
            )
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        limit, cache = self.max_completion_len, self.soft_punish_cache
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= limit - cache:
                rewards.append(0.0)
            elif length <= limit:  # only reachable with cache > 0, so no division by zero
                rewards.append((limit - cache - length) / cache)
            else:
                rewards.append(-1.0)
        return rewards

    def __repr__(self) -> str:
        return (
            f"get_soft_overlong_punishment(max_completion_len={self.max_completion_len}, "
            f"soft_punish_cache={self.soft_punish_cache})"
        )


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    r"""Penalise completions that approach or exceed the length limit, never reward short ones.

    With :math:`L` = completion tokens, :math:`L_{max}` = ``max_completion_len``, :math:`C` = ``soft_punish_cache``:

    .. math::
        R(L) = 0 \text{ if } L \le L_{max} - C;\quad \frac{L_{max} - C - L}{C} \text{ if } L_{max} - C < L \le L_{max};
        \quad -1 \text{ if } L > L_{max}

    Paper: DAPO (Yu et al., 2025), Eq. 13. The CLI's registry builds it with ``max_completion_len=1280,
    soft_punish_cache=256``.

    Returns:
        A picklable callable ``(completion_ids, **kwargs)`` named ``soft_overlong_punishment_reward``.

    Example:
        >>> get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)([[1] * 90])
        [-0.5]
    """
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class RepetitionPenalty:
    """Penalty proportional to the fraction of repeated token n-grams (see :func:`get_repetition_penalty_reward`)."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int = 3, max_penalty: float = -1.0):
        if ngram_size <= 0:
            raise ValueError(f"ngram_size must be greater than 0, got {ngram_size}")
        if max_penalty > 0:
            raise ValueError(f"max_penalty {max_penalty} should not be positive")
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        n = self.ngram_size
        rewards = []
        for ids in completion_ids:
            ids = list(ids)
            if len(ids) < n:
                rewards.append(0.0)
                continue
            ngrams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
            repeated_fraction = 1.0 - len(set(ngrams)) / len(ngrams)
            rewards.append(repeated_fraction * self.max_penalty if repeated_fraction else 0.0)
        return rewards

    def __repr__(self) -> str:
        return f"get_repetition_penalty_reward(ngram_size={self.ngram_size}, max_penalty={self.max_penalty})"


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenalty:
    r"""Penalise degenerate, repetitive completions.

    .. math:: R = \left(1 - \frac{\#\text{unique n-grams}}{\#\text{n-grams}}\right) \cdot \text{max\_penalty}

    over token n-grams of the completion; 0.0 with fewer than ``ngram_size`` tokens or no repeats.
    Paper: "Demystifying Long Chain-of-Thought Reasoning in LLMs" (Yeo et al., 2025), Appendix C.2.

    Raises:
        ValueError: ``ngram_size <= 0`` or ``max_penalty > 0``.

    Returns:
        A picklable callable ``(completion_ids, **kwargs)`` named ``repetition_penalty_reward``.

    Example:
        >>> get_repetition_penalty_reward(ngram_size=2)([[1, 2, 3, 4], [5, 5, 5, 5, 5]])
        [0.0, -0.75]
    """
    return RepetitionPenalty(ngram_size, max_penalty)
