"""OpenReward environments (the Open Reward Standard over HTTP + SSE) for ``GRPOTrainer``: TRL's
``trl.experimental.openreward`` API.

One :class:`OpenRewardSpec` names an ORS environment (a URL of a server you run, or an openreward.ai catalog name)
and exposes the three trainer arguments::

    spec = OpenRewardSpec("http://127.0.0.1:8000", num_tasks=4)
    trainer = GRPOTrainer(model, reward_funcs=spec.reward_funcs, args=GRPOConfig(...),
                          train_dataset=spec.train_dataset, environment_factory=spec.environment_factory)

Needs ``pip install "posttrain[openreward]"`` (the ``openreward`` SDK, imported only when a spec is used). The
per-rollout sessions, tool forwarding, reward bookkeeping and time bounds live in
:mod:`posttrain.agents.openreward`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cached_property
from typing import Any

from posttrain.agents.openreward import (
    OpenRewardClient,
    OpenRewardEnvironment,
    OpenRewardFactory,
    outcome_reward,
)

__all__ = ["OpenRewardEnvironment", "OpenRewardSpec"]

logger = logging.getLogger(__name__)


class OpenRewardSpec:
    """One ORS environment wired into GRPO's ``train_dataset``, ``environment_factory`` and ``reward_funcs``.

    Everything is fetched lazily, on first access of a property, and once.

    Args:
        target: A URL of an ORS server (``"http://127.0.0.1:8000"``; contains ``://``) or an openreward.ai catalog
            name (``"Eigent/SETA"``, authenticated with ``OPENREWARD_API_KEY``).
        num_tasks: Use the first ``num_tasks`` tasks of the split (None: all). Exclusive with ``indices``.
        split: The split whose tasks make the dataset and whose sessions the rollouts open.
        indices: Exactly these task indices. Exclusive with ``num_tasks``.
        api_key: Overrides ``OPENREWARD_API_KEY`` (catalog names).
        secrets: Per-session secrets sent to the server. For catalog names without ``secrets``, the API key is sent
            as the ``api_key`` secret (as TRL does).
        env_name: The environment's name on the server (a URL's server may host several; None: its default).
        include_metadata: Add each task spec's fields as dataset columns (never replacing ``prompt`` or
            ``task_index``), so reward functions receive them.
        discover_task_tools: Open a short-lived session per probe task to list task-specific tools too (ORS
            ``task_tools``); when every probe fails, fall back to the shared tools with a warning.
        task_tools_discovery_index: The one task to probe (default: every index of ``indices``, else task 0).
        timeout_s: posttrain's bound, in seconds, on each request to the server (beyond TRL: the SDK alone can wait
            without limit). A server that does not answer in time or dies raises
            :class:`~posttrain.agents.tools.EnvironmentUnavailableError` naming its URL.
    """

    def __init__(
        self,
        target: str,
        *,
        num_tasks: int | None = None,
        split: str = "train",
        indices: list[int] | None = None,
        api_key: str | None = None,
        secrets: dict[str, str] | None = None,
        env_name: str | None = None,
        include_metadata: bool = True,
        discover_task_tools: bool = True,
        task_tools_discovery_index: int | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if num_tasks is not None and indices is not None:
            raise ValueError("Provide num_tasks or indices, not both.")
        if num_tasks is not None and (isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1):
            raise ValueError(f"num_tasks must be a positive integer or None, got {num_tasks!r}.")
        if indices is not None:
            indices = list(indices)
            if not indices or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices):
                raise ValueError(f"indices must be a non-empty list of integers >= 0, got {indices!r}.")
        self.target = target
        self.num_tasks = num_tasks
        self.split = split
        self.indices = indices
        self.secrets = secrets
        self.include_metadata = include_metadata
        self.discover_task_tools = discover_task_tools
        self.task_tools_discovery_index = task_tools_discovery_index
        self.client = OpenRewardClient(target, env_name=env_name, api_key=api_key, timeout_s=timeout_s)

    @cached_property
    def train_dataset(self) -> Any:
        """A ``datasets.Dataset`` with one row per task: ``prompt`` (an empty user message, to which each rollout's
        ``reset`` appends the task's prompt), ``task_index``, and the task spec's fields (``include_metadata``)."""
        from datasets import Dataset

        if self.indices is not None:
            indices = self.indices
            specs = [self.client.get_task(self.split, i) for i in indices]
        elif self.num_tasks is not None:
            indices = list(range(min(self.num_tasks, self.client.num_tasks(self.split))))
            specs = [self.client.get_task(self.split, i) for i in indices]
        else:
            specs = self.client.list_tasks(self.split)
            indices = list(range(len(specs)))
        if not specs:
            raise ValueError(f"ORS environment {self.target!r} has no tasks in split {self.split!r}.")
        rows: dict[str, list[Any]] = {
            "prompt": [[{"role": "user", "content": ""}] for _ in indices],
            "task_index": indices,
        }
        if self.include_metadata:
            keys = sorted({key for spec in specs for key in spec} - set(rows))
            for key in keys:
                rows[key] = [spec.get(key) for spec in specs]
        return Dataset.from_dict(rows)

    @cached_property
    def tool_specs(self) -> list[dict[str, Any]]:
        """The tools every rollout gets (``{"name", "description", "input_schema"}``), as discovered."""
        shared = self.client.list_tools()
        if not self.discover_task_tools:
            return shared
        if self.task_tools_discovery_index is not None:
            probes = [self.task_tools_discovery_index]
        elif self.indices is not None:
            probes = sorted(set(self.indices))
        else:
            probes = [0]
        merged: dict[str, dict[str, Any]] = {}
        for index in probes:
            try:
                found = self.client.session_tools(self.split, index, self._session_secrets())
            except Exception as err:  # noqa: BLE001 - a probe is optional: fall back to the shared tools
                logger.warning("OpenRewardSpec: task tool discovery failed for task %s (%s); skipping.", index, err)
                continue
            for spec in found:
                if spec["name"] in merged and merged[spec["name"]] != spec:
                    logger.warning(
                        "OpenRewardSpec: tool %r differs between probe tasks; keeping the first.", spec["name"]
                    )
                merged.setdefault(spec["name"], spec)
        if not merged:
            logger.warning("OpenRewardSpec: no task tool probe succeeded; using the environment's shared tools.")
            return shared
        return list(merged.values())

    @cached_property
    def environment_factory(self) -> Callable[[], OpenRewardEnvironment]:
        """A picklable zero-argument factory: one :class:`OpenRewardEnvironment` (with one method per ORS tool) per
        rollout slot; its ``reset(task_index=...)`` opens a session on that task."""
        return OpenRewardFactory(self.client, self.tool_specs, self.split, self._session_secrets())

    @property
    def reward_funcs(self) -> Callable[..., list[float]]:
        """The outcome-only reward: each rollout's last reward that was not ``None`` (0.0 when none came)."""
        return outcome_reward

    def _session_secrets(self) -> dict[str, str] | None:
        if self.secrets is not None or self.client.is_url:
            return self.secrets
        key = self.client.api_key or os.environ.get("OPENREWARD_API_KEY")
        return {"api_key": key} if key else None

    def __repr__(self) -> str:
        return f"OpenRewardSpec({self.target!r}, split={self.split!r}, num_tasks={self.num_tasks}, indices={self.indices})"
