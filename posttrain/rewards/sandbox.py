"""Run untrusted, model-generated Python in a separate, locked-down process.

``run_python(code)`` runs a program in a fresh interpreter (``python -I -S -B``) and returns a
:class:`SandboxResult`; ``sandbox_capabilities()`` says what this machine enforces. Failures of the program are
reported in ``SandboxResult.status``, never raised; the call returns by its deadline whatever the program does.

``isolation="auto"`` (default; also ``"strict"``, and ``"namespaces"`` as an alias of ``"auto"``) -- the same for
root and non-root callers:
    - bubblewrap (``bwrap``, Debian package ``bubblewrap``): new user, PID, network, IPC, UTS, mount (and cgroup)
      namespaces; no network at all (a network namespace with only a loopback that is down); a minimal read-only
      root holding ``/usr``, the Python installation and ``/etc/ld.so.cache``; ``/dev`` with ``null``, ``zero``,
      ``full``, ``random``, ``urandom`` only; a fresh ``/proc`` showing only the sandbox's own processes;
      size-limited tmpfs ``/tmp`` and working directory ``/sandbox`` (``disk_mb`` each); ``--die-with-parent`` (the
      sandbox dies with the trainer), ``--new-session``, further user namespaces disabled; every process of the run
      dies with the PID namespace when the program exits (``setsid`` daemons included);
    - never root: as root the launcher (``/bin/sh`` with util-linux ``setpriv``; a Python fallback) switches to a
      per-run unprivileged user id before bubblewrap starts (the program runs as uid 1000 inside a user namespace
      mapped onto that id, without capabilities); non-root callers run it under their own id, equally mapped;
    - a per-run cgroup (:mod:`posttrain.rewards._sandbox_cgroup`; v2, or v1 on hybrid hosts): ``memory_mb`` for the
      whole run (all processes together, including tmpfs, memfd and pipe buffers; swap off) and ``max_processes``
      tasks; the whole group is killed at the end or at the timeout. Where no cgroup can be created (a non-root user
      without a delegated cgroup, a read-only ``/sys/fs/cgroup``), ``"auto"`` falls back to the strongest equivalent
      and logs a warning once: ``RLIMIT_AS`` per process times ``RLIMIT_NPROC`` processes (counted per sandbox,
      because each sandbox has its own user namespace), ``memfd_create`` denied by seccomp, tmpfs size limits;
      ``"strict"`` refuses to run instead;
    - a seccomp filter (:mod:`posttrain.rewards._sandbox_seccomp`, compiled with libseccomp via ``pyseccomp``, loaded
      by ``bwrap --seccomp``): ``io_uring``, ``perf_event_open``, ``userfaultfd``, ``bpf``, ``ptrace``, mounts,
      namespaces, keyrings, kernel modules and similar calls fail with ``EPERM``;
    - ``oom_score_adj=1000`` for every sandboxed process, so a host-wide OOM kills a sandbox before the trainer;
    - resource limits inside (``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_NPROC``,
      no core dumps; hard limits, so the program cannot raise them), an environment reduced to ``PATH``, ``HOME``,
      ``TMPDIR``, ``LANG``; stdout/stderr captured up to ``max_output_bytes`` each (killed beyond).
    If bubblewrap or the seccomp binding is missing, or user namespaces are disabled, ``"auto"`` raises
    :class:`SandboxUnavailable` saying what to install or enable.
``isolation="basic"`` (explicit opt-in only; logs a loud warning): the old fallback without bubblewrap -- a
    ``sys.addaudithook`` preamble refusing process creation, signals, sockets, ``ctypes`` and file access outside
    the working directory. Audit hooks are not a security boundary; use it for honest mistakes only. As root it
    switches to a per-run uid and refuses to run when it cannot (model code never runs as root).

``run_files(..., binds=[Bind(host_dir, "/workdir", writable=True)], env=..., cwd="/workdir")`` additionally shows
chosen host directories at chosen paths (read-only unless ``writable``; handed to the run's uid as root), for
environments whose state outlives one run (the Harbor backend: one run per shell command over a kept workspace).

Not enforced: CPU share (no cpu controller; ``RLIMIT_CPU`` per process and the wall-clock timeout bound it),
read access to ``/usr`` and the Python installation, and timing side channels.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from posttrain.rewards import _sandbox_cgroup, _sandbox_seccomp

logger = logging.getLogger(__name__)

Isolation = Literal["auto", "strict", "namespaces", "basic"]
_ISOLATIONS = ("auto", "strict", "namespaces", "basic")

# Per-run user ids (root callers) live far above the ids a distribution hands out; each concurrent run of this
# process gets its own, so nothing the program leaves behind can be confused with another run's.
_UID_BASE = 1_000_000
_UIDS_PER_PROCESS = 100
_INNER_UID = 1000  # the program's uid inside its user namespace
_SETUP_FAILED = 125  # the launcher's exit status when it could not start bubblewrap


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be set up on this machine (the message says what to install or enable)."""


