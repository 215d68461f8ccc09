"""Run untrusted, model-generated Python in a separate, locked-down process.

``run_python(code)`` starts a fresh interpreter (``python -I -S -B``: isolated mode, no ``site``, no user paths, no
``PYTHON*`` variables) and returns a :class:`SandboxResult`. Two isolation levels exist; ``sandbox_capabilities()``
says which one this machine gets and which protections are active.

``"namespaces"`` (Linux, run as root or with ``CAP_SYS_ADMIN``; checked once by a probe run):
    - new PID, mount, network, IPC and UTS namespaces (``unshare(2)``): the program sees only its own processes, so
      ``os.kill(os.getppid(), 9)``, ``os.killpg(<trainer pgid>, 9)`` or ``kill(-1)`` cannot reach the trainer; the
      network namespace has only a loopback interface that is down, so no connection (local or remote) is possible;
    - a private root filesystem: a size-limited tmpfs holding read-only bind mounts of ``/usr`` and the Python
      installation, a ``/dev`` with only ``null``/``zero``/``random``/``urandom``, a fresh ``/proc`` (``hidepid=2``),
      a writable ``/tmp`` and the working directory ``/sandbox``; the program is ``chroot``-ed into it, so ``/etc``
      (except the loader cache ``/etc/ld.so.cache``), ``/root``, ``/home``, the trainer's working directory and every
      other host path do not exist for it. It can still *read* ``/usr`` and the Python installation;
    - an unprivileged, per-run user id (no capabilities, ``no_new_privs``, ``nosuid`` mounts), which also makes
      ``RLIMIT_NPROC`` effective (root ignores it): fork bombs stop at ``max_processes`` tasks;
    - the namespace's init process is killed with the trainer-side launcher (``PR_SET_PDEATHSIG``), and when it
      dies the kernel kills every process left in the namespace, including ones that called ``setsid``.
``"basic"`` (fallback when namespaces are unavailable, e.g. unprivileged containers):
    - a best-effort ``sys.addaudithook`` preamble that refuses process creation (``fork``/``exec``/``subprocess``/
      ``posix_spawn``), signals (``kill``/``killpg``), sockets, ``ctypes``, and file access outside the working
      directory (the standard library stays readable); as root, when the Python installation is readable by other
      users, the program also switches to an unprivileged per-run user id (and only then is ``RLIMIT_NPROC`` set:
      for a shared uid it would count the trainer's own threads). Audit hooks are not a security boundary:
      interpreter-level tricks can defeat them. Use it for honest mistakes, not for adversarial code.
Both levels: a fresh temporary working directory removed afterwards, an environment reduced to a short whitelist
(``PATH``, ``HOME``, ``TMPDIR``, ``LANG``; nothing inherited from the trainer), resource limits (``RLIMIT_CPU``,
``RLIMIT_AS`` memory, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core dumps), a wall-clock timeout,
stdout/stderr captured up to ``max_output_bytes`` each (the process is killed when it exceeds the cap), its own
session and process group killed with ``os.killpg`` on timeout.

Not enforced: CPU share and total memory across processes (no cgroups: each process gets ``memory_mb`` address
space, at most ``max_processes`` of them), and in ``"basic"`` mode the number of files written to the work dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Isolation = Literal["auto", "namespaces", "basic"]

# Per-run user ids live far above the ids a distribution hands out; each concurrent run in this process gets its
# own, so one run's fork bomb cannot use up another run's RLIMIT_NPROC budget.
_UID_BASE = 1_000_000
_UIDS_PER_PROCESS = 100

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000

# Runs as root on the host (trusted code), then as PID 1 of the new namespaces, which builds the private root and
# starts the program under an unprivileged uid. Status lines (JSON) go to the status pipe, never to stdout.
_NS_LAUNCHER = r"""
import ctypes, json, os, resource, select, sys
cfg = json.loads(sys.argv[1])
status_fd = cfg["status_fd"]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
M = cfg["consts"]

def report(**kw):
    try:
        os.write(status_fd, (json.dumps(kw) + "\n").encode())
    except OSError:
        pass

