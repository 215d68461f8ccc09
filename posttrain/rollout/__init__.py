"""The shared online-RL pipeline (GRPO, RLOO, on-policy distillation).

- ``sampler``: ``RepeatSampler`` / ``repeat_iterable_dataset`` (prompt groups) and the generation-batch arithmetic;
- ``pipeline``: ``RolloutPipeline`` — prompts → completions → rewards → old/ref log-probs → advantages; it keeps the
  gathered rewards and advantages of its last batch as ``last_result`` (``RolloutResult``);
- ``estimators``: the advantage estimators (group-relative for GRPO, leave-one-out for RLOO);
- ``buffer``: ``RolloutBuffer`` — one generated batch, shuffled, split and replayed over ``num_iterations``;
- ``metrics`` / ``completions_log``: TRL's metric names and the ``log_completions`` table;
- ``distillation``: on-policy distillation's rollout (student/dataset/teacher completions); its vocabulary checks
  and divergence live with the models (``models.vocabulary``, ``models.distillation_scoring``).

Submodules are imported on demand so that ``import posttrain.rollout`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RepeatSampler": "posttrain.rollout.sampler",
    "RepeatIterableDataset": "posttrain.rollout.sampler",
    "repeat_iterable_dataset": "posttrain.rollout.sampler",
    "resolve_generation_batch": "posttrain.rollout.sampler",
    "RolloutPipeline": "posttrain.rollout.pipeline",
    "RolloutSettings": "posttrain.rollout.pipeline",
    "ImportanceSamplingSettings": "posttrain.rollout.pipeline",
    "RolloutResult": "posttrain.rollout.pipeline",
    "RolloutBuffer": "posttrain.rollout.buffer",
    "shuffle_sequence_dict": "posttrain.rollout.buffer",
    "split_tensor_dict": "posttrain.rollout.buffer",
    "GroupRelativeEstimator": "posttrain.rollout.estimators",
    "LeaveOneOutEstimator": "posttrain.rollout.estimators",
    "AdvantageResult": "posttrain.rollout.estimators",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'posttrain.rollout' has no attribute {name!r}")