# Trusted launcher, started by the trainer: joins the run's cgroup, raises its oom_score_adj, (as root) makes the
# Python installation reachable for the unprivileged uid in a private mount namespace and drops to that uid, then
# becomes bubblewrap. Everything it does is inherited by bubblewrap and the program. Normally a few lines of
# /bin/sh with util-linux's setpriv/unshare/mount (_launcher_argv); this Python version is the fallback.
_LAUNCHER = r"""
import json, os, sys
cfg = json.loads(sys.argv[1])
try:
    import ctypes
    def die_with_caller():  # PR_SET_PDEATHSIG SIGKILL until bwrap's --die-with-parent (a uid change clears it)
        ctypes.CDLL(None).prctl(1, 9)
        if os.getppid() != cfg["caller"]:
            os._exit(125)  # the trainer died before the line above
    die_with_caller()
    for path in cfg["cgroup_procs"]:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    if cfg["binds"]:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        def check(ret, what):
            if ret != 0:
                err = ctypes.get_errno()
                raise OSError(err, "%s: %s" % (what, os.strerror(err)))
        check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
        check(libc.mount(None, b"/", None, 16384 | (1 << 18), None), "make / private")
        for src, dst in cfg["binds"]:
            os.mkdir(dst, 0o755)
            check(libc.mount(src.encode(), dst.encode(), None, 4096 | 16384, None), "bind " + src)
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        die_with_caller()
    os.execv(cfg["bwrap"], cfg["argv"])
except BaseException as e:
    os.write(2, ("sandbox launcher: %s: %s\n" % (type(e).__name__, e)).encode())
    os._exit(125)
"""

# First code inside the sandbox (trusted): sets the hard resource limits, then runs the program as __main__.
_PRELUDE = r"""
import json, resource, sys
_cfg = json.loads(sys.argv[1])
for _res, _soft, _hard in _cfg["rlimits"]:
    resource.setrlimit(_res, (_soft, _hard))
sys.argv = [_cfg["main"]]
with open(_cfg["main"], "rb") as _f:
    _code = compile(_f.read(), _cfg["main"], "exec")
_globals = {"__name__": "__main__", "__file__": _cfg["main"], "__builtins__": __builtins__}
del _cfg, _res, _soft, _hard, _f
exec(_code, _globals)
"""