def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, what + ": " + os.strerror(err))

def enc(s):
    return None if s is None else s.encode()

def mount(src, dst, fstype, flags, data=None):
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), "mount %s on %s" % (src, dst))

def bind(src, dst, readonly):
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, M["BIND"] | M["REC"])
    if readonly:
        mount(None, dst, None, M["BIND"] | M["REMOUNT"] | M["RDONLY"] | M["NOSUID"] | M["NODEV"])

def build_root():
    root, uid = cfg["root"], cfg["uid"]
    mount(None, "/", None, M["REC"] | M["PRIVATE"])  # nothing below propagates back to the host
    mount("tmpfs", root, "tmpfs", M["NOSUID"] | M["NODEV"], "size=%dm,mode=755" % cfg["disk_mb"])
    for path, target in cfg["links"]:
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    for path in cfg["ro_binds"]:
        bind(path, root + path, readonly=True)
    for dev in ("null", "zero", "random", "urandom"):
        bind("/dev/" + dev, root + "/dev/" + dev, readonly=False)
    os.makedirs(root + "/proc")
    try:
        mount("proc", root + "/proc", "proc", M["NOSUID"] | M["NODEV"] | M["NOEXEC"], "hidepid=2")
    except OSError:
        mount("proc", root + "/proc", "proc", M["NOSUID"] | M["NODEV"] | M["NOEXEC"])
    os.makedirs(root + "/tmp")
    os.chmod(root + "/tmp", 0o1777)
    work = root + "/sandbox"
    os.makedirs(work)
    for name in os.listdir(cfg["files_dir"]):
        with open(os.path.join(cfg["files_dir"], name), "rb") as src, open(os.path.join(work, name), "wb") as dst:
            dst.write(src.read())
        os.chown(os.path.join(work, name), uid, uid)
    os.chown(work, uid, uid)
    os.chmod(work, 0o700)

def start_program():
    try:
        os.chroot(cfg["root"])
        os.chdir("/sandbox")
        for res, soft, hard in cfg["rlimits"]:
            resource.setrlimit(res, (soft, hard))
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    except BaseException as e:
        report(setup_error="%s: %s" % (type(e).__name__, e))
        os._exit(126)
    os.closerange(3, 65536)
    try:
        os.execve(cfg["python"], cfg["argv"], cfg["env"])
    except BaseException as e:
        os.write(2, ("sandbox: could not start %s: %s\n" % (cfg["python"], e)).encode())
        os._exit(127)

def namespace_init(alive_r):
    # PID 1 of the new namespaces: dies with the launcher (pdeathsig), and the kernel then kills everything left.
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(1)  # the launcher died before pdeathsig was armed
    try:
        build_root()
    except BaseException as e:
        report(setup_error="%s: %s" % (type(e).__name__, e))
        os._exit(1)
    child = os.fork()
    if child == 0:
        start_program()
    while True:  # reap every orphan until the program itself exits
        pid, status = os.wait()
        if pid == child:
            if os.WIFSIGNALED(status):
                report(signal=os.WTERMSIG(status))
            else:
                report(returncode=os.WEXITSTATUS(status))
            os._exit(0)

libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
try:
    check(libc.unshare(cfg["unshare_flags"]), "unshare")
except OSError as e:
    report(setup_error="OSError: %s" % e)
    sys.exit(1)
alive_r, alive_w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(alive_w)
    namespace_init(alive_r)
