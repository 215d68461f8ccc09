"""``environment_type="bubblewrap"``: a Harbor task run in posttrain's bubblewrap sandbox, without Docker.

What a task gets (beyond TRL, which needs Harbor's container backends):

- **the host's userland, read-only**: ``/usr`` (``bash``, coreutils, ``python3``, ...), the trainer's Python; the
  task's Dockerfile is *not built* (a warning says so). Of it, a documented subset is honoured: ``WORKDIR`` (where
  the workspace is mounted; default ``/workdir``) and ``COPY``/``ADD`` of local files of ``environment/`` into the
  workspace. ``RUN``, ``ENV``, ``FROM`` and the rest are ignored. Tasks that cannot work are refused up front:
  files copied outside the workspace, remote ``ADD`` sources, verifiers that install packages or download
  (``apt-get``, ``pip``, ``uv``, ``curl``, ``wget``, ...), a verifier interpreter the host lacks.
- **a private writable copy of the workspace**, one per rollout, kept across the agent's commands;
- **one sandbox per command** (:func:`posttrain.rewards.sandbox.run_files`): no network at all, new PID/IPC/UTS/user
  namespaces (every process of a command dies with it), seccomp, memory and process limits, a per-command timeout,
  bounded output; the workspace's size is checked after every command (over quota: reset to the task's files);
- **the verifier, once, after the rollout**, in a sandbox of its own: the workspace, the task's ``tests/`` at
  ``/tests`` (read-only; the agent never sees them) and a fresh, empty ``/logs/verifier`` that exists only for that
  run, so nothing the agent did can pre-write the reward. The reward file is read *outside* the sandbox (never
  following a link, size-capped) and validated: a finite float, else :class:`HarborVerifierError` naming the task.
  A verifier past its timeout scores 0.0. Caveat (as in Harbor's containers): a verifier that *executes* the
  agent's code (imports a module the agent edited, runs its script) gives that code the verifier's rights, including
  writing the reward; verifiers that only read the agent's outputs cannot be forged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import stat
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from posttrain.experimental.harbor._task import HarborTask, HarborTaskError
from posttrain.rewards.sandbox import Bind, SandboxResult, bind_target_problem, run_files

logger = logging.getLogger(__name__)

BUBBLEWRAP = "bubblewrap"
DEFAULT_WORKDIR = "/workdir"
TESTS_DIR = "/tests"
VERIFIER_DIR = "/logs/verifier"
_MAX_REWARD_BYTES = 65536
_MAX_COMMAND_BYTES = 65536
_warned_tasks: set[str] = set()


class HarborVerifierError(RuntimeError):
    """A task's verifier did not produce a usable reward (the message names the task, what was wrong, and the tail
    of the verifier's output)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Bounds of the ``"bubblewrap"`` backend, per rollout.

    Attributes:
        command_timeout_s: Wall-clock limit of one agent command (the whole command's process tree is killed).
        max_output_chars: The agent sees at most this many characters of a command's combined stdout+stderr (TRL's
            8000); the rest is read and dropped, and ``... [truncated]`` marks the cut.
        memory_mb: Memory of one command or verifier run (all its processes). A task's ``[environment] memory_mb``
            is used when smaller.
        disk_mb: Size quota of the workspace (checked after each command). A task's ``[environment] storage_mb`` is
            used when smaller.
        max_files: Entries the workspace may hold (checked after each command).
        max_file_mb: Largest file a command may write (``RLIMIT_FSIZE``).
        max_processes: Processes and threads of one command.
        verifier_timeout_s: Upper bound on the verifier's run (a task's ``[verifier] timeout_sec`` when smaller).
        agent_timeout_s: Upper bound on the agent's total command time per rollout (a task's ``[agent]
            timeout_sec`` when smaller); past it, commands are refused with a message.
    """

    command_timeout_s: float = 30.0
    max_output_chars: int = 8000
    memory_mb: int = 1024
    disk_mb: int = 64
    max_files: int = 4096
    max_file_mb: int = 16
    max_processes: int = 64
    verifier_timeout_s: float = 120.0
    agent_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}.")


# --- the task's Dockerfile: the documented subset ------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    workdir: str
    copies: tuple[tuple[Path, str], ...]  # (source under environment/, destination relative to the workspace)
    ignored: tuple[str, ...]  # Dockerfile instructions not honoured


def _dockerfile_lines(text: str) -> list[str]:
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def plan_workspace(task: HarborTask) -> _Plan:
    """What the ``"bubblewrap"`` backend takes from the task's Dockerfile (see the module docstring).

    Raises:
        HarborTaskError: a ``COPY``/``ADD`` this backend cannot honour.
    """
    dockerfile = task.environment_dir / "Dockerfile"
    workdir, copies, ignored = DEFAULT_WORKDIR, [], []
    if not dockerfile.is_file():
        return _Plan(workdir, (), ())
    env_root = task.environment_dir.resolve()
    for line in _dockerfile_lines(dockerfile.read_text(encoding="utf-8", errors="replace")):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "WORKDIR":
            target = rest.strip().strip('"')
            workdir = str(PurePosixPath(workdir) / target) if not target.startswith("/") else target
            workdir = os.path.normpath(workdir)
        elif keyword in ("COPY", "ADD"):
            if rest.lstrip().startswith("["):
                try:
                    parts = [str(p) for p in json.loads(rest)]
                except ValueError as e:
                    raise HarborTaskError(f"Harbor task {task.name!r}: unreadable Dockerfile line {line!r}.") from e
            else:
                parts = shlex.split(rest)
            flags = [p for p in parts if p.startswith("--")]
            parts = [p for p in parts if not p.startswith("--")]
            if any(f.startswith("--from") for f in flags) or len(parts) < 2:
                raise HarborTaskError(
                    f"Harbor task {task.name!r}: the bubblewrap backend cannot honour Dockerfile line {line!r} "
                    "(multi-stage or malformed copy); use environment_type='docker' with the harbor package."
                )
            *sources, dest = parts
            dest_abs = os.path.normpath(dest if dest.startswith("/") else str(PurePosixPath(workdir) / dest))
            into_dir = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
            for source in sources:
                if "://" in source:
                    raise HarborTaskError(
                        f"Harbor task {task.name!r}: Dockerfile line {line!r} downloads {source}; the bubblewrap "
                        "sandbox has no network. Put the file in environment/ instead."
                    )
                local = (task.environment_dir / source).resolve()
                if not (local == env_root or str(local).startswith(str(env_root) + os.sep)) or not local.exists():
                    raise HarborTaskError(
                        f"Harbor task {task.name!r}: Dockerfile line {line!r} copies {source!r}, which is not a "
                        "file or directory inside environment/."
                    )
                # a directory's contents go into the destination; a file into it (when it names a directory)
                target = dest_abs if local.is_dir() or not into_dir else os.path.join(dest_abs, local.name)
                copies.append((line, local, target))
        else:
            ignored.append(keyword)
    placed = []
    for line, local, target in copies:  # checked against the final WORKDIR: the workspace the agent gets
        if not (target == workdir or target.startswith(workdir.rstrip("/") + "/")):
            raise HarborTaskError(
                f"Harbor task {task.name!r}: Dockerfile line {line!r} copies to {target}, outside the workspace "
                f"{workdir}; the bubblewrap backend has a read-only root and can only place files in the workspace. "
                "Copy them under WORKDIR, or use environment_type='docker' with the harbor package."
            )
        placed.append((local, os.path.relpath(target, workdir)))
    return _Plan(workdir, tuple(placed), tuple(ignored))


_INSTALLERS = re.compile(
    r"(?m)(?:^|[;&|(`]|\$\(|\bthen\b|\bdo\b)\s*(?:sudo\s+)?"
    r"(apt-get|apt|yum|dnf|apk|pip3?|uv|uvx|curl|wget|npm|npx|conda|git\s+clone)\b"
)


def check_supported(task: HarborTask) -> _Plan:
    """Refuse a task the bubblewrap backend cannot run faithfully; else return its workspace plan.

    Raises:
        HarborTaskError: naming the task and what it needs that the sandbox lacks.
    """
    plan = plan_workspace(task)
    problem = bind_target_problem(plan.workdir)
    if problem is not None or any(
        plan.workdir == p or plan.workdir.startswith(p + "/") or p.startswith(plan.workdir + "/")
        for p in (TESTS_DIR, VERIFIER_DIR)
    ):
        raise HarborTaskError(
            f"Harbor task {task.name!r}: its Dockerfile's WORKDIR {plan.workdir} cannot hold the workspace in the "
            f"bubblewrap sandbox ({problem or 'it overlaps /tests or /logs/verifier'}). Use a directory such as "
            f"{DEFAULT_WORKDIR}."
        )
    script = (task.tests_dir / "test.sh").read_text(encoding="utf-8", errors="replace")
    match = _INSTALLERS.search(script)
    if match:
        line = script[: match.start(1)].count("\n") + 1
        raise HarborTaskError(
            f"Harbor task {task.name!r}: tests/test.sh line {line} runs {match.group(1)!r}, which needs the network "
            "or a package install; the bubblewrap sandbox has neither (the host's userland is used as is). Rely on "
            "tools the host has, or use environment_type='docker' with the harbor package."
        )
    if script.startswith("#!"):
        interpreter = script[2:].splitlines()[0].strip().split()
        if interpreter:
            program = interpreter[1] if os.path.basename(interpreter[0]) == "env" and len(interpreter) > 1 else None
            path = interpreter[0] if program is None else shutil.which(program, path=_SANDBOX_PATH)
            if path is None or not os.path.exists(path) or not _visible_in_sandbox(path):
                raise HarborTaskError(
                    f"Harbor task {task.name!r}: tests/test.sh's interpreter {' '.join(interpreter)!r} is not on "
                    "this host's /usr; the bubblewrap sandbox only has the host's userland."
                )
    return plan


def _visible_in_sandbox(path: str) -> bool:
    real = os.path.realpath(path)
    return real.startswith("/usr/") or real.startswith(_python_bin_dir() + "/")


def _python_bin_dir() -> str:
    import sys

    return os.path.dirname(os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable))


_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


def _sandbox_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # the host's python3 first (/usr/bin), the trainer's interpreter (bound read-only) as a fallback
    return {"PATH": f"{_SANDBOX_PATH}:{_python_bin_dir()}", "HOME": "/sandbox", **(extra or {})}


def warn_dockerfile_not_built(task: HarborTask, plan: _Plan) -> None:
    """Say once per task that its Dockerfile is not built (and what of it is ignored)."""
    key = str(task.path)
    if key in _warned_tasks or not (task.environment_dir / "Dockerfile").is_file():
        return
    _warned_tasks.add(key)
    ignored = sorted(set(plan.ignored))
    logger.warning(
        "Harbor task %r runs in the bubblewrap sandbox on this host's userland: its Dockerfile is not built "
        "(honoured: WORKDIR, local COPY/ADD into the workspace; ignored: %s).",
        task.name,
        ", ".join(ignored) or "nothing",
    )


# --- the per-rollout sandbox ---------------------------------------------------------------------------------------

# Runs (inside the sandbox, after the resource limits are set) one agent command: combined stdout+stderr read to
# the end, the first `cap` bytes kept; the exit status on the last line of stderr.
_COMMAND_MAIN = r"""
import subprocess, sys
with open("/sandbox/command.sh", encoding="utf-8") as f:
    command = f.read()