_BASIC_RUNNER = r"""
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
for res, soft, hard in cfg["rlimits"]:
    resource.setrlimit(res, (soft, hard))
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
os.chdir(cfg["workdir"])

def _install(workdir, read_roots):
    realpath, fspath, sep = os.path.realpath, os.fspath, os.sep
    blocked_events = frozenset((
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
        "os.kill", "os.killpg", "signal.pthread_kill", "pty.spawn", "socket.__new__", "socket.connect",
        "socket.bind", "socket.getaddrinfo", "socket.gethostbyname", "socket.sendto", "ctypes.dlopen",
        "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
    ))
    blocked_modules = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket"))
    listing_events = frozenset(("os.listdir", "os.scandir"))  # the import system lists stdlib directories
    path_events = frozenset((
        "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
        "os.truncate", "os.utime", "shutil.rmtree", "os.chflags",
    ))

    def inside(path, roots):
        try:
            p = realpath(fspath(path))
        except (TypeError, ValueError):
            return False
        if isinstance(p, bytes):
            p = p.decode(errors="replace")
        return any(p == r or p.startswith(r + sep) for r in roots)

    def hook(event, args):
        if event in blocked_events:
            raise PermissionError("sandbox: %s is not allowed" % event)
        if event == "import" and args[0].split(".")[0] in blocked_modules:
            raise PermissionError("sandbox: importing %s is not allowed" % args[0])
        if event == "open":
            path, mode = args[0], args[1]
            if isinstance(path, int):
                return
            writing = mode is not None and any(c in str(mode) for c in "wax+")
            if isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
                writing = True
            if inside(path, (workdir,)) or (not writing and inside(path, read_roots)):
                return
            raise PermissionError("sandbox: access to %r is not allowed" % (path,))
        if event in listing_events and args and not isinstance(args[0], int):
            if not inside("." if args[0] is None else args[0], (workdir, *read_roots)):
                raise PermissionError("sandbox: %s on %r is not allowed" % (event, args[0]))
        if event in path_events and args and not isinstance(args[0], int) and not inside(args[0], (workdir,)):
            raise PermissionError("sandbox: %s on %r is not allowed" % (event, args[0]))

    sys.addaudithook(hook)

_roots = sorted({os.path.realpath(p) for p in cfg["read_roots"]} | {"/dev/null", "/dev/urandom"})
_install(os.path.realpath(cfg["workdir"]), tuple(_roots))
with open(cfg["main"], "rb") as _f:
    _code = compile(_f.read(), cfg["main"], "exec")
sys.argv = [cfg["main"]]
_globals = {"__name__": "__main__", "__file__": cfg["main"], "__builtins__": __builtins__}
del cfg, _roots, _f, _install
exec(_code, _globals)
"""


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        status: ``"ok"`` (exit 0), ``"error"`` (non-zero exit, e.g. an uncaught exception), ``"timeout"`` (wall clock
            or CPU limit), ``"memory"`` (``MemoryError`` under the address-space limit, or the run's cgroup went over
            its memory limit), ``"output_limit"`` (stdout or stderr exceeded ``max_output_bytes``; the run was
            killed), ``"killed"`` (ended by a signal), or ``"sandbox_error"`` (the sandbox itself could not be set
            up; ``stderr`` says why).
        stdout: Captured standard output (UTF-8, undecodable bytes replaced), at most ``max_output_bytes``.
        stderr: Captured standard error, same cap.
        returncode: Exit status, ``-signal`` when killed by a signal, ``None`` when it never finished.
        duration: Wall-clock seconds from start to the end of the run.
        truncated: Whether stdout or stderr hit the cap.
    """

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    duration: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Bind:
    """A host directory made visible inside a bubblewrap sandbox at ``target``.

    Used by environments whose state outlives one program run (e.g. a Harbor task's workspace, one sandboxed run
    per shell command). Read-only unless ``writable``; a writable bind is on the host's disk, so its size is bounded
    only by ``max_file_mb`` per file and the run's timeout: callers check its size between runs. As root, a writable
    bind's tree is handed to the run's unprivileged uid first (``lchown``, symlinks never followed), and every
    bind's source must be reachable by other users (the unprivileged bubblewrap mounts it).

    Attributes:
        source: An existing host directory.
        target: An absolute path inside the sandbox, outside the system paths the sandbox itself sets up.
        writable: Whether the program may write to it.
    """

    source: str
    target: str
    writable: bool = False


_RESERVED_TARGETS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev",
                     "/tmp", "/sandbox")  # fmt: skip
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def bind_target_problem(target: str, python_dirs: list[str] | None = None) -> str | None:
    """Why ``target`` cannot be a :class:`Bind` target (None when it can): not a normalised absolute path, or it
    overlaps a path the sandbox sets up itself (the system directories, ``/tmp``, ``/sandbox``, the Python)."""
    norm = os.path.normpath(target) if isinstance(target, str) else ""
    if not norm.startswith("/") or norm == "/" or norm != target.rstrip("/"):
        return f"Bind target {target!r} must be a normalised absolute path, used once."
    system = [*_RESERVED_TARGETS, *(python_dirs if python_dirs is not None else _python_dirs())]
    if any(norm == r or norm.startswith(r.rstrip("/") + "/") or r.startswith(norm + "/") for r in system):
        return (
            f"Bind target {target!r} overlaps a path the sandbox sets up itself ({', '.join(system)}); pick another, "
            "e.g. '/workdir'."
        )
    return None


def _check_binds(binds: tuple[Bind, ...]) -> None:
    python_dirs = _python_dirs()
    seen: set[str] = set()
    for bind in binds:
        if not isinstance(bind, Bind):
            raise TypeError(f"binds must hold posttrain.rewards.sandbox.Bind objects, got {type(bind).__name__}.")
        problem = bind_target_problem(bind.target, python_dirs)
        if problem is not None:
            raise ValueError(problem)
        target = os.path.normpath(bind.target)
        if target in seen:
            raise ValueError(f"Bind target {bind.target!r} must be a normalised absolute path, used once.")
        if not os.path.isdir(bind.source) or os.path.islink(bind.source):
            raise ValueError(f"Bind source {bind.source!r} is not a directory (symlinks are refused).")
        if _is_root() and not _world_reachable(bind.source):
            raise ValueError(
                f"Bind source {bind.source!r} is not reachable by other users; the sandbox's unprivileged user must "
                "traverse every parent directory (mode o+x) to mount it. Put it under a directory with mode 0711."
            )
        seen.add(target)


def _hand_over(path: str, uid: int) -> None:
    """Give a writable bind's tree to ``uid`` (``lchown``: a symlink left by an earlier run is never followed)."""
    os.lchown(path, uid, uid)
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                os.lchown(os.path.join(root, name), uid, uid)


class _UidPool:
    """Hands out distinct unprivileged user ids to concurrent runs of this process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._base = _UID_BASE + (os.getpid() % 10_000) * _UIDS_PER_PROCESS

    def acquire(self) -> int:
        with self._lock:
            for offset in range(_UIDS_PER_PROCESS):
                uid = self._base + offset
                if uid not in self._busy:
                    self._busy.add(uid)
                    return uid
        raise RuntimeError(f"More than {_UIDS_PER_PROCESS} concurrent sandbox runs; lower max_workers.")

    def release(self, uid: int) -> None:
        with self._lock:
            self._busy.discard(uid)


_uid_pool: _UidPool | None = None
_uid_pool_pid: int | None = None
_capabilities: dict | None = None
_capabilities_pid: int | None = None
_capabilities_lock = threading.Lock()
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _uids() -> _UidPool:
    global _uid_pool, _uid_pool_pid
    if _uid_pool is None or _uid_pool_pid != os.getpid():  # a forked trainer worker gets its own id range
        _uid_pool, _uid_pool_pid = _UidPool(), os.getpid()
    return _uid_pool


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _python() -> str:
    """The base interpreter (not a venv shim, which needs files outside the private root)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _bwrap() -> str | None:
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.path.exists(p)), None)