os.close(alive_r)
os.waitpid(pid, 0)
"""

# "basic" isolation: the same interpreter sets its limits, drops root, installs the audit hook and then runs the
# program as __main__. Everything before ``exec`` is trusted; the hook cannot be removed once installed.
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
            or CPU limit), ``"memory"`` (``MemoryError`` under the address-space limit), ``"output_limit"`` (stdout or
            stderr exceeded ``max_output_bytes``; the process was killed), ``"killed"`` (ended by a signal), or
            ``"sandbox_error"`` (the sandbox itself could not be set up; ``stderr`` says why).
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
_capabilities_lock = threading.Lock()


def _uids() -> _UidPool:
    global _uid_pool, _uid_pool_pid
    if _uid_pool is None or _uid_pool_pid != os.getpid():  # a forked trainer worker gets its own id range
        _uid_pool, _uid_pool_pid = _UidPool(), os.getpid()
    return _uid_pool


def _python() -> str:
    """The base interpreter (not a venv shim, which needs files outside the private root)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _root_layout() -> tuple[list[str], list[list[str]]]:
    """Read-only bind mounts and symlinks that make up the private root: /usr, merged-usr links, Python."""
    binds, links = ["/usr"], []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append([top, os.readlink(top)])
        elif os.path.isdir(top):
            binds.append(top)
    if os.path.isfile("/etc/ld.so.cache"):
        binds.append("/etc/ld.so.cache")
    for path in (os.path.realpath(sys.base_prefix), os.path.dirname(_python())):
        if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds):
            binds.append(path)
    return binds, links


def _rlimit_nproc() -> int:
    import resource

    return resource.RLIMIT_NPROC


def _can_drop_root() -> bool:
    """Basic mode switches to a per-run uid only as root, and only if that uid can still read the interpreter."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    import stat

    path = os.path.realpath(sys.base_prefix)
    while True:  # every directory down to the stdlib must be world-traversable
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


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


def _communicate(proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin and read stdout/stderr until EOF, the deadline, or a stream exceeding ``cap`` bytes.

    Returns ``(stdout, stderr, timed_out, overflowed)``. Kills the process group on timeout/overflow.
    """
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for stream in bufs:
        sel.register(stream, selectors.EVENT_READ)
    view, offset = memoryview(stdin), 0
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    timed_out = overflowed = False
    try:
        while sel.get_map() and not overflowed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                if key.fileobj is proc.stdin:
                    try:
                        offset += os.write(key.fd, view[offset : offset + 65536])
                    except (BrokenPipeError, BlockingIOError) as e:
                        if isinstance(e, BlockingIOError):
                            continue
                        offset = len(view)
                    if offset >= len(view):
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                data = os.read(key.fd, 65536)
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
        if proc.poll() is None:
            _kill_group(proc)
        sel.close()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        proc.wait()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), timed_out, overflowed


def _kill_group(proc: subprocess.Popen) -> None:
    # The launcher leads its own session (start_new_session), so its pgid is its pid. Killing it also kills the
    # namespace init (pdeathsig), and with it every process inside, even ones that left the process group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _classify(
    status_lines: list[dict], returncode: int | None, stderr: str, timed_out: bool, overflowed: bool
) -> tuple[str, int | None]:
    if timed_out:
        return "timeout", returncode
    if overflowed:
        return "output_limit", returncode
    for line in status_lines:
        if "setup_error" in line:
            return "sandbox_error", returncode
    for line in status_lines:
        if "signal" in line:
            returncode = -int(line["signal"])
        elif "returncode" in line:
            returncode = int(line["returncode"])
    if returncode is None:
        return "sandbox_error", None
    if returncode == 0:
        return "ok", 0
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in stderr:
        # SIGXCPU at the soft CPU limit, SIGKILL at the hard one (or the kernel's OOM killer).
        return ("timeout" if returncode == -signal.SIGXCPU else "killed"), returncode
    if "MemoryError" in stderr[-2000:]:
        return "memory", returncode
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
) -> SandboxResult:
    """Run ``main`` (one of ``files``, written into a fresh working directory) in the sandbox.

    See :func:`run_python` for the arguments; ``files`` maps plain file names to their contents.
    """
    for name in files:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"Sandbox file names must be plain names like 'main.py', got {name!r}.")
    if main not in files:
        raise ValueError(f"main={main!r} is not one of the files passed: {sorted(files)}.")
    return _run(
        files,
        main,
        mode=_resolve_isolation(isolation),
        stdin=stdin,
        timeout=timeout,
        memory_mb=memory_mb,
        cpu_seconds=cpu_seconds,
        max_output_bytes=max_output_bytes,
        max_processes=max_processes,
        max_file_mb=max_file_mb,
        disk_mb=disk_mb,
    )