cap = CAP
proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT)
kept, total = bytearray(), 0
while True:
    chunk = proc.stdout.read1(65536)
    if not chunk:
        break
    total += len(chunk)
    if len(kept) < cap:
        kept += chunk[: cap - len(kept)]
rc = proc.wait()
sys.stdout.buffer.write(bytes(kept))
sys.stdout.flush()
sys.stderr.write("\nposttrain-harbor %d %d\n" % (rc, total))
"""

_VERIFY_MAIN = r"""
import os
fd = os.open("/logs/verifier/test-stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(fd, 1)
os.dup2(fd, 2)
os.close(fd)
os.execvp("bash", ["bash", "/tests/test.sh"])
"""

_STATUS = re.compile(r"\nposttrain-harbor (-?\d+) (\d+)\n\Z")


class BubblewrapSandbox:
    """One rollout's Harbor task in posttrain's bubblewrap sandbox (see the module docstring).

    Args:
        task: The task (already checked with :func:`check_supported`, or checked here).
        limits: The bounds; a task's own smaller ``[environment]``/``[agent]``/``[verifier]`` values win.
    """

    def __init__(self, task: HarborTask, limits: SandboxLimits | None = None) -> None:
        self.task = task
        self.limits = limits or SandboxLimits()
        self.plan = check_supported(task)
        warn_dockerfile_not_built(task, self.plan)
        env = task.environment
        self.memory_mb = int(min(self.limits.memory_mb, env.get("memory_mb") or self.limits.memory_mb))
        self.disk_mb = float(min(self.limits.disk_mb, env.get("storage_mb") or self.limits.disk_mb))
        self.agent_budget_s = float(min(self.limits.agent_timeout_s, task.agent_timeout_s or math.inf))
        self.verifier_timeout_s = float(min(self.limits.verifier_timeout_s, task.verifier_timeout_s or math.inf))
        self.agent_time_s = 0.0
        self.verifier_runs = 0
        # A 0711 root (the sandbox's unprivileged user may traverse, not list) holding world-readable copies.
        self._root = tempfile.mkdtemp(prefix=f"posttrain-harbor-{os.getpid()}-")
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._root, ignore_errors=True)
        os.chmod(self._root, 0o711)
        self.workspace = os.path.join(self._root, "workspace")
        self._populate()

    # -- lifecycle

    def _populate(self) -> None:
        if os.path.lexists(self.workspace):
            shutil.rmtree(self.workspace)
        os.mkdir(self.workspace, 0o755)
        for source, rel in self.plan.copies:
            target = os.path.normpath(os.path.join(self.workspace, rel))
            if source.is_dir():
                shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(source, target, follow_symlinks=False)
        _open_up(self.workspace)

    def close(self) -> None:
        """Remove the rollout's files (also done when the object is collected)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # -- agent commands

    def exec(self, command: str, timeout: float | None = None) -> str:
        """Run ``command`` with ``bash -c`` in the workspace; its combined stdout+stderr for the agent.

        Never raises for what the command does: time-outs, limits and quota resets come back as text.
        """
        if self.closed:
            raise RuntimeError("This Harbor sandbox is closed; reset the environment first.")
        if not isinstance(command, str):
            return f"error: the command must be a string, got {type(command).__name__}."
        if len(command.encode("utf-8", "replace")) > _MAX_COMMAND_BYTES:
            return f"error: the command is longer than {_MAX_COMMAND_BYTES} bytes; write long content in parts."
        left = self.agent_budget_s - self.agent_time_s
        if left <= 0:
            return (
                f"error: the agent's time budget for this task ({self.agent_budget_s:g} s) is spent; "
                "no more commands run."
            )
        timeout = min(float(timeout or self.limits.command_timeout_s), self.limits.command_timeout_s, left)
        cap = self.limits.max_output_chars * 4 + 4  # bytes: up to 4 per UTF-8 character
        result = self._run(
            {"main.py": _COMMAND_MAIN.replace("CAP", str(cap)), "command.sh": command},
            binds=(Bind(self.workspace, self.plan.workdir, writable=True),),
            timeout=timeout,
            env=_sandbox_env(),
        )
        self.agent_time_s += result.duration
        out = self._agent_text(result, timeout)
        quota = self._check_quota()
        return out + quota

    def _agent_text(self, result: SandboxResult, timeout: float) -> str:
        match = _STATUS.search(result.stderr)
        text = result.stdout
        if result.status == "timeout":
            return (text + "\n" if text else "") + f"[the command timed out after {timeout:g} s and was stopped]"
        if match is None:
            if result.status == "sandbox_error":
                raise RuntimeError(f"Harbor task {self.task.name!r}: the sandbox failed to start: {result.stderr}")
            return (text + "\n" if text else "") + f"[the command was stopped: {result.status}]"
        rc, total = int(match.group(1)), int(match.group(2))
        limit = self.limits.max_output_chars
        if len(text) > limit or total > len(result.stdout.encode("utf-8", "replace")):
            text = text[:limit] + "\n... [truncated]"
        return text or f"(empty output, rc={rc})"

    def _check_quota(self) -> str:
        total, entries = _tree_size(self.workspace)
        if total <= self.disk_mb * 1024 * 1024 and entries <= self.limits.max_files:
            return ""
        self._populate()
        return (
            f"\n[the workspace grew past its quota ({self.disk_mb:g} MB, {self.limits.max_files} entries) and was "
            "reset to the task's initial files]"
        )

    # -- the verifier

    def verify(self) -> float:
        """Run ``tests/test.sh`` once in a fresh sandbox and return the reward it wrote (read and checked here).

        Raises:
            HarborVerifierError: no reward file, or an unreadable or non-finite reward (a bug of the task's verifier).

        A verifier that runs past its timeout scores 0.0 (logged): what it runs may be the agent's code (an endless
        loop in a function the tests call), which must not stop training.
        """
        if self.closed:
            raise RuntimeError("This Harbor sandbox is closed; reset the environment first.")
        self.verifier_runs += 1
        run_dir = tempfile.mkdtemp(prefix="verify-", dir=self._root)
        os.chmod(run_dir, 0o711)
        tests = os.path.join(run_dir, "tests")
        shutil.copytree(self.task.tests_dir, tests, symlinks=True)
        _open_up(tests)
        logs = os.path.join(run_dir, "verifier")
        os.mkdir(logs, 0o755)
        result = self._run(
            {"main.py": _VERIFY_MAIN},
            binds=(
                Bind(self.workspace, self.plan.workdir, writable=True),
                Bind(tests, TESTS_DIR),
                Bind(logs, VERIFIER_DIR, writable=True),
            ),
            timeout=self.verifier_timeout_s,
            env=_sandbox_env(self.task.verifier_env),
        )
        output = _read_capped(os.path.join(logs, "test-stdout.txt"), 4000, tail=True) or ""
        if result.status == "timeout":
            logger.warning(
                "Harbor task %r: the verifier timed out after %g s; the rollout scores 0.0.",
                self.task.name,
                self.verifier_timeout_s,
            )
            return 0.0
        if result.status == "sandbox_error":
            raise self._verifier_error(f"the sandbox failed to start: {result.stderr.strip()}", output)
        return self._read_reward(logs, output)

    def _verifier_error(self, what: str, output: str) -> HarborVerifierError:
        tail = f"\n--- tail of the verifier's output ---\n{output[-2000:]}" if output.strip() else ""
        return HarborVerifierError(f"Harbor task {self.task.name!r} ({self.task.path}): {what}.{tail}")

    def _read_reward(self, logs: str, output: str) -> float:
        json_path, text_path = os.path.join(logs, "reward.json"), os.path.join(logs, "reward.txt")
        if os.path.lexists(json_path):
            raw = self._read_reward_file(json_path, output)
            try:
                parsed = json.loads(raw)
            except ValueError as e:
                raise self._verifier_error(f"{VERIFIER_DIR}/reward.json is not JSON ({e})", output) from e
            if not isinstance(parsed, dict):
                raise self._verifier_error(
                    f"{VERIFIER_DIR}/reward.json must be an object like {{'reward': 1.0}}", output
                )
            numbers = {k: v for k, v in parsed.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if "reward" in numbers:
                value = numbers["reward"]
            elif os.path.lexists(text_path):
                value = self._text_reward(text_path, output)
            elif numbers:
                value = next(iter(numbers.values()))
            else:
                raise self._verifier_error(f"{VERIFIER_DIR}/reward.json holds no numeric value: {raw[:200]!r}", output)
        elif os.path.lexists(text_path):
            value = self._text_reward(text_path, output)
        else:
            raise self._verifier_error(
                f"the verifier wrote neither {VERIFIER_DIR}/reward.txt nor reward.json (exit status of tests/test.sh "
                "unknown); a verifier must always write a reward, 0 on failure",
                output,
            )
        value = float(value)
        if not math.isfinite(value):
            raise self._verifier_error(f"the reward is not finite ({value})", output)
        return value

    def _text_reward(self, path: str, output: str) -> float:
        raw = self._read_reward_file(path, output)
        try:
            return float(raw.strip())
        except ValueError as e:
            raise self._verifier_error(
                f"{VERIFIER_DIR}/reward.txt must hold one number, got {raw[:200]!r}", output
            ) from e

    def _read_reward_file(self, path: str, output: str) -> str:
        raw = _read_capped(path, _MAX_REWARD_BYTES)
        name = f"{VERIFIER_DIR}/{os.path.basename(path)}"
        if raw is None:
            raise self._verifier_error(f"{name} is not a regular file", output)
        if not raw.strip():
            raise self._verifier_error(f"{name} is empty", output)
        return raw

    # -- one sandboxed run

    def _run(self, files: dict[str, str], *, binds: tuple[Bind, ...], timeout: float, env: dict[str, str]):
        return run_files(
            files,
            "main.py",
            timeout=timeout,
            memory_mb=self.memory_mb,
            max_output_bytes=max(65536, self.limits.max_output_chars * 4 + 4096),
            max_processes=self.limits.max_processes,
            max_file_mb=self.limits.max_file_mb,
            disk_mb=64,
            binds=binds,
            env=env,
            cwd=self.plan.workdir,
        )


def _open_up(path: str) -> None:
    """Make a copied tree readable (and its directories traversable) by the sandbox's unprivileged user."""
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for name in files:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                mode = os.stat(full).st_mode
                os.chmod(full, 0o755 if mode & stat.S_IXUSR else 0o644)


def _tree_size(path: str) -> tuple[int, int]:
    """Bytes of regular files and number of entries under ``path`` (links never followed)."""
    total = entries = 0
    for root, dirs, files in os.walk(path, followlinks=False):
        entries += len(dirs) + len(files)
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_blocks * 512 if st.st_blocks else st.st_size
    return total, entries


def _read_capped(path: str, cap: int, tail: bool = False) -> str | None:
    """A regular file's text (at most ``cap`` bytes; the last ones with ``tail``); None when it is missing, a link
    or not a regular file. Opened with ``O_NOFOLLOW``: a link planted in the sandbox never leads to a host file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if tail and st.st_size > cap:
            os.lseek(fd, st.st_size - cap, os.SEEK_SET)
        data = os.read(fd, cap)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace")