def _world_reachable(path: str) -> bool:
    """Whether an unprivileged user can traverse every directory down to ``path`` and read it."""
    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        while True:
            if not os.stat(path).st_mode & stat.S_IXOTH and os.path.isdir(path):
                return False
            parent = os.path.dirname(path)
            if parent == path:
                return True
            path = parent
    except OSError:
        return False


def _python_dirs() -> list[str]:
    """Directories of the Python installation the sandbox needs, outside /usr (deduplicated)."""
    dirs: list[str] = []
    for path in (os.path.realpath(sys.base_prefix), os.path.dirname(_python())):
        if path == "/usr" or path.startswith("/usr/"):
            continue
        if not any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs):
            dirs.append(path)
    return dirs


def _root_args() -> list[str]:
    """bwrap arguments for the read-only system part of the root: /usr, merged-usr links, the loader cache."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args


def _rlimit_nproc() -> int:
    import resource

    return resource.RLIMIT_NPROC


def _can_drop_root() -> bool:
    """Basic mode switches to a per-run uid only as root, and only if that uid can still read the interpreter."""
    return _is_root() and _world_reachable(os.path.join(sys.base_prefix, "lib"))


def _rlimits(memory_mb: int, cpu_seconds: int, max_processes: int, max_file_bytes: int) -> list[list[int]]:
    import resource

    mem = memory_mb * 1024 * 1024
    return [
        [resource.RLIMIT_AS, mem, mem],
        [resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1],  # SIGXCPU first, SIGKILL one second later
        [resource.RLIMIT_FSIZE, max_file_bytes, max_file_bytes],
        [resource.RLIMIT_NOFILE, 256, 256],
        [resource.RLIMIT_NPROC, max_processes, max_processes],
        [resource.RLIMIT_CORE, 0, 0],
    ]


def _communicate(
    proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int, kill
) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin and read stdout/stderr until EOF, the deadline, or a stream exceeding ``cap`` bytes.

    Returns ``(stdout, stderr, timed_out, overflowed)``. Calls ``kill()`` on timeout/overflow. Every wait has a
    deadline: a process that keeps a pipe open after the program exited cannot make this hang.
    """
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for stream in bufs:
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    view, offset = memoryview(stdin), 0
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    timed_out = overflowed = False
    exited_at = None
    try:
        while sel.get_map() and not overflowed:
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            remaining = deadline - now
            if exited_at is not None:  # the program is gone: drain what is buffered, briefly
                remaining = min(remaining, exited_at + 0.5 - now)
            if remaining <= 0:
                timed_out = exited_at is None
                break
            for key, _ in sel.select(min(remaining, 0.05)):
                if key.fileobj is proc.stdin:
                    try:
                        offset += os.write(key.fd, view[offset : offset + 65536])
                    except BlockingIOError:
                        continue
                    except OSError:
                        offset = len(view)
                    if offset >= len(view):
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]
                room = cap - len(buf)
                buf += data[:room]
                if len(data) > room:
                    overflowed = True
                    break
        if not timed_out and not overflowed:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.05))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        if timed_out or overflowed or proc.poll() is None:
            kill()
        sel.close()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None and not stream.closed:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("sandbox launcher %d did not exit after SIGKILL", proc.pid)
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), timed_out, overflowed


def _kill_group(proc: subprocess.Popen) -> None:
    # The launcher (then bwrap) leads its own session (start_new_session), so its pgid is its pid; bwrap's PID-1
    # child dies with it (--die-with-parent), and with it every process of the PID namespace.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        proc.kill()


def _classify(returncode: int | None, stderr: str, timed_out: bool, overflowed: bool, oom: bool) -> tuple[str, int]:
    if timed_out:
        return "timeout", returncode
    if overflowed:
        return "output_limit", returncode
    if returncode is None:
        return "sandbox_error", None
    if returncode == 0:
        return "ok", 0
    if oom or "MemoryError" in stderr[-2000:]:
        return "memory", returncode
    if returncode == -signal.SIGXCPU:
        return "timeout", returncode  # SIGXCPU at the soft CPU limit
    if returncode < 0:
        return "killed", returncode
    return "error", returncode