def _run(
    files: Mapping[str, str | bytes],
    main: str,
    *,
    mode: str,
    stdin: str | bytes | None,
    timeout: float,
    memory_mb: int,
    cpu_seconds: int | None,
    max_output_bytes: int,
    max_processes: int,
    max_file_mb: int,
    disk_mb: int,
) -> SandboxResult:
    cpu = int(cpu_seconds if cpu_seconds is not None else max(1, int(timeout + 0.999)))
    rlimits = _rlimits(memory_mb, cpu, max_processes, max_file_mb * 1024 * 1024)
    drop_root = mode == "namespaces" or _can_drop_root()
    if not drop_root:
        # RLIMIT_NPROC counts every process of this uid (the trainer's threads included), and root ignores it;
        # in basic mode without a separate uid the audit hook is what stops process creation.
        rlimits = [r for r in rlimits if r[0] != _rlimit_nproc()]
    stdin_bytes = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    host_dir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    uid = _uids().acquire()
    status_r, status_w = os.pipe()
    start = time.monotonic()
    try:
        files_dir = os.path.join(host_dir, "files")
        os.makedirs(files_dir)
        for name, content in files.items():
            with open(os.path.join(files_dir, name), "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        python = _python()
        if mode == "namespaces":
            root = os.path.join(host_dir, "root")
            os.makedirs(root)
            binds, links = _root_layout()
            cfg = {
                "status_fd": status_w,
                "root": root,
                "files_dir": files_dir,
                "uid": uid,
                "disk_mb": disk_mb,
                "ro_binds": binds,
                "links": links,
                "rlimits": rlimits,
                "python": python,
                "argv": [python, "-I", "-S", "-B", "-X", "utf8", main],
                "env": _child_env("/sandbox", "/tmp"),
                "unshare_flags": _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS,
                "consts": {
                    "RDONLY": _MS_RDONLY,
                    "NOSUID": _MS_NOSUID,
                    "NODEV": _MS_NODEV,
                    "NOEXEC": _MS_NOEXEC,
                    "REMOUNT": _MS_REMOUNT,
                    "BIND": _MS_BIND,
                    "REC": _MS_REC,
                    "PRIVATE": _MS_PRIVATE,
                },
            }
            argv, cwd, env = [python, "-I", "-S", "-B", "-c", _NS_LAUNCHER, json.dumps(cfg)], host_dir, _child_env()
        else:
            # The program writes into files_dir directly; give it to the per-run uid when we are root.
            os.chmod(host_dir, 0o755)
            if drop_root:
                os.chown(files_dir, uid, uid)
                for name in files:
                    os.chown(os.path.join(files_dir, name), uid, uid)
            cfg = {
                "rlimits": rlimits,
                "uid": uid if drop_root else None,
                "workdir": files_dir,
                "main": main,
                "read_roots": [sys.base_prefix, os.path.dirname(python)],
            }
            env = _child_env(files_dir, files_dir)
            argv, cwd = [python, "-I", "-S", "-B", "-X", "utf8", "-c", _BASIC_RUNNER, json.dumps(cfg)], files_dir
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            pass_fds=(status_w,),
            start_new_session=True,
            close_fds=True,
        )
        os.close(status_w)
        status_w = -1
        out, err, timed_out, overflowed = _communicate(proc, stdin_bytes, start + timeout, max_output_bytes)
        duration = time.monotonic() - start
        status_lines = _read_status(status_r)
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        for line in status_lines:
            if "setup_error" in line:
                stderr = f"sandbox setup failed: {line['setup_error']}\n" + stderr
        rc = proc.returncode if mode == "basic" else None
        status, rc = _classify(status_lines, rc, stderr, timed_out, overflowed)
        return SandboxResult(status, stdout, stderr, rc, duration, truncated=overflowed)
    finally:
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        _uids().release(uid)
        shutil.rmtree(host_dir, ignore_errors=True)


