"""Containment tests for the sandbox and code_reward's grading: every attack of ``sandbox_attacks.py`` must be
contained, with reward 0 for wrong code, both for the caller running the tests (root in CI) and for an unprivileged
user (created here with ``useradd``, given a delegated cgroup like systemd's ``Delegate=yes``, and running the whole
attack suite in one subprocess). Timeouts and memory limits are small so the file stays well under a minute.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from posttrain.rewards import sandbox as sandbox_module
from posttrain.rewards.sandbox import SandboxUnavailable, run_python, sandbox_capabilities

pytestmark = pytest.mark.usefixtures("sandbox_lock")  # host-wide checks: one sandbox test at a time

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("sandbox_attacks", os.path.join(_HERE, "sandbox_attacks.py"))
attacks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(attacks)

CAPS = sandbox_capabilities()
IS_ROOT = os.geteuid() == 0
needs_sandbox = pytest.mark.skipif(CAPS["isolation"] != "bwrap", reason=f"sandbox unavailable: {CAPS['reason']}")
TEST_USER = "posttrain-sbx"


def test_capabilities_report_strong_isolation():
    # CI installs bubblewrap and pyseccomp: the strong mode must be available there, not silently degraded.
    assert CAPS["isolation"] == "bwrap", CAPS["reason"]
    for key in ("seccomp", "user_namespace", "pid_namespace", "network_namespace", "private_root", "oom_score_adj"):
        assert CAPS[key] is True
    assert (CAPS["cgroup"] is None) == bool(CAPS["cgroup_reason"])  # no cgroup always says why
    assert CAPS["memory_scope"] == ("run" if CAPS["cgroup"] else "process")


@needs_sandbox
def test_runs_code_with_stdin_and_reports_errors():
    result = run_python("import sys\nprint(sys.stdin.read().upper())", stdin="hello", timeout=4)
    assert result.ok and result.stdout == "HELLO\n" and result.returncode == 0
    result = run_python("raise ValueError('boom')", timeout=4)
    assert result.status == "error" and result.returncode == 1 and "ValueError: boom" in result.stderr
    result = run_python("while True:\n    pass", timeout=1)
    assert result.status == "timeout" and result.duration < 3


@needs_sandbox
@pytest.mark.parametrize("name", sorted(attacks.ATTACKS))
def test_attack_is_contained_for_the_caller(name):
    """As the user running the tests (root in CI: the launcher drops to a per-run uid)."""
    attacks.ATTACKS[name]()


@needs_sandbox
@pytest.mark.parametrize(
    "name", ["memory_many_processes", "memory_memfd", "fork_bomb", "disk_fill", "setsid_daemon", "syscall_surface"]
)
def test_attack_is_contained_without_a_cgroup(monkeypatch, name):
    """The fallback where no cgroup can be created (per-process limits, memfd denied) still contains the bombs."""
    monkeypatch.setattr(sandbox_module, "_capabilities", {**CAPS, "cgroup": None, "cgroup_reason": "test"})
    monkeypatch.setattr(sandbox_module, "_capabilities_pid", os.getpid())
    attacks.ATTACKS[name]()


@needs_sandbox
@pytest.mark.parametrize("name", ["never_root_on_the_host", "syscall_surface", "setsid_daemon"])
def test_attack_is_contained_with_the_python_launcher(monkeypatch, name):
    """Without util-linux's setpriv/unshare/mount the launcher is a Python program: same guarantees."""
    which = sandbox_module.shutil.which
    monkeypatch.setattr(
        sandbox_module.shutil, "which", lambda n: None if n in ("setpriv", "unshare", "mount") else which(n)
    )
    argv = sandbox_module._launcher_argv(sys.executable, {"binds": [], "uid": 12345, "cgroup_procs": [], "argv": []})
    assert argv[:2] == [sys.executable, "-I"]
    attacks.ATTACKS[name]()


