"""Reward functions shared by the online-RL tests (GRPO, RLOO, the experimental trainers, the server backend).

``pytest`` puts ``tests/`` on ``sys.path`` (for ``conftest.py``), so every test folder imports this as
``reward_helpers``; a spawned rollout worker (AsyncGRPO) inherits that path and unpickles these by reference.
"""

from __future__ import annotations


class VariedReward:
    """``sum(completion ids) % modulus``: deterministic and almost never constant within a group, so advantages (and
    gradients) are non-zero. A callable instance rather than a closure so that it pickles; the metric name is
    ``varied_reward`` (``rewards/varied_reward/mean``) whatever the modulus."""

    __name__ = "varied_reward"

    def __init__(self, modulus: int = 7):
        self.modulus = modulus

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        return [float(sum(ids) % self.modulus) for ids in completion_ids]

    def __repr__(self) -> str:
        return f"VariedReward(modulus={self.modulus})"


varied_reward = VariedReward()
