"""Per-run control groups for the sandbox: a memory limit that counts every page the run owns, and a task limit.

A memory cgroup charges anonymous memory, page cache, tmpfs and memfd pages and kernel memory (pipe buffers,
socket buffers) to the run, summed over all its processes; the kernel's OOM killer then acts inside the group only.
``pids.max`` caps processes and threads together. At the end of a run (or at its timeout) every process left in the
group is killed (``cgroup.kill`` on v2, a kill loop on v1) and the group removed; failures are logged, never raised.

Where a group can be created (checked once per process, :func:`backend`):
    - cgroup v2: under ``$POSTTRAIN_SANDBOX_CGROUP`` (a delegated directory you can write, e.g. from systemd's
      ``Delegate=yes``), else under the parent of this process's own cgroup when that parent is writable (root) and
      has ``memory`` and ``pids`` in its ``cgroup.subtree_control``, else under the hierarchy root when this process
      lives in it. (A v2 group holding processes cannot also hold child groups with controllers, so this process's
      own cgroup is not usable by itself.)
    - cgroup v1 (hybrid hosts): under this process's own ``memory`` and ``pids`` groups, when both are writable (root,
      or a delegated v1 directory chowned to the user).
Otherwise there is no per-run cgroup; the sandbox says so in ``sandbox_capabilities()["cgroup_reason"]`` and falls
back to per-process limits (see ``posttrain.rewards.sandbox``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_counter = itertools.count()


@dataclass
class Backend:
    version: int  # 1 or 2
    parents: dict[str, str]  # controller ("memory", "pids"; "unified" on v2) -> per-process parent directory
    swap: bool = False  # v1 memsw / v2 memory.swap.max present
    created: list[str] = field(default_factory=list)


class RunCgroup:
    """The group(s) of one sandboxed run."""

    def __init__(self, backend: Backend, memory_bytes: int, max_tasks: int):
        self.backend = backend
        self.dirs: list[str] = []
        name = f"run-{next(_counter)}-{time.monotonic_ns() % 10**9}"
        try:
            for controller, parent in backend.parents.items():
                path = os.path.join(parent, name)
                os.mkdir(path)
                self.dirs.append(path)
                if backend.version == 2:
                    _write(path, "memory.max", str(memory_bytes))
                    if backend.swap:
                        _write(path, "memory.swap.max", "0")
                    _write(path, "memory.oom.group", "1")
                    _write(path, "pids.max", str(max_tasks))
                elif controller == "memory":
                    _write(path, "memory.limit_in_bytes", str(memory_bytes))
                    if backend.swap:
                        _write(path, "memory.memsw.limit_in_bytes", str(memory_bytes))
                elif controller == "pids":
                    _write(path, "pids.max", str(max_tasks))
        except OSError:
            self.remove()
            raise

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files:
            try:
                with open(path) as f:
                    found.update(int(x) for x in f.read().split())
            except OSError:
                continue
        return found

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer acted in this group (the run went over its memory limit)."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                try:
                    with open(os.path.join(d, name)) as f:
                        for line in f:
                            key, _, value = line.partition(" ")
                            if key == "oom_kill" and int(value) > 0:
                                return True
                except (OSError, ValueError):
                    continue
        return False

    def memory_peak(self) -> int | None:
        for d in self.dirs:
            for name in ("memory.peak", "memory.max_usage_in_bytes"):
                try:
                    with open(os.path.join(d, name)) as f:
                        return int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    continue
        return None

    def kill(self, deadline_s: float = 2.0) -> bool:
        """Kill every process in the group; True when it is empty afterwards."""
        if self.backend.version == 2:
            for d in self.dirs:
                with contextlib.suppress(OSError):
                    _write(d, "cgroup.kill", "1")
        end = time.monotonic() + deadline_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > end:
                return False
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def remove(self) -> None:
        """Kill what is left and remove the group; problems are logged, not raised."""
        try:
            if not self.kill():
                logger.warning("sandbox cgroup %s: processes survived the kill loop", self.dirs)
        except Exception as e:  # noqa: BLE001 -- cleanup must never raise into training
            logger.warning("sandbox cgroup kill failed: %s", e)
        for d in self.dirs:
            for attempt in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if attempt == 49:
                        logger.warning("could not remove sandbox cgroup %s: %s", d, e)
                    time.sleep(0.01)
        self.dirs = []


def _write(directory: str, name: str, value: str) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    found = []
    try:
        lines = _read("/proc/self/mountinfo").splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or len(rparts) < 3 or rparts[0] not in ("cgroup", "cgroup2"):
            continue
        found.append((parts[4].replace("\\040", " "), rparts[0], set(rparts[2].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Controller name (or "" for v2) -> this process's cgroup path."""
    paths = {}
    try:
        lines = _read("/proc/self/cgroup").splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale(base: str) -> None:
    """Remove the groups of trainers that died without cleaning up (e.g. SIGKILL mid-run); log, never raise."""
    try:
        entries = os.listdir(base)
    except OSError:
        return
    for entry in entries:
        match = re.fullmatch(r"posttrain-sandbox-(\d+)", entry)
        if not match or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        parent = os.path.join(base, entry)
        try:
            runs = [os.path.join(parent, d) for d in os.listdir(parent) if d.startswith("run-")]
        except OSError:
            continue
        stale = Backend(2 if os.path.exists(os.path.join(parent, "cgroup.kill")) else 1, {})
        for run in runs:
            group = RunCgroup.__new__(RunCgroup)
            group.backend, group.dirs = stale, [run]
            group.remove()
        try:
            os.rmdir(parent)
        except OSError as e:
            logger.warning("could not remove stale sandbox cgroup %s: %s", parent, e)