_HELD_TRAINER = r"""
import json, subprocess, sys, time
argv = json.loads(sys.argv[1])
cfg = json.loads(argv.pop())
cfg["caller"] = __import__("os").getpid()
from posttrain.rewards import sandbox
if argv[0] == "python":
    sandbox.shutil.which = lambda name: None
launcher = subprocess.Popen(sandbox._launcher_argv(sys.executable, cfg), start_new_session=True)
print(launcher.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("launcher", ["shell", "python"])
def test_launcher_dies_with_a_trainer_killed_before_bubblewrap_starts(tmp_path, launcher):
    """A trainer SIGKILLed while the launcher is still setting up (here: blocked joining its cgroup, a FIFO nobody
    reads yet) takes the launcher with it: it never goes on to start an orphaned sandbox (setpriv --pdeathsig)."""
    # (without util-linux's setpriv the "shell" case gets the Python launcher: the guarantee is the same)
    fifo = str(tmp_path / "cgroup.procs")
    os.mkfifo(fifo)
    marker = tmp_path / "started"
    cfg = {
        "cgroup_procs": [fifo],
        "binds": [],
        "uid": None,
        "bwrap": "/bin/sh",
        "argv": ["x", "-c", f"touch {marker}"],
    }
    trainer = subprocess.Popen(
        [sys.executable, "-c", _HELD_TRAINER, json.dumps([launcher, json.dumps(cfg)])],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(_HERE))},
    )
    try:
        pid = int(trainer.stdout.readline())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the launcher is blocked opening the FIFO for writing
            with open(f"/proc/{pid}/wchan") as f:
                if f.read() not in ("", "0"):
                    break
            time.sleep(0.05)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ")[1].startswith("Z"):
                break  # dead, waiting to be reaped by init
        time.sleep(0.05)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # would let a surviving launcher go on
    time.sleep(0.5)
    os.close(fd)
    assert not marker.exists(), "the launcher outlived its trainer and started the program"
    if os.path.exists(f"/proc/{pid}"):
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split(") ")[1].startswith("Z"), "the launcher outlived its trainer"


def _delegate_cgroup(uid: int, gid: int) -> tuple[list[str], dict[str, str], list[str]]:
    """Directories (and env) giving ``uid`` its own cgroup, as systemd's Delegate=yes would; ([], {}, []) if impossible.

    Returns (cgroup.procs files to put the user's process in, env for it, directories to remove afterwards).
    """
    from posttrain.rewards import _sandbox_cgroup as cg

    mounts, own = cg._mounts(), cg._own_paths()
    name = f"posttrain-delegated-{os.getpid()}"
    v2 = next((m for m, fs, _ in mounts if fs == "cgroup2"), None)
    try:
        backend, _ = cg.backend()
        if backend is not None and backend.version == 2 and v2 is not None:
            base = os.path.dirname(backend.parents["unified"])  # where this process may create groups
            top = os.path.join(base, name)
            leaf = os.path.join(top, "leaf")
            os.mkdir(top)
            with open(os.path.join(top, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids")
            os.mkdir(leaf)
            for path in (top, leaf):
                os.chown(path, uid, gid)
                for file in ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
                    if os.path.exists(os.path.join(path, file)):
                        os.chown(os.path.join(path, file), uid, gid)
            return [os.path.join(leaf, "cgroup.procs")], {"POSTTRAIN_SANDBOX_CGROUP": top}, [leaf, top]
        if backend is not None and backend.version == 1:
            procs, dirs = [], []
            for controller in ("memory", "pids"):
                mount = next(m for m, fs, opts in mounts if fs == "cgroup" and controller in opts)
                path = os.path.join(mount, own[controller].lstrip("/"), name)
                os.mkdir(path)
                dirs.append(path)
                for entry in [path] + [os.path.join(path, f) for f in os.listdir(path)]:
                    os.chown(entry, uid, gid)
                procs.append(os.path.join(path, "cgroup.procs"))
            return procs, {}, dirs
    except OSError as e:
        logging.getLogger(__name__).warning("could not delegate a cgroup to the test user: %s", e)
    return [], {}, []


# Runs as root: makes the paths the test needs (interpreter, venv, repository) reachable for the unprivileged user
# in a private mount namespace (a tmpfs over each unreadable ancestor such as /root, with just those paths bound
# back), waits until the caller has put it into its cgroup, drops to the user and runs the attack suite.
_AS_USER = r"""
import ctypes, json, os, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
def check(ret, what):
    if ret != 0:
        raise OSError(ctypes.get_errno(), what)
if cfg["hide"]:
    check(libc.unshare(0x00020000), "unshare")
    check(libc.mount(None, b"/", None, 16384 | (1 << 18), None), "private /")
    holds = []
    for i, path in enumerate(cfg["keep"]):
        hold = os.path.join(cfg["hold"], str(i))
        os.mkdir(hold)
        check(libc.mount(path.encode(), hold.encode(), None, 4096 | 16384, None), "hold " + path)
        holds.append((hold, path))
    for top in cfg["hide"]:
        check(libc.mount(b"tmpfs", top.encode(), b"tmpfs", 0, b"mode=755"), "tmpfs " + top)
    for hold, path in holds:
        os.makedirs(path, exist_ok=True)
        check(libc.mount(hold.encode(), path.encode(), None, 4096 | 16384, None), "bind " + path)
sys.stdin.readline()  # the caller has moved this process into its delegated cgroup
os.setgroups([])
os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
os.chdir(cfg["cwd"])
os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
"""


def _unreachable_ancestors(paths: list[str]) -> list[str]:
    tops = set()
    for path in paths:
        parts = os.path.realpath(path).split("/")
        for i in range(2, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if os.path.isdir(prefix) and not os.stat(prefix).st_mode & 0o001:
                tops.add(prefix)
                break
    return sorted(tops)


@pytest.fixture(scope="module")
def unprivileged_results():
    if not IS_ROOT:
        pytest.skip("not root: the caller run above already is the unprivileged run, and no user can be created")
    if CAPS["isolation"] != "bwrap":
        pytest.skip(f"sandbox unavailable: {CAPS['reason']}")
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        # root's tools live in sbin, which a minimal PATH (env -i, cron, CI runners) leaves out
        useradd = shutil.which("useradd") or shutil.which("useradd", path="/usr/sbin:/sbin") or "useradd"
        made = subprocess.run(
            [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", TEST_USER],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.skip(f"cannot create an unprivileged user with useradd: {made.stderr.strip()}")
    user = pwd.getpwnam(TEST_USER)
    procs, cg_env, cg_dirs = _delegate_cgroup(user.pw_uid, user.pw_gid)
    repo = os.path.dirname(os.path.dirname(_HERE))
    python = sys.executable  # the venv's interpreter: it finds pyseccomp and posttrain's dependencies
    keep = sorted({os.path.realpath(p) for p in (repo, sys.prefix, sys.base_prefix, os.path.dirname(python))})
    hide = _unreachable_ancestors(keep)
    keep = [p for p in keep if any(p.startswith(t + "/") for t in hide)]
    hold = tempfile.mkdtemp(prefix="posttrain-sbx-hold-")
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": repo,
        "HOME": "/",
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        **cg_env,
    }
    cfg = {
        "uid": user.pw_uid,
        "gid": user.pw_gid,
        "hide": hide,
        "keep": keep,
        "hold": hold,
        "cwd": tempfile.gettempdir(),
        "argv": [python, "-X", "utf8", os.path.join(_HERE, "sandbox_attacks.py")],
        "env": env,
    }
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _AS_USER, json.dumps(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lock = open(os.path.join(tempfile.gettempdir(), "posttrain-sandbox-tests.lock"), "w")  # as sandbox_lock does
    fcntl.flock(lock, fcntl.LOCK_EX)  # (a module fixture runs before the function-scoped sandbox_lock)
    try:
        for path in procs:
            with open(path, "w") as f:
                f.write(str(proc.pid))
        out, err = proc.communicate("go\n", timeout=240)
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(hold, ignore_errors=True)
        for top in cg_dirs:  # bottom-up: the user's own sandbox groups live inside the delegated one
            nested = [os.path.join(d, n) for d, names, _ in os.walk(top, topdown=False) for n in names] + [top]
            for path in nested:
                for _ in range(100):
                    try:
                        os.rmdir(path)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"attack suite as {TEST_USER} failed: {err[-3000:]}"
    results = json.loads(lines[-1])
    assert results["_uid"] == user.pw_uid
    results["_delegated_cgroup"] = bool(procs)
    return results


@pytest.mark.parametrize("name", sorted(attacks.ATTACKS))
def test_attack_is_contained_for_an_unprivileged_user(unprivileged_results, name):
    assert unprivileged_results[name] == "ok", unprivileged_results[name]


def test_unprivileged_user_gets_a_delegated_cgroup(unprivileged_results):
    # The same isolation as for root, including the per-run cgroup, when the user has a delegated one.
    if unprivileged_results["_delegated_cgroup"]:
        assert unprivileged_results["_cgroup"] == CAPS["cgroup"]


def test_strict_mode_refuses_without_a_cgroup_and_auto_warns(monkeypatch, caplog):
    monkeypatch.setattr(
        sandbox_module,
        "_capabilities",
        {**CAPS, "isolation": "bwrap", "cgroup": None, "cgroup_reason": "test: no cgroup"},
    )
    monkeypatch.setattr(sandbox_module, "_capabilities_pid", os.getpid())
    with pytest.raises(SandboxUnavailable, match="per-run cgroup.*test: no cgroup"):
        run_python("pass", isolation="strict")
    monkeypatch.setattr(sandbox_module, "_warned", set())
    if CAPS["isolation"] == "bwrap":
        with caplog.at_level(logging.WARNING, logger="posttrain.rewards.sandbox"):
            result = run_python("import os\nos.memfd_create('x')", timeout=4)
        assert "no per-run cgroup" in caplog.text
        assert result.status == "error" and "PermissionError" in result.stderr  # memfd denied without a cgroup


def test_missing_bubblewrap_is_an_error_that_says_what_to_install(monkeypatch):
    monkeypatch.setattr(sandbox_module, "_bwrap", lambda: None)
    monkeypatch.setattr(sandbox_module, "_capabilities", None)
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            run_python("pass")
    finally:
        monkeypatch.undo()
        sandbox_module._capabilities = None
        sandbox_capabilities()


def test_basic_mode_needs_opt_in_and_warns(caplog, monkeypatch):
    monkeypatch.setattr(sandbox_module, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.sandbox"):
        try:
            result = run_python("print(1)", isolation="basic", timeout=4)
        except SandboxUnavailable as e:  # root with an interpreter other users cannot read: refuses, never root
            assert "never runs as root" in str(e)
        else:
            assert result.ok and result.stdout == "1\n"
    assert "NOT a security boundary" in caplog.text


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="isolation"):
        run_python("pass", isolation="docker")
    with pytest.raises(ValueError, match="plain names"):
        sandbox_module.run_files({"../x.py": ""}, "../x.py")


@needs_sandbox
def test_binds_env_and_cwd_expose_only_the_given_host_directories():
    from posttrain.rewards.sandbox import Bind

    base = tempfile.mkdtemp(prefix="posttrain-bind-test-")
    try:
        work, data, hidden = (os.path.join(base, name) for name in ("work", "data", "hidden"))
        os.chmod(base, 0o755)
        for path in (work, data):
            os.mkdir(path)
            os.chmod(path, 0o755)
        os.mkdir(hidden, 0o700)  # as root: not reachable by the sandbox's unprivileged user
        with open(os.path.join(data, "in.txt"), "w") as f:
            f.write("data")
        os.chmod(os.path.join(data, "in.txt"), 0o644)
        code = (
            "import os\nprint(os.getcwd(), os.environ['GREETING'], open('/data/in.txt').read())\n"
            "open('out.txt', 'w').write('made')\n"
            "try:\n    open('/data/x', 'w')\nexcept OSError as e:\n    print(e.errno)\n"
            f"print(os.path.exists({base!r}))"
        )
        binds = [Bind(work, "/work", writable=True), Bind(data, "/data")]
        result = sandbox_module.run_files(
            {"main.py": code}, "main.py", timeout=5, binds=binds, env={"GREETING": "hi"}, cwd="/work"
        )
        assert result.ok, result.stderr
        assert result.stdout == "/work hi data\n30\nFalse\n"  # 30: EROFS; the host path itself is not there
        with open(os.path.join(work, "out.txt")) as f:
            assert f.read() == "made"
        if IS_ROOT:  # written by the run's unprivileged uid, never root
            assert os.stat(os.path.join(work, "out.txt")).st_uid != 0
        for bad, message in [
            ([Bind(work, "/usr/local/x")], "overlaps a path the sandbox sets up"),
            ([Bind(work, "/")], "normalised absolute path"),
            ([Bind(work, "rel")], "normalised absolute path"),
            ([Bind(work, "/a"), Bind(data, "/a")], "used once"),
            ([Bind(os.path.join(base, "nope"), "/a")], "is not a directory"),
            (["/tmp"], "Bind objects"),
        ]:
            with pytest.raises((ValueError, TypeError), match=message):
                sandbox_module.run_files({"main.py": ""}, "main.py", binds=bad)
        if IS_ROOT:
            with pytest.raises(ValueError, match="not reachable by other users"):
                sandbox_module.run_files({"main.py": ""}, "main.py", binds=[Bind(hidden, "/h")])
        with pytest.raises(ValueError, match="env must map variable names"):
            sandbox_module.run_files({"main.py": ""}, "main.py", env={"A-B": "x"})
        with pytest.raises(ValueError, match="cwd='/elsewhere' must be"):
            sandbox_module.run_files({"main.py": ""}, "main.py", cwd="/elsewhere")
        with pytest.raises(SandboxUnavailable, match="need bubblewrap isolation"):
            sandbox_module.run_files({"main.py": ""}, "main.py", binds=binds, isolation="basic")
    finally:
        shutil.rmtree(base)


@needs_sandbox
def test_setup_failures_are_a_status_not_an_exception(monkeypatch, caplog):
    from posttrain.rewards import _sandbox_cgroup

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device (too many cgroups)")

    monkeypatch.setattr(_sandbox_cgroup, "RunCgroup", broken)
    monkeypatch.setattr(sandbox_module, "_capabilities", {**CAPS, "cgroup": "v2"})
    monkeypatch.setattr(sandbox_module, "_capabilities_pid", os.getpid())
    monkeypatch.setattr(_sandbox_cgroup, "backend", lambda: (object(), ""))
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.sandbox"):
        result = run_python("print(1)", timeout=4)
    assert result.status == "sandbox_error" and "too many cgroups" in result.stderr
    assert "could not be set up" in caplog.text
    assert attacks.run_test_cases(attacks.ADD_OK, attacks.ADD_TESTS, timeout=4) == 0.0


def test_cgroup_v2_backend_writes_the_limits(tmp_path):
    """The v2 code path on a stand-in hierarchy (this suite's machine may only have v1 controllers)."""
    from posttrain.rewards import _sandbox_cgroup as cg

    root = tmp_path / "cgroup"
    base = root / "machine.slice"
    (base / "job.scope").mkdir(parents=True)  # this process's own group; sandboxes go next to it
    (base / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (base / "memory.swap.max").write_text("max\n")
    parent = base / f"posttrain-sandbox-{os.getpid()}"
    parent.mkdir()
    (parent / "cgroup.subtree_control").write_text("memory pids\n")  # what the kernel shows after enabling them
    backend, reason = cg._try_v2(str(root), "/machine.slice/job.scope")
    assert backend is not None, reason
    assert backend.version == 2 and backend.parents == {"unified": str(parent)} and backend.swap
    group = cg.RunCgroup(backend, 128 << 20, 16)
    (run,) = group.dirs
    assert open(os.path.join(run, "memory.max")).read() == str(128 << 20)
    assert open(os.path.join(run, "memory.swap.max")).read() == "0"
    assert open(os.path.join(run, "memory.oom.group")).read() == "1"
    assert open(os.path.join(run, "pids.max")).read() == "16"
    assert group.procs_files == [os.path.join(run, "cgroup.procs")]
    assert not group.oom_killed()
    with open(os.path.join(run, "memory.events"), "w") as f:
        f.write("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.oom_killed()
    assert group.kill(deadline_s=0.1)  # nothing listed in cgroup.procs: empty
    assert open(os.path.join(run, "cgroup.kill")).read() == "1"
    # without memory/pids in the parent's subtree_control there is no backend, and the reason says so
    (base / "cgroup.subtree_control").write_text("cpu\n")
    backend, reason = cg._try_v2(str(root), "/machine.slice/job.scope")
    assert backend is None and "memory/pids not enabled" in reason
