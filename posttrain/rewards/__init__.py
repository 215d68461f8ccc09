"""Reward functions for online RL: TRL's built-ins, the name registry, the scorer, and sandboxed code execution.

The built-ins, the registry and the sandbox import only the standard library (``math_verify`` is imported when a
math reward is first called); :class:`RewardScorer` and friends import ``torch`` and are loaded on first access.
"""

from __future__ import annotations

from typing import Any

from posttrain.rewards.accuracy import (
    CosineScaledReward,
    accuracy_reward,
    get_cosine_scaled_reward,
    reasoning_accuracy_reward,
)
from posttrain.rewards.code import (
    CodeReward,
    code_reward,
    extract_code,
    get_code_reward,
    normalize_test_cases,
    run_test_cases,
)
from posttrain.rewards.format import think_format_reward
from posttrain.rewards.registry import (
    REWARD_FACTORIES,
    REWARD_FUNCS,
    BoundReward,
    resolve_reward_func,
    resolve_reward_funcs,
)
from posttrain.rewards.sandbox import SandboxResult, SandboxUnavailable, run_files, run_python, sandbox_capabilities
from posttrain.rewards.shaping import (
    RepetitionPenalty,
    SoftOverlongPunishment,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
)
from posttrain.rewards.text import completion_text, completion_texts

_LAZY = {
    "RewardScorer": "posttrain.rewards.scoring",
    "RewardFunctionError": "posttrain.rewards.scoring",
    "validate_reward_func_signature": "posttrain.rewards.scoring",
    "reward_func_name": "posttrain.rewards.scoring",
    "submit_coroutine": "posttrain.rewards.scoring",
    "STANDARD_REWARD_KWARGS": "posttrain.rewards.scoring",
}

__all__ = [
    "REWARD_FACTORIES",
    "REWARD_FUNCS",
    "STANDARD_REWARD_KWARGS",
    "BoundReward",
    "CodeReward",
    "CosineScaledReward",
    "RepetitionPenalty",
    "RewardFunctionError",
    "RewardScorer",
    "SandboxResult",
    "SandboxUnavailable",
    "SoftOverlongPunishment",
    "accuracy_reward",
    "code_reward",
    "completion_text",
    "completion_texts",
    "extract_code",
    "get_code_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "normalize_test_cases",
    "reasoning_accuracy_reward",
    "resolve_reward_func",
    "resolve_reward_funcs",
    "reward_func_name",
    "run_files",
    "run_python",
    "run_test_cases",
    "sandbox_capabilities",
    "submit_coroutine",
    "think_format_reward",
    "validate_reward_func_signature",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'posttrain.rewards' has no attribute {name!r}")