def _read_status(fd: int) -> list[dict]:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    lines = []
    for raw in b"".join(chunks).decode("utf-8", "replace").splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines


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
        timeout: Wall-clock limit in seconds; the whole process group (and namespace) is killed when it passes.
        memory_mb: Address-space limit per process (``RLIMIT_AS``); allocations beyond it raise ``MemoryError``.
        cpu_seconds: CPU-time limit per process (``RLIMIT_CPU``); defaults to ``ceil(timeout)``.
        max_output_bytes: Cap on captured stdout and on stderr, each; exceeding it kills the program.
        max_processes: ``RLIMIT_NPROC`` for the per-run user (processes and threads), which stops fork bombs.
        max_file_mb: Largest file the program may write (``RLIMIT_FSIZE``).
        disk_mb: Size of the private root's tmpfs (``"namespaces"`` isolation), i.e. all files it may write.
        isolation: ``"auto"`` (namespaces when available, else basic), ``"namespaces"`` (error if unavailable) or
            ``"basic"``. See the module docstring for what each enforces.

    Returns:
        A :class:`SandboxResult`; failures of the program are reported in ``status``, never raised.
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
    if isolation not in ("auto", "namespaces", "basic"):
        raise ValueError(f"isolation={isolation!r}; valid values: 'auto', 'namespaces', 'basic'.")
    if isolation == "basic":
        return "basic"
    caps = sandbox_capabilities()
    if caps["isolation"] == "namespaces":
        return "namespaces"
    if isolation == "namespaces":
        raise RuntimeError(
            "isolation='namespaces' was requested but Linux namespaces are unavailable here "
            f"({caps['reason']}). Run as root (or with CAP_SYS_ADMIN), or use isolation='basic'."
        )
    return "basic"


def sandbox_capabilities() -> dict:
    """Which protections ``run_python(isolation="auto")`` applies on this machine (probed once, then cached).

    Returns:
        A dict with ``isolation`` (``"namespaces"`` or ``"basic"``), ``reason`` (why namespaces are unavailable, or
        ``""``), and one boolean per protection: ``pid_namespace``, ``network_namespace``, ``mount_namespace``,
        ``private_root``, ``unprivileged_user``, ``rlimit_nproc``, ``audit_hook``, plus those always on:
        ``rlimits`` (names), ``process_group_kill``, ``minimal_env``, ``temp_workdir``, ``wall_clock_timeout``,
        ``output_cap``.
    """
    global _capabilities
    with _capabilities_lock:
        if _capabilities is None:
            _capabilities = _probe()
        return dict(_capabilities)


def _probe() -> dict:
    reason = ""
    if not sys.platform.startswith("linux"):
        reason = f"namespaces need Linux, this is {sys.platform}"
    elif os.geteuid() != 0:
        reason = "not running as root (unshare of mount/PID/network namespaces needs CAP_SYS_ADMIN)"
    else:
        result = _run(
            {"main.py": "import os; print(os.getpid(), os.getuid())"},
            "main.py",
            mode="namespaces",
            stdin=None,
            timeout=10.0,
            memory_mb=512,
            cpu_seconds=None,
            max_output_bytes=4096,
            max_processes=4,
            max_file_mb=1,
            disk_mb=8,
        )
        pid, _, uid = result.stdout.strip().partition(" ")
        if not (result.ok and pid == "2" and uid not in ("", "0")):
            reason = f"probe run failed ({result.status}): {result.stderr.strip()[-300:]}"
    ns = not reason
    dropped = ns or _can_drop_root()
    return {
        "isolation": "namespaces" if ns else "basic",
        "reason": reason,
        "pid_namespace": ns,
        "network_namespace": ns,
        "mount_namespace": ns,
        "private_root": ns,
        "unprivileged_user": dropped,
        "rlimit_nproc": dropped,
        "audit_hook": not ns,
        "rlimits": ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_CORE"],
        "process_group_kill": True,
        "minimal_env": True,
        "temp_workdir": True,
        "wall_clock_timeout": True,
        "output_cap": True,
    }