def run_files(
    files: Mapping[str, str | bytes],
    main: str,
    *,
    stdin: str | bytes | None = None,
    timeout: float = 5.0,
    memory_mb: int = 512,
    cpu_seconds: int | None = None,
    max_output_bytes: int = 65536,
    max_processes: int = 16,
    max_file_mb: int = 16,
    disk_mb: int = 64,
    isolation: Isolation = "auto",
    binds: tuple[Bind, ...] | list[Bind] = (),
    env: Mapping[str, str] | None = None,
    cwd: str = "/sandbox",
) -> SandboxResult:
    """Run ``main`` (one of ``files``, written into a fresh working directory) in the sandbox.

    See :func:`run_python` for the arguments; ``files`` maps plain file names to their contents (always written to
    ``/sandbox``). Beyond :func:`run_python` (bubblewrap isolation only):

    Args:
        binds: Host directories visible inside (:class:`Bind`); nothing else of the host's filesystem is, beyond
            the read-only system paths.
        env: Extra environment variables for the program (on top of ``PATH``, ``HOME``, ``TMPDIR``, ``LANG``).
        cwd: The program's working directory inside the sandbox (``/sandbox``, ``/tmp`` or a bind's target).
    """
    binds = tuple(binds)
    extra_env = dict(env or {})
    bad_env = [k for k in extra_env if not isinstance(k, str) or not _ENV_NAME.fullmatch(k)]
    if bad_env or not all(isinstance(v, str) and "\0" not in v for v in extra_env.values()):
        raise ValueError(f"env must map variable names to strings without NUL bytes; bad names: {bad_env}.")
    for name in files:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"Sandbox file names must be plain names like 'main.py', got {name!r}.")
    if main not in files:
        raise ValueError(f"main={main!r} is not one of the files passed: {sorted(files)}.")
    mode = _resolve_isolation(isolation)
    if mode == "basic" and (binds or extra_env or cwd != "/sandbox"):
        raise SandboxUnavailable("binds, env and cwd need bubblewrap isolation (isolation='auto').")
    if mode != "basic":
        _check_binds(binds)
        if cwd not in ("/sandbox", "/tmp") and cwd not in {b.target for b in binds}:
            raise ValueError(f"cwd={cwd!r} must be '/sandbox', '/tmp' or the target of one of the binds.")
    limits = dict(
        stdin=stdin.encode() if isinstance(stdin, str) else (stdin or b""),
        timeout=timeout,
        memory_mb=memory_mb,
        cpu_seconds=int(cpu_seconds if cpu_seconds is not None else max(1, int(timeout + 0.999))),
        max_output_bytes=max_output_bytes,
        max_processes=max_processes,
        max_file_mb=max_file_mb,
        disk_mb=disk_mb,
    )
    try:
        if mode == "basic":
            return _run_basic(files, main, **limits)
        return _run_bwrap(
            files,
            main,
            use_cgroup=sandbox_capabilities()["cgroup"] is not None,
            mounts=binds,
            env=extra_env,
            cwd=cwd,
            **limits,
        )
    except OSError as e:  # e.g. no cgroup could be created, fork failed: this run fails, training goes on
        logger.warning("sandbox run could not be set up: %s: %s", type(e).__name__, e)
        return SandboxResult("sandbox_error", "", f"sandbox setup failed: {type(e).__name__}: {e}\n", None, 0.0)


