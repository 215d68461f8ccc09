"""Harbor-backed environments for ``GRPOTrainer(environment_factory=...)`` (TRL's ``HarborEnv`` contract).

A :class:`HarborEnv` is an *external* Harbor agent: the trainer drives the loop (the policy's turns, its tool calls),
the env's public methods are the tools and run shell commands in the task's sandbox, and ``env.reward`` runs the
task's verifier once, after the rollout. The harness (tool surface) is a subclass: :class:`HarborBashEnv` has one
``bash`` tool; see ``examples/harbor_harnesses.py`` for the ``jupyter`` and ``terminal_notes`` harnesses.

Sandboxes (``environment_type``):

- ``"bubblewrap"`` (posttrain's, beyond TRL): the task in posttrain's bubblewrap sandbox on the host's userland,
  no Docker, no credentials (:mod:`posttrain.experimental.harbor._local`);
- anything else (``"docker"``, TRL's default, ``"e2b"``, ``"daytona"``, ...): passed to the ``harbor`` package, which
  is imported lazily (``pip install harbor``, Python >= 3.12) and run in-process on one event loop per env.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

from posttrain.experimental.harbor._local import BUBBLEWRAP, BubblewrapSandbox, SandboxLimits
from posttrain.experimental.harbor._task import HarborTask, load_task

_NO_REWARD = object()  # the verifier has not run for this rollout yet (0.0 is a real reward)
_OUTPUT_CHARS = 8000


# The harbor modules the sandbox backend and the registry resolution use. ``import harbor`` alone is not enough: its
# __init__ imports lazily, so on Python 3.11 (harbor installed with --ignore-requires-python) it succeeds while these
# raise SyntaxError (harbor 0.26 uses PEP 695 generics, ``def f[T](...)``, and PEP 701 multi-line f-strings).
HARBOR_BACKEND_MODULES = (
    "harbor.environments.factory",
    "harbor.models.task.task",
    "harbor.models.trial.config",
    "harbor.models.trial.paths",
    "harbor.verifier.factory",
)


def harbor_unavailable(modules: tuple[str, ...] = HARBOR_BACKEND_MODULES) -> str | None:
    """Why the ``harbor`` package cannot be used here (``None`` when every one of ``modules`` imports).

    Catches SyntaxError as well as ImportError: harbor requires Python >= 3.12 and, forced onto an older one, fails
    to compile rather than to import.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except SyntaxError as e:  # the full path: the message alone names only the file
            return f"importing {name} failed: SyntaxError: {e.msg} ({e.filename}:{e.lineno})"
        except ImportError as e:
            return f"importing {name} failed: {type(e).__name__}: {e}"
    return None


def harbor_install_hint() -> str:
    """How to get a working ``harbor`` package, naming this interpreter's version."""
    return (
        f"`pip install harbor` (it requires Python >= 3.12; this is Python {sys.version_info.major}."
        f"{sys.version_info.minor})"
    )


def require_harbor(environment_type: str) -> None:
    """Raise a clear ImportError when ``environment_type`` needs the ``harbor`` package and it is absent or cannot
    be imported on this Python."""
    if environment_type == BUBBLEWRAP:
        return
    problem = harbor_unavailable()
    if problem is not None:
        raise ImportError(
            f"environment_type={environment_type!r} runs tasks in Harbor's own sandboxes and needs the harbor "
            f"package: {harbor_install_hint()}; {problem}. Without Docker or Harbor, use "
            f"environment_type={BUBBLEWRAP!r}: posttrain's bubblewrap sandbox on this host's userland."
        )


class _HarborPackageSandbox:
    """A task in one of the ``harbor`` package's sandboxes (docker, e2b, ...), driven as TRL does.

    Harbor's client is async and bound to the loop it was made on: this object owns a loop on a daemon thread and
    blocks on each coroutine, so tools may be called from plain threads and from inside another running loop.
    """

    def __init__(self, task: HarborTask, environment_type: str) -> None:
        require_harbor(environment_type)
        self.task = task
        self.environment_type = environment_type
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="harbor-env-loop", daemon=True)
        self._thread.start()
        self._env: Any = None
        self._task: Any = None
        self._paths: Any = None

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def start(self) -> None:
        self._run(self._start())

    async def _start(self) -> None:
        from harbor.environments.factory import EnvironmentFactory
        from harbor.models.task.task import Task
        from harbor.models.trial.config import EnvironmentConfig
        from harbor.models.trial.paths import TrialPaths

        self._task = Task(task_dir=self.task.path)
        self._paths = TrialPaths(trial_dir=Path(tempfile.mkdtemp(prefix="posttrain-harbor-trial-")))
        self._env = EnvironmentFactory.create_environment_from_config(
            config=EnvironmentConfig(type=self.environment_type),
            environment_dir=self._task.paths.environment_dir,
            environment_name=self._task.short_name,
            session_id=uuid.uuid4().hex,
            trial_paths=self._paths,
            task_env_config=self._task.config.environment,
        )
        await self._env.start(force_build=False)
        await self._env.run_healthcheck()
        await self._env.exec("mkdir -p /workdir")

    def exec(self, command: str, timeout: float | None = None) -> str:
        result = self._run(self._env.exec(command, timeout_sec=int(timeout or 180)))
        out = (result.stdout or "") + (result.stderr or "")
        if len(out) > _OUTPUT_CHARS:
            out = out[:_OUTPUT_CHARS] + "\n... [truncated]"
        return out or f"(empty output, rc={result.return_code})"

    def verify(self) -> float:
        return self._run(self._verify())

    async def _verify(self) -> float:
        from harbor.models.trial.config import VerifierConfig
        from harbor.models.trial.paths import EnvironmentPaths
        from harbor.verifier.factory import VerifierFactory

        env_paths = EnvironmentPaths.for_os(self._env.os)
        await self._env.empty_dirs([env_paths.verifier_dir], chmod=True)
        verifier = VerifierFactory.create_verifier_from_config(
            VerifierConfig(),
            task=self._task,
            trial_paths=self._paths,
            environment=self._env,
            override_env=self._task.config.verifier.env or None,
        )
        rewards = (await verifier.verify()).rewards or {}
        return float(rewards.get("reward", next(iter(rewards.values()), 0.0)))

    def close(self) -> None:
        try:
            if self._env is not None:
                self._run(self._env.stop(delete=True))
        finally:
            self._env = None
            self._loop.call_soon_threadsafe(self._loop.stop)


