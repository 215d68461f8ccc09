"""Capture mode for ``/v1/chat/completions``: every call made under a rollout id is recorded for the trainer.

An agent that runs its own loop makes many chat calls per rollout, and only the server sees the token ids it was
served. A call tagged with a rollout id — the ``X-Rollout-Id`` header, the ``rollout_id`` body field (``openai``:
``extra_body={"rollout_id": ...}``), or the base URL ``http://host:port/rollouts/<id>/v1`` for agents that only let
you set a base URL — is recorded here: the rendered prompt's ids, each choice's ids, sampled log-probs and finish
reason, and the weight version. ``GET /v1/rollouts/<id>`` returns the calls in the order they were answered;
``DELETE /v1/rollouts/<id>`` returns them and forgets them (what a trainer does once it has assembled its rows).

The store is bounded: at most ``max_rollouts`` rollouts are kept (the oldest is forgotten first, with a warning),
so a trainer that never collects cannot grow the server without limit.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from typing import Any

logger = logging.getLogger(__name__)

ROLLOUT_HEADER = "x-rollout-id"
ROLLOUT_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,200}$")
DEFAULT_MAX_ROLLOUTS = 4096


def check_rollout_id(value: Any, param: str = "rollout_id") -> str:
    """``value`` as a rollout id (1-200 characters of ``A-Z a-z 0-9 . _ : -``), or ``RequestError`` naming
    ``param``."""
    from posttrain.serving.engine import RequestError

    if not isinstance(value, str) or not ROLLOUT_ID_RE.match(value):
        raise RequestError(
            param, f"{param} must be 1-200 characters of letters, digits, '.', '_', ':' or '-', got {value!r}."
        )
    return value


class CaptureStore:
    """The recorded calls of each rollout id (thread-safe; bounded to ``max_rollouts`` rollouts, oldest dropped)."""

    def __init__(self, max_rollouts: int = DEFAULT_MAX_ROLLOUTS) -> None:
        if max_rollouts < 1:
            raise ValueError(f"max_rollouts must be >= 1, got {max_rollouts}.")
        self.max_rollouts = max_rollouts
        self._calls: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def record(self, rollout_id: str, call: dict[str, Any]) -> int:
        """Append ``call`` to ``rollout_id``'s calls; returns its index in that rollout."""
        with self._lock:
            calls = self._calls.setdefault(rollout_id, [])
            call = {"index": len(calls), **call}
            calls.append(call)
            while len(self._calls) > self.max_rollouts:
                dropped, lost = self._calls.popitem(last=False)
                logger.warning("Capture store full (%d rollouts): forgot rollout %r and its %d call(s); collect "
                               "rollouts with DELETE /v1/rollouts/<id>.", self.max_rollouts, dropped, len(lost))  # fmt: skip
            return call["index"]

    def get(self, rollout_id: str, *, pop: bool = False) -> list[dict[str, Any]] | None:
        """The calls recorded under ``rollout_id`` (``None`` if none); ``pop`` forgets them."""
        with self._lock:
            if pop:
                return self._calls.pop(rollout_id, None)
            calls = self._calls.get(rollout_id)
            return list(calls) if calls is not None else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)
