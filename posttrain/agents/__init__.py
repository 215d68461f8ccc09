"""Agent training: tools and environments in GRPO's online-RL rollout.

- ``tool_calls``: parse tool calls out of generated text (``TOOL_CALL_PARSERS``: ``"hermes"`` for
  Qwen2.5/Qwen3/Hermes-style ``<tool_call>`` JSON, ``"llama3_json"``; extensible);
- ``tools``: Python functions → JSON schemas, executing model-made calls (async concurrently, errors as
  messages), and ``python_tool`` (model-written code in the sandbox);
- ``environments``: ``environment_factory`` — one instance per rollout, ``reset``, methods as tools, ``get_reward``;
- ``openenv``: ``OpenEnvSession``, a synchronous, bounded, picklable handle on an OpenEnv client for use inside an
  ``environment_factory`` class (optional extra ``posttrain[openenv]``);
- ``openreward``: Open Reward Standard sessions (tasks, tools and per-call rewards served over HTTP + SSE) behind
  ``posttrain.experimental.openreward.OpenRewardSpec`` (optional extra ``posttrain[openreward]``);
- ``loop``: ``ToolCallingBackend``, the multi-turn loop as a generation-backend wrapper, and ``AgentRollout``, the
  trainer-side glue.

Tool arguments are chosen by the model being trained: treat them as untrusted input (see ``tools``).
Submodules are imported on demand so that ``import posttrain.agents`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "TOOL_CALL_PARSERS": "posttrain.agents.tool_calls",
    "ToolCall": "posttrain.agents.tool_calls",
    "parse_tool_calls": "posttrain.agents.tool_calls",
    "assistant_message": "posttrain.agents.tool_calls",
    "detect_tool_call_parser": "posttrain.agents.tool_calls",
    "Tool": "posttrain.agents.tools",
    "ToolResultError": "posttrain.agents.tools",
    "EnvironmentUnavailableError": "posttrain.agents.tools",
    "as_tool": "posttrain.agents.tools",
    "build_tools": "posttrain.agents.tools",
    "execute_tool_calls": "posttrain.agents.tools",
    "python_tool": "posttrain.agents.tools",
    "EnvironmentPool": "posttrain.agents.environments",
    "EnvironmentReward": "posttrain.agents.environments",
    "AgentBatch": "posttrain.agents.environments",
    "append_to_last_user_message": "posttrain.agents.environments",
    "placeholder_dataset": "posttrain.agents.environments",
    "ToolCallingBackend": "posttrain.agents.loop",
    "AgentRollout": "posttrain.agents.loop",
    "prepare_tool_chat_template": "posttrain.agents.loop",
    "tool_metrics": "posttrain.agents.loop",
    "OpenEnvSession": "posttrain.agents.openenv",
    "OpenRewardClient": "posttrain.agents.openreward",
    "OpenRewardEnvironment": "posttrain.agents.openreward",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'posttrain.agents' has no attribute {name!r}")