def _memfd(name: str, content: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view, written = memoryview(content), 0
    while written < len(view):
        written += os.write(fd, view[written:])
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_bwrap(
    files: Mapping[str, str | bytes],
    main: str,
    *,
    use_cgroup: bool,
    stdin: bytes,
    timeout: float,
    memory_mb: int,
    cpu_seconds: int,
    max_output_bytes: int,
    max_processes: int,
    max_file_mb: int,
    disk_mb: int,
    mounts: tuple[Bind, ...] = (),
    env: Mapping[str, str] | None = None,
    cwd: str = "/sandbox",
) -> SandboxResult:
    start = time.monotonic()
    fds: list[int] = []
    cgroup = None
    host_dir = None
    uid = _uids().acquire() if _is_root() else None
    try:
        rlimits = _rlimits(memory_mb, cpu_seconds, max_processes, max_file_mb * 1024 * 1024)
        if use_cgroup:
            backend, _ = _sandbox_cgroup.backend()
            if backend is not None:
                cgroup = _sandbox_cgroup.RunCgroup(backend, memory_mb * 1024 * 1024, max_processes)
        seccomp_fd = _sandbox_seccomp.program_fd(deny_memfd=cgroup is None)
        fds.append(seccomp_fd)
        python = _python()
        disk = str(disk_mb * 1024 * 1024)
        argv = [
            "bwrap",
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session",
            "--uid", str(_INNER_UID), "--gid", str(_INNER_UID), "--hostname", "sandbox",
            *_root_args(),
        ]  # fmt: skip
        binds: list[list[str]] = []
        for i, path in enumerate(_python_dirs()):
            source = path
            if uid is not None and not _world_reachable(path):
                if host_dir is None:
                    host_dir = tempfile.mkdtemp(prefix=f"posttrain-sandbox-{os.getpid()}-")
                    os.chmod(host_dir, 0o711)
                source = os.path.join(host_dir, f"py{i}")
                binds.append([path, source])
            argv += ["--ro-bind", source, path]
        argv += ["--proc", "/proc", "--size", str(1 << 20), "--tmpfs", "/dev"]
        for dev in ("null", "zero", "full", "random", "urandom"):
            argv += ["--dev-bind", "/dev/" + dev, "/dev/" + dev]
        argv += ["--symlink", "/proc/self/fd", "/dev/fd"]
        for i, name in enumerate(("stdin", "stdout", "stderr")):
            argv += ["--symlink", f"/proc/self/fd/{i}", "/dev/" + name]
        argv += ["--remount-ro", "/dev"]
        argv += ["--size", disk, "--perms", "1777", "--tmpfs", "/tmp", "--size", disk, "--perms", "0700"]
        argv += ["--tmpfs", "/sandbox"]
        for name, content in files.items():
            fd = _memfd("posttrain-file", content.encode() if isinstance(content, str) else bytes(content))
            fds.append(fd)
            argv += ["--file", str(fd), "/sandbox/" + name]
        for bind in mounts:
            if bind.writable and uid is not None:
                _hand_over(bind.source, uid)
            argv += ["--bind" if bind.writable else "--ro-bind", bind.source, bind.target]
        argv += ["--remount-ro", "/", "--chdir", cwd, "--clearenv"]
        for key, value in {**_child_env("/sandbox", "/tmp"), **(env or {})}.items():
            argv += ["--setenv", key, value]
        argv += ["--seccomp", str(seccomp_fd), "--", python, "-I", "-S", "-B", "-X", "utf8", "-c", _PRELUDE]
        argv.append(json.dumps({"rlimits": rlimits, "main": main if cwd == "/sandbox" else "/sandbox/" + main}))
        cfg = {
            "cgroup_procs": cgroup.procs_files if cgroup is not None else [],
            "binds": binds,
            "uid": uid,
            "bwrap": _bwrap(),
            "argv": argv,
            "caller": os.getpid(),
        }
        proc = subprocess.Popen(
            _launcher_argv(python, cfg),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd="/",
            env=_child_env(),
            pass_fds=tuple(fds),
            start_new_session=True,
            close_fds=True,
        )
        for fd in fds:
            os.close(fd)
        fds = []

        def kill() -> None:
            _kill_group(proc)
            if cgroup is not None:
                cgroup.kill(deadline_s=1.0)

        out, err, timed_out, overflowed = _communicate(proc, stdin, start + timeout, max_output_bytes, kill)
        duration = time.monotonic() - start
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        rc = proc.returncode
        if rc == _SETUP_FAILED and stderr.startswith("sandbox launcher:") or stderr.startswith("bwrap:"):
            return SandboxResult("sandbox_error", stdout, "sandbox setup failed: " + stderr, None, duration)
        if (
            rc is not None
            and rc > 128
            and rc - 128 in (signal.SIGKILL, signal.SIGXCPU, signal.SIGSEGV, signal.SIGTERM)
        ):
            rc = -(rc - 128)  # bwrap reports a program killed by signal N as exit status 128 + N
        oom = cgroup is not None and cgroup.oom_killed()
        status, rc = _classify(rc, stderr, timed_out, overflowed, oom)
        return SandboxResult(status, stdout, stderr, rc, duration, truncated=overflowed)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if cgroup is not None:
            cgroup.remove()
        if uid is not None:
            _uids().release(uid)
        if host_dir is not None:
            _remove_tree(host_dir)


def _launcher_argv(python: str, cfg: dict) -> list[str]:
    """The launcher command: a POSIX shell with util-linux's ``setpriv`` (and ``unshare``/``mount`` when the Python
    installation must be bound into reach), i.e. no extra interpreter start-up; else the Python launcher."""
    tools = {name: shutil.which(name) for name in ("setpriv", "unshare", "mount")}
    needed = ["setpriv"] + (["unshare", "mount"] if cfg["binds"] else [])  # setpriv: uid drop and --pdeathsig
    if not os.path.exists("/bin/sh") or any(tools[name] is None for name in needed):
        return [python, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(cfg)]
    fail = "|| { echo 'sandbox launcher: setup failed' >&2; exit 125; }"
    # started under setpriv --pdeathsig (below): is the trainer still our parent, i.e. did it not die before that?
    lines = [f'read -r _ _ _ ppid _ < /proc/$$/stat; [ "$ppid" = {int(cfg["caller"])} ] || exit 125']
    lines += [f"echo $$ > {shlex.quote(path)} {fail}" for path in cfg["cgroup_procs"]]
    lines.append(f"echo 1000 > /proc/self/oom_score_adj {fail}")
    argv = [cfg["bwrap"], *cfg["argv"][1:]]
    # SIGKILL when the trainer dies before bubblewrap's own --die-with-parent is in place (kept across exec; set
    # again after the uid change, which clears it)
    ids = [] if cfg["uid"] is None else [f"--reuid={cfg['uid']}", f"--regid={cfg['uid']}", "--clear-groups"]
    argv = [tools["setpriv"], "--pdeathsig", "KILL", *ids, "--", *argv]
    if cfg["binds"]:  # root with an unreadable interpreter: bind it into reach in a private mount namespace
        inner = [
            f"mkdir -m 755 {shlex.quote(dst)} && {shlex.quote(tools['mount'])} -n --bind {shlex.quote(src)} "
            f"{shlex.quote(dst)} {fail}"
            for src, dst in cfg["binds"]
        ]
        inner.append('exec "$@"')
        unshare = [tools["unshare"], "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(inner)]
        argv = [*unshare, "sandbox-launcher", *argv]
    lines.append('exec "$@"')
    shell = ["/bin/sh", "-c", "\n".join(lines), "sandbox-launcher"]
    return [tools["setpriv"], "--pdeathsig", "KILL", "--", *shell, *argv]


def _remove_tree(path: str) -> None:
    def log(_func, failed, exc_info):
        logger.warning("sandbox cleanup: could not remove %s: %s", failed, exc_info[1])

    try:
        shutil.rmtree(path, onerror=log)
    except Exception as e:  # noqa: BLE001 -- cleanup must never raise into training (e.g. RecursionError)
        logger.warning("sandbox cleanup of %s failed: %s: %s", path, type(e).__name__, e)


def _run_basic(
    files: Mapping[str, str | bytes],
    main: str,
    *,
    stdin: bytes,
    timeout: float,
    memory_mb: int,
    cpu_seconds: int,
    max_output_bytes: int,
    max_processes: int,
    max_file_mb: int,
    disk_mb: int,
) -> SandboxResult:
    del disk_mb  # no private filesystem in basic mode
    drop_root = _can_drop_root()
    if _is_root() and not drop_root:
        raise SandboxUnavailable(
            "isolation='basic' as root needs an interpreter readable by other users to drop privileges "
            f"({sys.base_prefix} is not); model code never runs as root. Install bubblewrap for isolation='auto'."
        )
    rlimits = _rlimits(memory_mb, cpu_seconds, max_processes, max_file_mb * 1024 * 1024)
    if not drop_root:
        # RLIMIT_NPROC counts every process of this uid (the trainer's threads included); in basic mode without a
        # separate uid the audit hook is what stops process creation.
        rlimits = [r for r in rlimits if r[0] != _rlimit_nproc()]
    host_dir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    uid = _uids().acquire() if drop_root else None
    start = time.monotonic()
    try:
        files_dir = os.path.join(host_dir, "files")
        os.makedirs(files_dir)
        for name, content in files.items():
            with open(os.path.join(files_dir, name), "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        python = _python()
        os.chmod(host_dir, 0o755)
        if uid is not None:
            os.chown(files_dir, uid, uid)
            for name in files:
                os.chown(os.path.join(files_dir, name), uid, uid)
        cfg = {
            "rlimits": rlimits,
            "uid": uid,
            "workdir": files_dir,
            "main": main,
            "read_roots": [sys.base_prefix, os.path.dirname(python)],
        }
        proc = subprocess.Popen(
            [python, "-I", "-S", "-B", "-X", "utf8", "-c", _BASIC_RUNNER, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=files_dir,
            env=_child_env(files_dir, files_dir),
            start_new_session=True,
            close_fds=True,
        )
        out, err, timed_out, overflowed = _communicate(
            proc, stdin, start + timeout, max_output_bytes, lambda: _kill_group(proc)
        )
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        status, rc = _classify(proc.returncode, stderr, timed_out, overflowed, False)
        return SandboxResult(status, stdout, stderr, rc, time.monotonic() - start, truncated=overflowed)
    finally:
        if uid is not None:
            _uids().release(uid)
        _remove_tree(host_dir)


def _child_env(home: str = "/", tmp: str = "/tmp") -> dict[str, str]:
    """The whole environment a sandboxed process gets: nothing from the trainer (no tokens, no HOME secrets)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8"}


def run_python(
    code: str,
    *,
    stdin: str | bytes | None = None,
    timeout: float = 5.0,
    memory_mb: int = 512,
    cpu_seconds: int | None = None,
    max_output_bytes: int = 65536,
    max_processes: int = 16,
    max_file_mb: int = 16,
    disk_mb: int = 64,
    isolation: Isolation = "auto",
) -> SandboxResult:
    """Run a Python program in a fresh sandboxed interpreter and capture its output.

    Args:
        code: Program source, run as ``__main__`` from ``main.py`` in a fresh working directory.
        stdin: Data fed to the program's standard input (closed immediately when ``None``).
        timeout: Wall-clock limit in seconds; the whole run (cgroup, PID namespace) is killed when it passes.
        memory_mb: Memory limit: for the whole run (per-run cgroup) and per process (``RLIMIT_AS``).
        cpu_seconds: CPU-time limit per process (``RLIMIT_CPU``); defaults to ``ceil(timeout)``.
        max_output_bytes: Cap on captured stdout and on stderr, each; exceeding it kills the program.
        max_processes: Processes and threads of the run (cgroup ``pids.max`` and ``RLIMIT_NPROC``).
        max_file_mb: Largest file the program may write (``RLIMIT_FSIZE``).
        disk_mb: Size of each of the tmpfs ``/tmp`` and ``/sandbox`` (all files the program may write).
        isolation: ``"auto"``, ``"strict"`` (a per-run cgroup is required) or ``"basic"`` (explicit opt-in to the
            weak audit-hook mode). See the module docstring for what each enforces.

    Returns:
        A :class:`SandboxResult`; failures of the program are reported in ``status``, never raised.

    Raises:
        SandboxUnavailable: the requested isolation cannot be set up here (the message says what to install).
    """
    return run_files(
        {"main.py": code},
        "main.py",
        stdin=stdin,
        timeout=timeout,
        memory_mb=memory_mb,
        cpu_seconds=cpu_seconds,
        max_output_bytes=max_output_bytes,
        max_processes=max_processes,
        max_file_mb=max_file_mb,
        disk_mb=disk_mb,
        isolation=isolation,
    )


def _resolve_isolation(isolation: str) -> str:
    if isolation not in _ISOLATIONS:
        raise ValueError(f"isolation={isolation!r}; valid values: {', '.join(map(repr, _ISOLATIONS))}.")
    if isolation == "basic":
        _warn_once(
            "basic",
            "posttrain sandbox: isolation='basic' was requested. It is NOT a security boundary (audit hooks can be "
            "defeated from inside; no namespaces, cgroup or seccomp): adversarial model code can read host files, "
            "reach the network and forge results. Use isolation='auto' with bubblewrap installed.",
        )
        return "basic"
    caps = sandbox_capabilities()
    if caps["isolation"] != "bwrap":
        raise SandboxUnavailable(f"posttrain sandbox unavailable: {caps['reason']}")
    if caps["cgroup"] is None:
        if isolation == "strict":
            raise SandboxUnavailable(
                "isolation='strict' needs a per-run cgroup, but none can be created here "
                f"({caps['cgroup_reason']}). Run as root with a writable /sys/fs/cgroup, or delegate a cgroup "
                "(systemd Delegate=yes) and point POSTTRAIN_SANDBOX_CGROUP at it."
            )
        _warn_once(
            "cgroup",
            "posttrain sandbox: no per-run cgroup can be created "
            f"({caps['cgroup_reason']}); memory is bounded per process (RLIMIT_AS x RLIMIT_NPROC, memfd denied) "
            "instead of per run. Use isolation='strict' to refuse this.",
        )
    return "bwrap"


def sandbox_capabilities() -> dict:
    """What ``run_python(isolation="auto")`` enforces on this machine (probed once per process, then cached).

    Returns:
        A dict with ``isolation`` (``"bwrap"``, or ``"unavailable"`` with the reason and the fix in ``reason``),
        ``cgroup`` (``None``, ``"v1"`` or ``"v2"``) and ``cgroup_reason``, ``seccomp``, ``user_namespace``,
        ``pid_namespace``, ``network_namespace``, ``mount_namespace``, ``private_root``, ``unprivileged_user``,
        ``oom_score_adj``, ``rlimits`` (names), ``memory_scope`` (``"run"`` with a cgroup, else ``"process"``).
    """
    global _capabilities, _capabilities_pid
    with _capabilities_lock:
        if _capabilities is None or _capabilities_pid != os.getpid():
            _capabilities, _capabilities_pid = _probe(), os.getpid()
        return dict(_capabilities)


def _sweep_stale_dirs() -> None:
    """Remove temporary directories of trainers that died mid-run (their pid is in the name)."""
    import glob
    import re

    for path in glob.glob(os.path.join(tempfile.gettempdir(), "posttrain-sandbox-*-*")):
        match = re.fullmatch(r"posttrain-sandbox-(\d+)-.*", os.path.basename(path))
        if not match or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _remove_tree(path)
        except OSError:
            continue


def _probe() -> dict:
    _sweep_stale_dirs()
    reason = ""
    if not sys.platform.startswith("linux"):
        reason = f"the sandbox needs Linux (bubblewrap, namespaces, seccomp); this is {sys.platform}"
    elif _bwrap() is None:
        reason = "bubblewrap is not installed: `apt-get install bubblewrap` (or your distribution's package)"
    else:
        try:
            _sandbox_seccomp.bpf_program(deny_memfd=True)
        except _sandbox_seccomp.SeccompUnavailable as e:
            reason = str(e)
    backend, cgroup_reason = _sandbox_cgroup.backend() if not reason else (None, "")
    if not reason:
        result = _run_bwrap(
            {"main.py": "import os; print(os.getpid(), os.getuid())"},
            "main.py",
            use_cgroup=backend is not None,
            stdin=b"",
            timeout=15.0,
            memory_mb=256,
            cpu_seconds=10,
            max_output_bytes=4096,
            max_processes=8,
            max_file_mb=1,
            disk_mb=4,
        )
        if not (result.ok and result.stdout.split() == ["2", str(_INNER_UID)]):
            reason = (
                f"a bubblewrap probe run failed ({result.status}): {result.stderr.strip()[-400:]}. Unprivileged user "
                "namespaces may be disabled: enable them (sysctl kernel.unprivileged_userns_clone=1, "
                "user.max_user_namespaces>0, or an AppArmor profile allowing bwrap)"
            )
    ok = not reason
    return {
        "isolation": "bwrap" if ok else "unavailable",
        "reason": reason,
        "cgroup": f"v{backend.version}" if ok and backend is not None else None,
        "cgroup_reason": cgroup_reason,
        "memory_scope": "run" if ok and backend is not None else "process",
        "seccomp": ok,
        "user_namespace": ok,
        "pid_namespace": ok,
        "network_namespace": ok,
        "mount_namespace": ok,
        "private_root": ok,
        "unprivileged_user": ok,
        "oom_score_adj": ok,
        "rlimits": ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_CORE"],
    }


import atexit  # noqa: E402

atexit.register(_sandbox_cgroup.cleanup)
