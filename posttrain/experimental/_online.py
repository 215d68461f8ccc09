"""What the online experimental trainers with TRL's older constructors (Online DPO, PPO) share."""

from __future__ import annotations

from typing import Any


def reward_sources(reward_funcs: Any, *, first: tuple = (), last: tuple = ()) -> list[Any]:
    """``reward_funcs`` (one or a list; None = none) as a list, with the non-None ``first`` sources before it (reward
    models: TRL scores them first) and the non-None ``last`` ones after it (e.g. a judge adapter)."""
    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    return [*(f for f in first if f is not None and f != ""), *funcs, *(f for f in last if f is not None and f != "")]
