"""The async rollout's error type, in a module of its own: the worker (``async_worker``) and the cross-rank round
exchange (``multiprocess``) both raise it, and neither imports the other's module for it."""

from __future__ import annotations

__all__ = ["RolloutWorkerError"]


class RolloutWorkerError(RuntimeError):
    """The rollout worker process failed (its exception type, message and traceback are in the message), or, with
    several training processes, rank 0 could not deliver a round (what was waited for is in the message)."""
