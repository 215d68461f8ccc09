"""The configuration base of the async trainers (``AsyncGRPOConfig``, ``AsyncDistillationConfig``).

:class:`AsyncRolloutConfig` is their explicit shared base (``class AsyncGRPOConfig(AsyncRolloutConfig, GRPOConfig)``):
it names the fields the rollout worker and :class:`~posttrain.rollout.async_worker.AsyncRollout` read
(``REQUIRED_FIELDS``), and :meth:`AsyncRolloutConfig.check_async_rollout` refuses a config that does not declare one
of them (naming it and the fix) before running the shared option checks
(:func:`~posttrain.rollout.async_worker.check_async_rollout_options`).

The five pipeline fields both configs declare (``max_inflight_tasks``, ``max_staleness``, ``queue_maxsize``,
``weight_sync_steps``, ``seed_requests``) take their one default and help from :func:`async_rollout_field`. The base
holds no dataclass fields itself: a base's fields come first in every subclass, which would reorder each config's
fields (TRL's order, as ``HfArgumentParser`` lists them); ``request_timeout`` is required but declared by each
config with its own help (one server, or the student's and the teachers').
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, ClassVar

from posttrain.rollout.async_worker import check_async_rollout_options

__all__ = ["ASYNC_ROLLOUT_FIELDS", "AsyncRolloutConfig", "async_rollout_field"]

# name -> (default, help): TRL's defaults; one help for both async configs.
ASYNC_ROLLOUT_FIELDS: dict[str, tuple[Any, str]] = {
    "max_inflight_tasks": (
        -1,
        "Most samples generated ahead of the server's weight version. -1 (auto) = max_staleness × "
        "per_device_train_batch_size × gradient_accumulation_steps × processes (at least one round): generating "
        "more only produces samples that are dropped as stale.",
    ),
    "max_staleness": (
        4,
        "Maximum number of weight updates a rollout sample can lag behind the current model version before being "
        "discarded (counted in sample/dropped_stale_total).",
    ),
    "queue_maxsize": (1024, "Maximum number of rollout samples buffered in the rollout queue."),
    "weight_sync_steps": (1, "Number of training steps between weight synchronizations to the server."),
    "seed_requests": (
        True,
        "posttrain: seed each generation request from (seed, round), so rounds are reproducible (TRL sends no seed).",
    ),
}


def async_rollout_field(name: str) -> Any:
    """The dataclass field ``name`` of :data:`ASYNC_ROLLOUT_FIELDS` (its default and help)."""
    default, help_text = ASYNC_ROLLOUT_FIELDS[name]
    return field(default=default, metadata={"help": help_text})


class AsyncRolloutConfig:
    """Base of the async trainers' configs (see the module docstring); goes first in the bases, before the
    synchronous trainer's config. Not a dataclass: it adds no fields and leaves the field order alone."""

    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = (*ASYNC_ROLLOUT_FIELDS, "request_timeout")
    _trainer_name: ClassVar[str]

    def check_async_rollout(self, model_hint: str = "MODEL") -> None:
        """Check the declared fields, then the shared async options (``check_async_rollout_options``)."""
        declared = {f.name for f in dataclasses.fields(self)}
        missing = [name for name in self.REQUIRED_FIELDS if name not in declared]
        if missing:
            raise TypeError(
                f"{type(self).__name__} does not declare {missing}, which the async rollout reads. Declare them in "
                "the dataclass (the pipeline fields with posttrain.experimental._async_config.async_rollout_field)."
            )
        check_async_rollout_options(self, self._trainer_name, model_hint)