def _make_parent(base: str, controllers_v2: bool) -> str:
    _sweep_stale(base)
    parent = os.path.join(base, f"posttrain-sandbox-{os.getpid()}")
    os.makedirs(parent, exist_ok=True)
    if controllers_v2:
        enabled = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
        if not {"memory", "pids"} <= enabled:
            _write(parent, "cgroup.subtree_control", "+memory +pids")
    return parent


def _try_v2(mount: str, own: str) -> tuple[Backend | None, str]:
    candidates = []
    env = os.environ.get("POSTTRAIN_SANDBOX_CGROUP")
    if env:
        candidates.append(env if env.startswith(mount) else os.path.join(mount, env.lstrip("/")))
    here = os.path.join(mount, own.lstrip("/"))
    if own in ("", "/"):
        candidates.append(mount)
    else:
        candidates.append(os.path.dirname(here.rstrip("/")))
    reasons = []
    for base in candidates:
        try:
            available = set(_read(os.path.join(base, "cgroup.subtree_control")).split())
            if not {"memory", "pids"} <= available:
                if base == mount:
                    _write(base, "cgroup.subtree_control", "+memory +pids")
                else:
                    reasons.append(f"{base}: memory/pids not enabled in cgroup.subtree_control")
                    continue
            if not os.access(base, os.W_OK):
                reasons.append(f"{base} is not writable")
                continue
            parent = _make_parent(base, True)
            backend = Backend(2, {"unified": parent}, swap=os.path.exists(os.path.join(base, "memory.swap.max")))
            backend.created.append(parent)
            return backend, ""
        except OSError as e:
            reasons.append(f"{base}: {e.strerror or e}")
    return None, "; ".join(reasons) or "no candidate cgroup v2 directory"


def _try_v1(mounts: list[tuple[str, str, set[str]]], own: dict[str, str]) -> tuple[Backend | None, str]:
    parents: dict[str, str] = {}
    created: list[str] = []
    for controller in ("memory", "pids"):
        mount = next((m for m, fs, opts in mounts if fs == "cgroup" and controller in opts), None)
        if mount is None or controller not in own:
            return None, f"cgroup v1 '{controller}' hierarchy not mounted"
        base = os.path.join(mount, own[controller].lstrip("/"))
        if not os.access(base, os.W_OK):
            return None, f"{base} is not writable (needs root or a delegated cgroup)"
        try:
            parents[controller] = _make_parent(base, False)
            created.append(parents[controller])
        except OSError as e:
            return None, f"{base}: {e.strerror or e}"
    swap = os.path.exists(os.path.join(parents["memory"], "memory.memsw.limit_in_bytes"))
    return Backend(1, parents, swap=swap, created=created), ""


_backend: Backend | None = None
_reason: str | None = None
_backend_pid: int | None = None
_lock = threading.Lock()


def backend() -> tuple[Backend | None, str]:
    """The cgroup backend of this process (probed once; a forked child probes again), and why not when ``None``."""
    global _backend, _reason, _backend_pid
    with _lock:
        if _backend_pid != os.getpid():
            _backend, _reason = _probe()
            _backend_pid = os.getpid()
        return _backend, _reason or ""


def _probe() -> tuple[Backend | None, str]:
    if os.environ.get("POSTTRAIN_SANDBOX_NO_CGROUP"):
        return None, "disabled by POSTTRAIN_SANDBOX_NO_CGROUP"
    mounts = _mounts()
    own = _own_paths()
    reasons = []
    v2 = next((m for m, fs, _ in mounts if fs == "cgroup2"), None)
    if v2 is not None and "" in own:
        found, why = _try_v2(v2, own[""])
        if found is not None:
            return _checked(found)
        reasons.append("v2: " + why)
    if any(fs == "cgroup" for _, fs, _ in mounts):
        found, why = _try_v1(mounts, own)
        if found is not None:
            return _checked(found)
        reasons.append("v1: " + why)
    return None, "; ".join(reasons) or "no cgroup filesystem mounted"


def _checked(found: Backend) -> tuple[Backend | None, str]:
    try:  # one trial group proves the limits can be written
        RunCgroup(found, 64 << 20, 8).remove()
    except OSError as e:
        cleanup(found)
        return None, f"cgroup v{found.version}: cannot create a limited group: {e}"
    return found, ""


def cleanup(found: Backend | None = None) -> None:
    """Remove this process's parent groups (at exit); failures are logged."""
    target = found or _backend
    if target is None or _backend_pid not in (None, os.getpid()):
        return
    for path in target.created:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("could not remove sandbox cgroup %s: %s", path, e)
