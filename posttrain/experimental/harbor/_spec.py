"""``HarborSpec``: one Harbor task suite wired into GRPO's ``train_dataset``, ``environment_factory`` and
``reward_funcs`` (TRL's ``trl.experimental.harbor.HarborSpec``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from posttrain.experimental.harbor._env import (
    AGENTS,
    HarborEnv,
    harbor_install_hint,
    harbor_unavailable,
    require_harbor,
)
from posttrain.experimental.harbor._local import BUBBLEWRAP, SandboxLimits, check_supported, warn_dockerfile_not_built
from posttrain.experimental.harbor._task import HarborTaskError, find_task_dirs, load_task, metadata_row


def _outcome_reward_func(
    environments: list[Any] | None = None, environment_reward: list[float] | None = None, **kwargs: Any
) -> list[float]:
    """The verifier's reward per rollout: ``env.reward`` of each live environment (GRPO), or the rewards a rollout
    worker already read (``environment_reward=``, the asynchronous trainers)."""
    if environment_reward is not None:
        return [float(r) for r in environment_reward]
    if environments is None:
        raise ValueError("The Harbor reward needs environments=: use it with GRPOTrainer(environment_factory=...).")
    return [float(env.reward) for env in environments]


def registry_cache_dir(name: str) -> Path:
    """Where a Harbor registry dataset is downloaded: ``$POSTTRAIN_HARBOR_CACHE`` (default
    ``~/.cache/posttrain/harbor``) / the name with ``/`` and ``@`` made path-safe."""
    base = Path(os.environ.get("POSTTRAIN_HARBOR_CACHE", Path.home() / ".cache" / "posttrain" / "harbor"))
    return base.expanduser() / name.replace("/", "__").replace("@", "--")


def download_registry_dataset(name: str) -> list[Path]:
    """The task directories of the Harbor registry dataset ``name`` (``"terminal-bench@2.0"``: Harbor's registry;
    ``"org/name@ref"``: its package registry), downloaded by the ``harbor`` package as ``harbor download`` does.

    Raises:
        HarborTaskError: harbor cannot be imported here, or the download failed (offline, unknown name): the message
            names the dataset, what was tried, and the way out (download it elsewhere and pass the directory).
    """
    bare, _, ref = name.partition("@")
    if not bare or not ref:
        raise HarborTaskError(f"Harbor dataset {name!r}: a registry name is name@version (e.g. 'terminal-bench@2.0').")
    package = "/" in bare
    # The client modules themselves: on Python 3.11 the factory imports but the clients do not (typing.override).
    modules = (
        ("harbor.registry.client.package",)
        if package
        else ("harbor.registry.client.factory", "harbor.registry.client.harbor.harbor")
    )
    fallback = (
        f"Or run `harbor download {name} -o DIR` where harbor works and pass HarborSpec('DIR/{bare.split('/')[-1]}', "
        f"...) (a local directory)."
    )
    problem = harbor_unavailable(modules)
    if problem is not None:
        raise HarborTaskError(
            f"Harbor dataset {name!r} is not a local directory; as a Harbor registry name it needs the harbor "
            f"package to resolve, which failed: {problem}. Install it: {harbor_install_hint()}. {fallback}"
        )
    # Written against harbor 0.26.0 (harbor/cli/download.py does the same calls); not exercised on Python 3.11,
    # where these clients cannot import (the test for it skips there).
    out = registry_cache_dir(name)
    registry = "Harbor's package registry" if package else "Harbor's dataset registry"

    async def fetch() -> list[Any]:
        if package:
            from harbor.registry.client.package import PackageDatasetClient

            client: Any = PackageDatasetClient()
        else:
            from harbor.registry.client.factory import RegistryClientFactory

            client = RegistryClientFactory.create()
        return await client.download_dataset(name, output_dir=out, export=True)

    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop here (the usual case)
            items = asyncio.run(fetch())
        else:  # called from inside a running loop (a notebook): run harbor's coroutine on a loop of its own
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                items = pool.submit(asyncio.run, fetch()).result()
    except Exception as e:  # noqa: BLE001 -- offline, unknown name or version, no access: one clear message
        raise HarborTaskError(
            f"Harbor dataset {name!r} is not a local directory, and downloading it from {registry} with the harbor "
            f"package failed ({type(e).__name__}: {e}). {fallback}"
        ) from e
    dirs = [Path(item.downloaded_path) for item in items]
    if not dirs:
        raise HarborTaskError(f"Harbor dataset {name!r}: {registry} listed no tasks for it.")
    return dirs


def _load_module_from_file(path: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"agent file {path!r} does not exist.")
    name = f"posttrain_harbor_agent_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so classes defined there pickle by reference within this process
    spec.loader.exec_module(module)
    return module


def resolve_agent(agent: str | type[HarborEnv]) -> type[HarborEnv]:
    """The :class:`HarborEnv` subclass ``agent`` names: a class, a built-in name (``"bash"``), ``"pkg.module:Class"``
    or ``"path/to/file.py:Class"``."""
    if isinstance(agent, type):
        cls: Any = agent
    elif isinstance(agent, str) and agent in AGENTS:
        cls = AGENTS[agent]
    elif isinstance(agent, str) and ":" in agent:
        target, _, name = agent.rpartition(":")
        if target.endswith(".py") or os.sep in target or "/" in target:
            module = _load_module_from_file(target)
        else:
            module = importlib.import_module(target)
        if not hasattr(module, name):
            raise ValueError(f"agent {agent!r}: {target} has no attribute {name!r}.")
        cls = getattr(module, name)
    else:
        raise ValueError(
            f"Unknown agent {agent!r}: use a built-in name ({', '.join(sorted(AGENTS))}), 'package.module:Class', "
            "'path/to/file.py:Class', or a HarborEnv subclass."
        )
    if not (isinstance(cls, type) and issubclass(cls, HarborEnv)):
        raise TypeError(f"agent {agent!r} must resolve to a HarborEnv subclass, got {cls!r}.")
    return cls


class HarborSpec:
    """A Harbor task suite for ``GRPOTrainer``: read ``train_dataset``, ``environment_factory`` and ``reward_funcs``.

    Args:
        dataset: A local directory of Harbor tasks (holding the task directories, or a ``tasks/`` subtree), a
            Hugging Face dataset repo id whose ``tasks/`` tree is downloaded (TRL's behaviour), or a Harbor registry
            name (``"terminal-bench@2.0"``, ``"org/name@ref"``; beyond TRL) downloaded by the ``harbor`` package
            into ``$POSTTRAIN_HARBOR_CACHE`` (default ``~/.cache/posttrain/harbor``).
        agent: The harness: ``"bash"`` (:class:`HarborBashEnv`), ``"package.module:Class"``,
            ``"path/to/file.py:Class"``, or a :class:`HarborEnv` subclass.
        environment_type: ``"bubblewrap"`` (posttrain's sandbox on this host: no Docker, no credentials; see
            :mod:`posttrain.experimental.harbor._local`) or a backend of the ``harbor`` package (``"docker"``, TRL's
            default, ``"e2b"``, ...; needs ``pip install harbor``, Python >= 3.12).
        num_tasks: The first ``num_tasks`` tasks (in directory-name order). Exclusive with ``indices``.
        indices: Exactly these task positions (in directory-name order). Exclusive with ``num_tasks``.
        include_metadata: Add TRL's per-task metadata columns from ``task.toml`` ``[metadata]`` (``gold_answer``,
            ``reward_mode``, ``difficulty_level``, ``kaggle_dataset``).
        sandbox_limits: Bounds of the ``"bubblewrap"`` backend (time, memory, disk, output; :class:`SandboxLimits`).
    """

    def __init__(
        self,
        dataset: str | os.PathLike,
        *,
        agent: str | type[HarborEnv] = "bash",
        environment_type: str = "docker",
        num_tasks: int | None = None,
        indices: Sequence[int] | None = None,
        include_metadata: bool = True,
        sandbox_limits: SandboxLimits | None = None,
    ) -> None:
        if num_tasks is not None and indices is not None:
            raise ValueError("Provide num_tasks or indices, not both.")
        if num_tasks is not None and (isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1):
            raise ValueError(f"num_tasks must be a positive integer or None, got {num_tasks!r}.")
        if indices is not None:
            indices = list(indices)
            if not indices or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices):
                raise ValueError(f"indices must be a non-empty list of integers >= 0, got {indices!r}.")
        if not isinstance(environment_type, str) or not environment_type:
            raise ValueError(f"environment_type must be a backend name like {BUBBLEWRAP!r}, got {environment_type!r}.")
        if sandbox_limits is not None and environment_type != BUBBLEWRAP:
            raise ValueError(f"sandbox_limits applies to environment_type={BUBBLEWRAP!r} only.")
        self.dataset = os.fspath(dataset)
        self.environment_type = environment_type
        self.num_tasks = num_tasks
        self.indices = indices
        self.include_metadata = include_metadata
        self.sandbox_limits = sandbox_limits
        self.env_cls = resolve_agent(agent)

    def _suite_root(self) -> Path | list[Path]:
        """A local suite root, or the task directories Harbor's registry downloaded.

        Resolution order: an existing local path (or one spelled as a path); a Harbor registry name (it contains
        ``@``: ``"terminal-bench@2.0"``, ``"org/name@ref"``; never a valid Hub repo id), resolved by the ``harbor``
        package; an ``owner/name`` Hugging Face dataset repo id holding a ``tasks/`` tree (TRL's behaviour).
        """
        local = Path(self.dataset).expanduser()
        if local.exists() or self.dataset.startswith((".", "/", "~")):
            return local
        if "@" in self.dataset:
            return download_registry_dataset(self.dataset)
        if self.dataset.count("/") != 1:
            raise HarborTaskError(
                f"Harbor dataset {self.dataset!r} is not a local directory, nor a Hugging Face dataset repo id "
                "(owner/name), nor a Harbor registry name (name@version, e.g. 'terminal-bench@2.0'; org/name@ref)."
            )
        from huggingface_hub import snapshot_download  # a Hub dataset repo id holding a tasks/ tree

        try:
            return Path(snapshot_download(self.dataset, repo_type="dataset", allow_patterns=["tasks/**"]))
        except Exception as e:  # noqa: BLE001 -- offline, missing repo, no access: one clear message
            raise HarborTaskError(
                f"Harbor dataset {self.dataset!r} is not a local directory, and downloading it as a Hugging Face "
                f"dataset repo failed ({type(e).__name__}: {e}). For a Harbor registry dataset, add its version "
                f"({self.dataset}@<version>)."
            ) from e

    @cached_property
    def task_dirs(self) -> list[Path]:
        """The selected task directories, in suite order (checked for the ``"bubblewrap"`` backend)."""
        root = self._suite_root()
        dirs = sorted(root, key=lambda p: p.name) if isinstance(root, list) else find_task_dirs(root)
        if self.indices is not None:
            bad = [i for i in self.indices if i >= len(dirs)]
            if bad:
                raise ValueError(f"indices {bad} are out of range: the suite {self.dataset!r} has {len(dirs)} tasks.")
            dirs = [dirs[i] for i in self.indices]
        elif self.num_tasks is not None:
            dirs = dirs[: self.num_tasks]
        if self.environment_type == BUBBLEWRAP:
            for task_dir in dirs:  # refuse what the sandbox cannot run before training starts
                task = load_task(task_dir)
                warn_dockerfile_not_built(task, check_supported(task))
        return dirs

    @cached_property
    def train_dataset(self) -> Any:
        """A ``datasets.Dataset``, one row per task: ``prompt`` (an empty user message: each rollout's ``reset``
        appends the instruction and the harness's ``PROMPT_SUFFIX``), ``task_dir`` (passed to ``reset``),
        ``task_name``, ``task_index`` (the position in the suite, as ``indices`` counts), and the metadata columns
        (``include_metadata``)."""
        from datasets import Dataset

        dirs = self.task_dirs
        rows: dict[str, list[Any]] = {
            "prompt": [[{"role": "user", "content": ""}] for _ in dirs],
            "task_dir": [str(d.resolve()) for d in dirs],
            "task_name": [d.name for d in dirs],
            "task_index": list(self.indices) if self.indices is not None else list(range(len(dirs))),
        }
        if self.include_metadata:
            metas = [metadata_row(d) for d in dirs]
            for key in metas[0]:
                rows[key] = [m[key] for m in metas]
        return Dataset.from_dict(rows)

    @cached_property
    def environment_factory(self) -> Callable[[], HarborEnv]:
        """A zero-argument callable making one harness environment per rollout (a picklable ``partial``).

        Raises:
            ImportError: the backend needs the ``harbor`` package and it is not installed (says how to install it).
        """
        require_harbor(self.environment_type)
        if self.environment_type == BUBBLEWRAP:
            return partial(self.env_cls, environment_type=self.environment_type, sandbox_limits=self.sandbox_limits)
        return partial(self.env_cls, environment_type=self.environment_type)

    @property
    def reward_funcs(self) -> Callable[..., list[float]]:
        """The outcome reward: each rollout's verifier reward (``rewards/_outcome_reward_func/mean``)."""
        return _outcome_reward_func


__all__ = ["HarborSpec", "HarborTaskError", "resolve_agent"]
