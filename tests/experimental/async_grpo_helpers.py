"""Picklable pieces for the AsyncGRPO tests (the rollout worker is a spawned process: it imports this module)."""

from __future__ import annotations


def varied_reward(completion_ids, **kwargs):
    """A deterministic reward that differs within groups (non-zero advantages)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def failing_reward(completion_ids, **kwargs):
    raise ValueError("reward exploded on purpose")