class HarborEnv:
    """Base environment over one Harbor task per rollout: subclasses add the tools (the harness).

    Per rollout the trainer calls ``reset(task_dir=..., **row)`` (start the task's sandbox; returns the instruction
    plus :attr:`PROMPT_SUFFIX`), then the tool methods, then reads :attr:`reward` (the verifier, run once). Every
    public method is a tool: give it type hints and a docstring with ``Args:``; keep helpers ``_private``. Use
    :meth:`_exec` to run shell commands in the sandbox, and override :meth:`_setup` for per-task preparation.

    Args:
        environment_type: ``"bubblewrap"`` (posttrain's sandbox on this host, no Docker) or a Harbor backend name
            passed to the ``harbor`` package (``"docker"``, TRL's default; ``"e2b"``, ...).
        sandbox_limits: Bounds of the ``"bubblewrap"`` backend (:class:`SandboxLimits`; None: the defaults).
    """

    #: Harness guidance appended to each task's instruction.
    PROMPT_SUFFIX: str = ""

    def __init__(self, environment_type: str = "docker", sandbox_limits: SandboxLimits | None = None) -> None:
        self._environment_type = environment_type
        self._sandbox_limits = sandbox_limits
        self._sandbox: BubblewrapSandbox | _HarborPackageSandbox | None = None
        self._task: HarborTask | None = None
        self._reward: Any = _NO_REWARD

    def reset(self, task_dir: str | None = None, **kwargs: Any) -> str:
        """Start ``task_dir``'s sandbox (closing the previous rollout's) and return the prompt text."""
        if task_dir is None:
            raise ValueError(
                f"{type(self).__name__}.reset needs task_dir= (a column of HarborSpec.train_dataset); the dataset row "
                f"had only {sorted(kwargs)}."
            )
        self._close_sandbox()
        self._reward = _NO_REWARD
        task = load_task(task_dir)
        if self._environment_type == BUBBLEWRAP:
            self._sandbox = BubblewrapSandbox(task, self._sandbox_limits)
        else:
            sandbox = _HarborPackageSandbox(task, self._environment_type)
            sandbox.start()
            self._sandbox = sandbox
        self._task = task
        self._setup()
        return task.instruction + self.PROMPT_SUFFIX

    def _setup(self) -> None:
        """Harness-specific preparation once per ``reset``, after the sandbox is up (default: nothing)."""

    def _exec(self, command: str, timeout: float | None = None) -> str:
        """Run ``command`` (``bash -c``) in the task's sandbox; its combined stdout+stderr, truncated to 8000
        characters (``(empty output, rc=N)`` when there is none).

        Args:
            command: The shell command.
            timeout: Seconds before it is stopped (None: the backend's per-command limit).
        """
        if self._sandbox is None:
            raise RuntimeError(f"{type(self).__name__}: call reset(task_dir=...) before running commands.")
        return self._sandbox.exec(command, timeout)

    @property
    def task(self) -> HarborTask | None:
        """The current rollout's task (None before the first ``reset``)."""
        return self._task

    @property
    def reward(self) -> float:
        """The verifier's reward for this rollout: computed on first read (once), 0.0 before any ``reset``."""
        if self._sandbox is None:
            return 0.0
        if self._reward is _NO_REWARD:
            self._reward = float(self._sandbox.verify())
        return self._reward

    def _close_sandbox(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            sandbox.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # best-effort teardown at collection time
            self._close_sandbox()


_BASH_PROMPT_SUFFIX = (
    "\n\nYou have one tool, `bash`: it runs a shell command in the task's sandbox (working directory /workdir) and "
    "returns its combined stdout and stderr. The shell does not keep state between calls. Do the task with it; "
    "when the task asks for an answer, write it to /workdir/answer.txt with the `bash` tool, e.g. "
    '`echo -n "<value>" > /workdir/answer.txt`: stating it in prose does not count.'
)


class HarborBashEnv(HarborEnv):
    """The single-``bash``-tool harness; answers are submitted by writing ``/workdir/answer.txt``."""

    PROMPT_SUFFIX = _BASH_PROMPT_SUFFIX

    def bash(self, command: str) -> str:
        """Run a shell command in the sandbox and return its combined stdout and stderr. The shell keeps no state
        between calls. Use it to look around (ls, cat, head), run Python (`python3 -c "..."`), edit files, and
        submit answers (`echo -n "<value>" > /workdir/answer.txt`).

        Args:
            command: The shell command to run.

        Returns:
            The command's combined stdout and stderr.
        """
        return self._exec(command)


#: Built-in harnesses, by the name ``HarborSpec(agent=...)`` accepts.
AGENTS: dict[str, type[HarborEnv]] = {"bash": HarborBashEnv}
