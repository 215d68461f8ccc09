"""``environment_factory``: one environment instance per rollout, its public methods as tools, its reward.

The contract (TRL's): ``environment_factory`` is a callable (usually a class) returning an object with

- ``reset(**row) -> str | None`` (required): called with the dataset row of the rollout before generation; a
  string is appended to the last user message of the prompt (as a text block for list content);
- ``get_reward() -> float | None`` (optional, sync or ``async``): adds a reward column named after the
  environment's class, weight 1, scoring only the rollouts whose environment is exactly that class (others get
  ``None``);
- any other public method (no leading underscore): a tool, schema from its type hints and docstring.

A ``dict`` of factories is the multi-environment form: each row's ``environment`` column names its factory, only
that environment's tools are rendered in that row's prompt, and ``environment`` is not passed to ``reset``.
Datasets may omit ``prompt`` (an empty user message is used) when the environment provides the task.

Instances are pooled per factory and reused across batches (``reset`` starts each rollout afresh), grown on
demand to the largest number of rollouts one batch needs. Reward functions receive the batch's instances as
``environments`` (one per completion).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.agents.tools import Tool, as_tool, tool_schemas

ENVIRONMENT_COLUMN = "environment"
_RESERVED_METHODS = ("reset", "get_reward")
_SINGLE = ""  # pool key of a single (non-dict) factory


def environment_tool_names(env_type: type) -> list[str]:
    """Names of the public methods of ``env_type`` that become tools (``reset``/``get_reward`` excluded)."""
    names = []
    for name in dir(env_type):
        if name.startswith("_") or name in _RESERVED_METHODS:
            continue
        attr = inspect.getattr_static(env_type, name)
        if isinstance(attr, (staticmethod, classmethod)) or inspect.isfunction(attr):
            names.append(name)
    return names


class _ToolTemplates:
    """Schemas of an environment class's tools, built once per class (docstring parsing is not free)."""

    def __init__(self) -> None:
        self._by_type: dict[type, list[Tool]] = {}

    def tools(self, env: Any) -> dict[str, Tool]:
        env_type = type(env)
        templates = self._by_type.get(env_type)
        if templates is None:
            templates = [as_tool(getattr(env, name)) for name in environment_tool_names(env_type)]
            self._by_type[env_type] = templates
        return {t.name: Tool(t.name, getattr(env, t.name), t.schema, t.is_async) for t in templates}


def append_to_last_user_message(prompt: Any, text: str) -> Any:
    """A copy of ``prompt`` with ``text`` appended to its last user message (TRL's ``reset`` observation rule).

    String content gets ``text`` concatenated; list content (content blocks) gets a ``{"type": "text"}`` block; a
    standard (string) prompt gets ``text`` concatenated; a conversation without a user message gets a new one.
    """
    if isinstance(prompt, str):
        return prompt + text
    messages = copy.deepcopy(list(prompt))
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                content.append({"type": "text", "text": text})
            else:
                message["content"] = (content or "") + text
            return messages
    messages.append({"role": "user", "content": text})
    return messages


def _run_maybe_async(value: Any) -> Any:
    if inspect.isawaitable(value):
        from posttrain.rewards.scoring import submit_coroutine

        async def wait() -> Any:
            return await value

        return submit_coroutine(wait()).result()
    return value


class EnvironmentReward:
    """Reward column of an environment class with ``get_reward()``: its value for rollouts of that class.

    Named after the class (``__name__``), so the metric is ``rewards/{ClassName}/mean``. Rollouts whose
    environment is another class get ``None``.
    """

    def __init__(self, env_type: type):
        self.env_type = env_type
        self.__name__ = env_type.__name__

    def __call__(self, environments: list[Any] | None = None, **kwargs: Any) -> list[float | None]:
        if environments is None:
            raise ValueError(f"Reward {self.__name__!r} needs the rollouts' environments (environments=...).")
        return [_run_maybe_async(env.get_reward()) if type(env) is self.env_type else None for env in environments]


class AsyncEnvironmentReward(EnvironmentReward):
    """:class:`EnvironmentReward` for an ``async def get_reward``: all rollouts are awaited concurrently."""

    async def __call__(self, environments: list[Any] | None = None, **kwargs: Any) -> list[float | None]:
        import asyncio

        if environments is None:
            raise ValueError(f"Reward {self.__name__!r} needs the rollouts' environments (environments=...).")
        mine = [i for i, env in enumerate(environments) if type(env) is self.env_type]
        values = await asyncio.gather(*(environments[i].get_reward() for i in mine))
        out: list[float | None] = [None] * len(environments)
        for i, value in zip(mine, values):
            out[i] = value
        return out


@dataclass
class AgentBatch:
    """One batch of rollouts, ready for generation.

    Attributes:
        rows: The dataset rows, prompts completed (``reset`` observation appended; empty user message when absent).
        tools: Per row, the tools that rollout may call (``{name: Tool}``).
        tool_schemas: Per row, the JSON schemas the chat template renders (``None`` = no tools).
        environments: Per row, its environment instance (``None`` without ``environment_factory``).
    """

    rows: list[dict[str, Any]]
    tools: list[dict[str, Tool]]
    tool_schemas: list[list[dict[str, Any]] | None]
    environments: list[Any] | None = None


class EnvironmentPool:
    """Instances of an ``environment_factory`` (callable or ``{name: callable}``), one per rollout, reused.

    One instance per factory is built at construction to check the contract (a callable ``reset``) and learn each
    environment's class (for its tools and ``get_reward`` column).

    Args:
        environment_factory: A zero-argument callable returning an environment, or a dict of them.
    """

    def __init__(self, environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]]):
        if isinstance(environment_factory, Mapping):
            if not environment_factory:
                raise ValueError("environment_factory is an empty dict; give at least one {name: factory} entry.")
            bad = [k for k in environment_factory if not isinstance(k, str) or not k]
            if bad:
                raise ValueError(f"environment_factory dict keys must be non-empty strings, got {bad!r}.")
            self.factories = dict(environment_factory)
            self.multi = True
        else:
            self.factories = {_SINGLE: environment_factory}
            self.multi = False
        for name, factory in self.factories.items():
            if not callable(factory):
                where = f"environment_factory[{name!r}]" if self.multi else "environment_factory"
                raise TypeError(f"{where} must be callable (a class or a function), got {type(factory).__name__}.")
        self._pool: dict[str, list[Any]] = {name: [] for name in self.factories}
        self.env_types: dict[str, type] = {}
        self._templates = _ToolTemplates()
        for name in self.factories:
            env = self._new(name)
            self._pool[name].append(env)
            self.env_types[name] = type(env)
            self._templates.tools(env)  # fail early on a tool without hints or docstring

    def _new(self, name: str) -> Any:
        env = self.factories[name]()
        where = f"environment_factory[{name!r}]" if self.multi else "environment_factory"
        if not callable(getattr(env, "reset", None)):
            raise TypeError(
                f"{where} returned a {type(env).__name__} without a reset method. Environments need "
                "reset(self, **kwargs) -> str | None (called with the dataset row before each rollout)."
            )
        return env

    def reward_functions(self) -> list[EnvironmentReward]:
        """One reward function per environment class that defines ``get_reward`` (class order of the factories)."""
        out: list[EnvironmentReward] = []
        seen: set[type] = set()
        for env_type in self.env_types.values():
            if env_type in seen or not callable(getattr(env_type, "get_reward", None)):
                continue
            seen.add(env_type)
            is_async = inspect.iscoroutinefunction(env_type.get_reward)
            out.append(AsyncEnvironmentReward(env_type) if is_async else EnvironmentReward(env_type))
        return out

    def tool_names(self) -> dict[str, list[str]]:
        """Per factory name, the tools its environments expose."""
        return {name: environment_tool_names(t) for name, t in self.env_types.items()}

    def factory_name(self, row: Mapping[str, Any], index: int) -> str:
        """The factory a row uses: its ``environment`` column in dict mode (checked), else the single one."""
        if not self.multi:
            return _SINGLE
        name = row.get(ENVIRONMENT_COLUMN)
        if name is None:
            raise ValueError(
                f"Row {index} has no {ENVIRONMENT_COLUMN!r} column, but environment_factory is a dict: add a column "
                f"{ENVIRONMENT_COLUMN!r} naming one of {sorted(self.factories)} for every row."
            )
        if name not in self.factories:
            raise ValueError(
                f"Row {index} has {ENVIRONMENT_COLUMN}={name!r}, which is not a key of environment_factory; valid "
                f"values: {sorted(self.factories)}."
            )
        return name

    def prepare(self, rows: list[dict[str, Any]], base_tools: Mapping[str, Tool] | None = None) -> AgentBatch:
        """Reset one instance per row and build each rollout's prompt and tools.

        Args:
            rows: This process's rows (each prompt repeated per generation).
            base_tools: Tools shared by every rollout (the trainer's ``tools=``), added before the environment's.
        """
        used: dict[str, int] = {name: 0 for name in self.factories}
        environments, out_rows, tools = [], [], []
        for index, row in enumerate(rows):
            name = self.factory_name(row, index)
            k = used[name]
            used[name] += 1
            while len(self._pool[name]) <= k:
                self._pool[name].append(self._new(name))
            env = self._pool[name][k]
            kwargs = {key: value for key, value in row.items() if not (self.multi and key == ENVIRONMENT_COLUMN)}
            observation = _run_maybe_async(env.reset(**kwargs))
            prompt = row.get("prompt")
            if prompt is None:
                prompt = [{"role": "user", "content": ""}]
            if observation is not None:
                if not isinstance(observation, str):
                    raise TypeError(
                        f"{type(env).__name__}.reset returned {type(observation).__name__}; it must return a string "
                        "(appended to the last user message) or None."
                    )
                prompt = append_to_last_user_message(prompt, observation)
            env_tools = self._templates.tools(env)
            clash = sorted(set(env_tools) & set(base_tools or {}))
            if clash:
                raise ValueError(
                    f"Tool name(s) {clash} are both in tools=[...] and methods of {type(env).__name__}; rename one."
                )
            environments.append(env)
            out_rows.append({**row, "prompt": prompt})
            tools.append({**(base_tools or {}), **env_tools})
        schemas = [tool_schemas(t) or None for t in tools]
        return AgentBatch(out_rows, tools, schemas, environments)


def prepare_rows(
    rows: list[dict[str, Any]], tools: Mapping[str, Tool], pool: EnvironmentPool | None = None
) -> AgentBatch:
    """An :class:`AgentBatch` for ``rows``: through the environment pool when there is one, else the same tools
    for every rollout."""
    if pool is not None:
        return pool.prepare(rows, tools)
    schemas = tool_schemas(tools) or None
    return AgentBatch([dict(row) for row in rows], [dict(tools) for _ in rows], [schemas for _ in rows], None)


def placeholder_dataset(num_rows: int) -> Any:
    """A dataset of ``num_rows`` empty user prompts, for an environment that provides the whole task.

    TRL builds one when ``train_dataset`` is omitted with a single (non-dict) ``environment_factory``.
    """
    from datasets import Dataset

    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}.")
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}] for _ in range(num_rows)]})
