"""Attacks on the sandbox and on code_reward's grading, one function per attack kind.

Each ``attack_*`` function raises ``AssertionError`` when the attack is NOT contained (wrong code earned reward, the
caller was hurt, something escaped). ``tests/rewards/test_sandbox.py`` runs them in the test process (root in CI)
and, through ``python sandbox_attacks.py``, as an unprivileged user; run as a script it prints one JSON object
``{attack: "ok" | "FAIL: ..."}``.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

from posttrain.rewards import run_python, run_test_cases, sandbox_capabilities

ADD_OK = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(20, 22) == 42", "assert add(-5, 5) == 0"]


def _reward(code: str, tests=ADD_TESTS, **kw) -> float:
    kw.setdefault("timeout", 4.0)
    return run_test_cases(code, tests, **kw)


_good_checked: list[bool] = []


def _zero(code: str, tests=ADD_TESTS, **kw) -> None:
    if not _good_checked:  # the grading itself works: the right solution earns full reward
        assert _reward(ADD_OK) == 1.0
        _good_checked.append(True)
    score = _reward(code, tests, **kw)
    assert score == 0.0, f"wrong code earned reward {score}"


def _leftovers() -> list[int]:
    """Processes of a sandbox still alive (their environment is the sandbox's: HOME=/sandbox)."""
    found = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as f:
                env = f.read()
        except OSError:
            continue
        if b"HOME=/sandbox\0" in env and b"POSTTRAIN_ATTACK_CALLER" not in env:
            found.append(int(path.split("/")[2]))
    return found


def _no_leftovers() -> None:
    deadline = time.monotonic() + 2.0
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _leftovers(), f"sandbox processes survived the run: {_leftovers()}"


# --- the six grading forgeries ----------------------------------------------------------------------------------

_FIND_EXPECTED = r"""
import gc, re, sys
def _expected():
    # an attacker looking for the expected values wherever the harness could have put them
    found = {}
    texts = []
    frame = sys._getframe(0)
    while frame is not None:
        texts += [repr(v) for v in list(frame.f_locals.values()) + list(frame.f_globals.values())]
        frame = frame.f_back
    texts += [o for o in gc.get_objects() if isinstance(o, str)]
    texts += [repr(o) for o in gc.get_objects() if isinstance(o, (list, dict, tuple))][:20000]
    for t in texts:
        for m in re.finditer(r"add\((-?\d+), (-?\d+)\) == (-?\d+)", t):
            found[(int(m.group(1)), int(m.group(2)))] = int(m.group(3))
    return found
"""


def attack_forgery_frame_introspection() -> None:
    """Read the pass marker / expected values from the harness's frames (sys._getframe(1).f_locals) and gc."""
    code = _FIND_EXPECTED + (
        "def add(a, b):\n"
        "    f = sys._getframe(1)\n"
        "    for k, v in list(f.f_locals.items()):\n"
        "        if isinstance(v, str) and v.startswith('posttrain-pass-'):\n"
        "            print('\\n%s 0\\n%s 1\\n%s 2' % (v, v, v))\n"
        "    return _expected().get((a, b), -1)\n"
    )
    _zero(code)


def attack_forgery_proc_self_mem() -> None:
    """Scan the interpreter's own memory (/proc/self/mem) for the test source and its expected values."""
    code = (
        "import re\n"
        "def _scan():\n"
        "    found = {}\n"
        "    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:\n"
        "        for line in maps:\n"
        "            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "            if 'r' not in line.split()[1] or hi - lo > 64 << 20:\n"
        "                continue\n"
        "            try:\n"
        "                mem.seek(lo); chunk = mem.read(hi - lo)\n"
        "            except (OSError, ValueError, OverflowError):\n"
        "                continue\n"
        "            for m in re.finditer(rb'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', chunk):\n"
        "                found[(int(m.group(1)), int(m.group(2)))] = int(m.group(3))\n"
        "    return found\n"
        "_TABLE = _scan()\n"
        "def add(a, b):\n"
        "    return _TABLE.get((a, b), -1)\n"
    )
    _zero(code)


def attack_forgery_always_equal() -> None:
    """Return an object whose __eq__ is always true (and a bool/int subclass lying about its value)."""
    code = (
        "class Anything:\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    __hash__ = object.__hash__\n"
        "class LyingInt(int):\n"
        "    def __eq__(self, other): return True\n"
        "    __hash__ = int.__hash__\n"
        "_n = [0]\n"
        "def add(a, b):\n"
        "    _n[0] += 1\n"
        "    return Anything() if _n[0] % 2 else LyingInt(-1)\n"
    )
    _zero(code)


def attack_forgery_patched_compile() -> None:
    """Patch builtins.compile/exec/eval and json.dumps so the tests compile to nothing or report success."""
    code = (
        "import builtins, json\n"
        "_compile = builtins.compile\n"
        "builtins.compile = lambda src, fn, mode, *a, **k: _compile('None' if mode == 'eval' else 'pass', fn, mode)\n"
        "builtins.exec = lambda *a, **k: None\n"
        "class Anything:\n    __eq__ = lambda self, other: True\n"
        "builtins.eval = lambda *a, **k: Anything()\n"
        'json.dumps = lambda *a, **k: \'{"solution": "ok"}\'\n'
        "def add(a, b):\n"
        "    return -1\n"
    )
    _zero(code)


def attack_forgery_shadowed_builtins() -> None:
    """Shadow len/sorted/abs/all/isinstance that the tests call (the solution shares the tests' namespace)."""
    tests = ["assert len(f(3)) == 3", "assert sorted(f(2)) == [0, 1]", "assert abs(g(-2)) == 2",
             "assert all(x == 1 for x in f(3))", "assert math.isclose(g(0.5), 0.5)"]  # fmt: skip
    good = "def f(n):\n    return list(range(n))[::-1]\ndef g(x):\n    return -x if x < 0 else x\n"
    wrong = (
        "import builtins, math\n"
        "len = lambda x: 3\nsorted = lambda x: [0, 1]\nabs = lambda x: 2\nall = lambda x: True\n"
        "builtins.len, builtins.sorted, builtins.abs, builtins.all = len, sorted, abs, all\n"
        "math.isclose = lambda *a, **k: True\n"
        "def f(n):\n    return 'x'\ndef g(x):\n    return 'y'\n"
    )
    assert _reward(good, tests) == 0.8  # all(x == 1 ...) is false for the good one too
    score = _reward(wrong, tests)
    assert score == 0.0, f"wrong code earned reward {score}"


def attack_forgery_read_shipped_tests() -> None:
    """Read the test cases / expected values from the working directory, stdin, argv and env; answer from a table."""
    code = (
        "import os, re, sys\n"
        "_blob = ' '.join(sys.argv) + ' ' + repr(dict(os.environ))\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    if root.startswith(('/proc', '/sys', '/usr', '/dev', sys.base_prefix)):\n"
        "        dirs[:] = []\n        continue\n"
        "    for name in files:\n"
        "        try:\n"
        "            _blob += open(os.path.join(root, name), errors='replace').read()\n"
        "        except OSError:\n"
        "            pass\n"
        "_TABLE = {(int(a), int(b)): int(c) for a, b, c in re.findall(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', _blob)}\n"
        "def add(a, b):\n"
        "    # also claim passes on every descriptor (the answer channel only carries values, never a verdict)\n"
        "    for fd in range(1, 12):\n"
        "        try:\n"
        '            os.write(fd, b\'\'.join(b\'{"k": %d, "passed": true}\\n{"k": %d, "v": true}\\n\' % (k, k) for k in range(12)))\n'
        "        except OSError:\n"
        "            pass\n"
        "    return _TABLE.get((a, b), -1)\n"
    )
    _zero(code)


def attack_forgery_early_exit() -> None:
    """Exit 0 before the tests run, or print fake results (the old pass-marker attacks)."""
    for code in (
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        'print(\'{"solution": "ok"}\')\nprint(\'{"k": 0, "v": 3}\')\n',
        'def add(a, b):\n    import os\n    os.write(1, b\'{"k": 0, "v": 3}\\n\')\n    os._exit(0)\n',
    ):
        _zero(code)


# --- resource attacks -------------------------------------------------------------------------------------------


def attack_memory_many_processes() -> None:
    """16 processes x 60 MB under memory_mb=128: the limit must hold for the run, not per process."""
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "for i in range(8):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        x = bytearray(60 << 20)\n"
        "        for j in range(0, len(x), 4096):\n"
        "            x[j] = 1\n"
        "        os.write(w, b'%d,' % os.getpid())\n"
        "        time.sleep(5)\n"
        "        os._exit(0)\n"
        "os.close(w)\n"
        "time.sleep(1.5)\n"
        "os.set_blocking(r, False)\n"
        "try:\n    pids = [int(p) for p in os.read(r, 1000).split(b',') if p]\nexcept BlockingIOError:\n    pids = []\n"
        # held now = children that filled their 60 MB and are still alive (the OOM killer may have taken one that
        # had already reported, so counting reports alone would overcount)
        "n = sum(1 for p in pids if os.waitpid(p, os.WNOHANG) == (0, 0))\n"
        "print('held', n)\n"
    )
    caps = sandbox_capabilities()
    result = run_python(code, timeout=3, memory_mb=128, max_processes=6)
    held = int(result.stdout.split()[-1]) if result.stdout.startswith("held") else 0
    if caps["cgroup"]:
        assert held * 60 <= 128, f"{held} x 60 MB held under a 128 MB run limit"
    else:  # per-process limits only: at most max_processes - 1 children
        assert held <= 5, f"{held} children held memory"
    _no_leftovers()


def attack_memory_memfd() -> None:
    """1 GB in a memfd (not counted by RLIMIT_AS) under memory_mb=128."""
    code = (
        "import os\n"
        "fd = os.memfd_create('bomb')\n"
        "for i in range(1024):\n"
        "    os.write(fd, b'x' * (1 << 20))\n"
        "print('survived with', os.fstat(fd).st_size >> 20, 'MB')\n"
    )
    result = run_python(code, timeout=4, memory_mb=128, max_file_mb=4096)
    assert "survived" not in result.stdout, result.stdout
    assert result.status in ("memory", "error", "killed"), result
    # tmpfs counts too: the same bomb into /tmp (a 1 GB tmpfs here) must stop at the run's memory limit
    code = "with open('/tmp/big', 'wb') as f:\n    for i in range(1024):\n        f.write(b'x' * (1 << 20))\nprint('survived')"
    result = run_python(code, timeout=4, memory_mb=128, max_file_mb=4096, disk_mb=1024)
    if sandbox_capabilities()["cgroup"]:
        assert "survived" not in result.stdout and result.status in ("memory", "killed"), result
    _no_leftovers()


def attack_fork_bomb() -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    result = run_python(code, timeout=1.5, max_processes=16)
    assert result.status in ("timeout", "killed", "error"), result
    assert time.monotonic() - start < 6
    _no_leftovers()


def attack_setsid_daemon() -> None:
    """A double-forked setsid daemon must die with the run, and must not delay the result."""
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    start = time.monotonic()
    result = run_python(code, timeout=5)
    assert result.status == "ok" and "parent done" in result.stdout, result
    assert time.monotonic() - start < 3, "the caller waited for the daemon"
    _no_leftovers()


def attack_status_pipe_hold() -> None:
    """A background process that keeps stdout/stderr (and every other inherited fd) open must not hang the caller."""
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('bye')\n"
    start = time.monotonic()
    result = run_python(code, timeout=20)
    assert result.status == "ok", result
    assert time.monotonic() - start < 3, "the caller waited on a pipe held by a background process"
    # and through code_reward: a held pipe after the answers keeps the credit, and returns fast
    start = time.monotonic()
    score = _reward("import os, time\nif os.fork() == 0:\n    time.sleep(60)\n" + ADD_OK, timeout=20)
    assert score == 1.0 and time.monotonic() - start < 3
    _no_leftovers()


def attack_deep_directory_tree() -> None:
    """A very deep directory tree in the working directory must not crash or slow the caller's cleanup."""
    code = "import os\nfor i in range(20000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')\n"
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "posttrain-sandbox-*")))
    result = run_python(code, timeout=5)
    assert result.status in ("ok", "error", "timeout", "memory"), result
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), "posttrain-sandbox-*")))
    assert not after - before, f"temp dirs left behind: {after - before}"
    score = _reward(code.replace("print('deep')\n", "") + ADD_OK)
    assert score in (0.0, 1.0)  # no RecursionError out of code_reward


def attack_disk_fill() -> None:
    """Filling the disk stops at the sandbox's tmpfs size; nothing reaches the host's file systems."""
    code = (
        "import os\n"
        "total = 0\n"
        "for d in ('/tmp', '/sandbox', '.'):\n"
        "    try:\n"
        "        for i in range(10000):\n"
        "            with open(os.path.join(d, 'fill%d-%d' % (len(d), i)), 'wb') as f:\n"
        "                f.write(b'x' * (1 << 20))\n"
        "            total += 1\n"
        "    except OSError as e:\n"
        "        print(d, e.errno)\n"
        "print('total', total)\n"
    )
    tmp_before = os.statvfs(tempfile.gettempdir())
    result = run_python(code, timeout=5, disk_mb=16, max_file_mb=64, memory_mb=256)
    lines = result.stdout.split()
    assert "total" in lines, result
    total = int(lines[lines.index("total") + 1])
    assert total <= 2 * 16, f"wrote {total} MB with disk_mb=16"
    tmp_after = os.statvfs(tempfile.gettempdir())
    # the host's temp file system did not receive the writes (allow for other users' noise)
    assert (tmp_before.f_bavail - tmp_after.f_bavail) * tmp_after.f_frsize < 200 << 20


# --- information and escape -------------------------------------------------------------------------------------


def attack_env_and_proc_reads() -> None:
    secret = "posttrain-secret-" + os.urandom(8).hex()
    os.environ["POSTTRAIN_ATTACK_SECRET"] = secret
    try:
        code = (
            "import glob, os\n"
            "blob = repr(dict(os.environ))\n"
            "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline') + ['/proc/1/environ']:\n"
            "    try:\n"
            "        blob += open(path, 'rb').read().decode(errors='replace')\n"
            "    except OSError:\n"
            "        pass\n"
            "print('FOUND' if 'posttrain-secret-' in blob else 'clean')\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        )
        result = run_python(code, timeout=4)
        assert result.status == "ok", result
        assert secret not in result.stdout and "clean" in result.stdout, result.stdout
        pids = json.loads(result.stdout.splitlines()[1])
        assert len(pids) <= 3, f"host processes visible: {pids}"
    finally:
        del os.environ["POSTTRAIN_ATTACK_SECRET"]


def attack_file_escape() -> None:
    host_dir = tempfile.mkdtemp(prefix="posttrain-attack-")
    try:
        secret_file = os.path.join(host_dir, "secret.txt")
        with open(secret_file, "w") as f:
            f.write("top-secret")
        os.chmod(host_dir, 0o755)
        os.chmod(secret_file, 0o644)  # readable by anyone on the host: only the mount namespace hides it
        code = (
            "import os\n"
            f"targets = [{secret_file!r}, '/etc/passwd', '/etc/shadow', '/root/.bashrc', {os.getcwd()!r} + '/pyproject.toml']\n"
            "for t in targets:\n"
            "    try:\n"
            "        print('READ', t, open(t).read()[:20])\n"
            "    except OSError as e:\n"
            "        print('no', t, e.errno)\n"
            f"for t in [{host_dir!r} + '/planted', '/usr/planted', '/planted', '/sandbox/../planted', '/etc/planted']:\n"
            "    try:\n"
            "        open(t, 'w').write('x')\n"
            "        print('WROTE', t)\n"
            "    except OSError as e:\n"
            "        print('no', t, e.errno)\n"
            "print(sorted(os.listdir('/')))\n"
        )
        result = run_python(code, timeout=4)
        assert result.status == "ok", result
        assert "READ" not in result.stdout, result.stdout
        assert "top-secret" not in result.stdout
        assert os.listdir(host_dir) == ["secret.txt"], "the sandbox wrote into a host directory"
        assert not os.path.exists("/usr/planted") and not os.path.exists("/planted")
        top = set(eval(result.stdout.splitlines()[-1]))  # noqa: S307 -- our own program's printed list
        extra = top - {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sandbox", "sbin", "tmp", "usr"}
        allowed = {os.path.realpath(p).split("/")[1] for p in (sys.base_prefix, sys._base_executable)}
        assert extra <= allowed, f"unexpected top-level entries {extra}"
    finally:
        import shutil

        shutil.rmtree(host_dir, ignore_errors=True)


def attack_loopback_listener() -> None:
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    try:
        tport, uport = tcp.getsockname()[1], udp.getsockname()[1]
        code = (
            "import socket\n"
            "s = socket.socket(); s.settimeout(1)\n"
            "try:\n"
            f"    s.connect(('127.0.0.1', {tport})); s.sendall(b'hello'); print('TCP CONNECTED')\n"
            "except OSError as e:\n"
            "    print('tcp', e.errno)\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "try:\n"
            f"    u.sendto(b'hello', ('127.0.0.1', {uport})); print('udp sent')\n"
            "except OSError as e:\n"
            "    print('udp', e.errno)\n"
            "try:\n"
            "    socket.create_connection(('1.1.1.1', 53), timeout=1); print('INTERNET')\n"
            "except OSError as e:\n"
            "    print('net', e.errno)\n"
        )
        result = run_python(code, timeout=5)
        assert "CONNECTED" not in result.stdout and "INTERNET" not in result.stdout, result.stdout
        tcp.settimeout(0.2)
        udp.settimeout(0.2)
        try:
            conn, _ = tcp.accept()
            conn.close()
            raise AssertionError("the sandbox reached a loopback TCP listener")
        except TimeoutError:
            pass
        try:
            udp.recvfrom(100)
            raise AssertionError("the sandbox reached a loopback UDP listener")
        except TimeoutError:
            pass
    finally:
        tcp.close()
        udp.close()


def attack_kill_parent_and_group() -> None:
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        code = (
            "import os, signal\n"
            f"for attempt in (lambda: os.kill(os.getppid(), 9), lambda: os.kill({os.getpid()}, 9),\n"
            f"                lambda: os.killpg({os.getpgid(0)}, 9), lambda: os.kill({sentinel.pid}, 9),\n"
            "                lambda: os.kill(-1, 9)):\n"
            "    try:\n"
            "        attempt()\n"
            "    except OSError as e:\n"
            "        print('blocked', e.errno)\n"
        )
        result = run_python(code, timeout=4)
        assert result.status in ("ok", "killed"), result
        time.sleep(0.1)
        assert sentinel.poll() is None, "the sandbox killed a process of the caller"
    finally:
        sentinel.kill()
        sentinel.wait()


def attack_output_flood() -> None:
    start = time.monotonic()
    result = run_python(
        "import os\nwhile True:\n    os.write(1, b'x' * 65536)\n    os.write(2, b'y' * 65536)\n",
        timeout=4,
        max_output_bytes=10_000,
    )
    assert result.status == "output_limit" and result.truncated, result.status
    assert len(result.stdout) <= 10_000 and len(result.stderr) <= 10_000
    assert time.monotonic() - start < 3
    _no_leftovers()


def attack_raised_rlimits() -> None:
    code = (
        "import resource\n"
        "for name in ('RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_CPU', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE'):\n"
        "    res = getattr(resource, name)\n"
        "    soft, hard = resource.getrlimit(res)\n"
        "    try:\n"
        "        resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
        "        print('RAISED', name)\n"
        "    except (ValueError, OSError) as e:\n"
        "        print('kept', name, hard)\n"
        "    try:\n"
        "        resource.prlimit(0, res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
        "        print('RAISED', name)\n"
        "    except (ValueError, OSError):\n"
        "        pass\n"
        "x = bytearray(300 << 20)\n"
        "print('ALLOCATED')\n"
    )
    result = run_python(code, timeout=4, memory_mb=128)
    assert "RAISED" not in result.stdout and "ALLOCATED" not in result.stdout, result.stdout
    assert result.status == "memory", result


_SYSCALLS = {  # name: (x86_64, aarch64)
    "io_uring_setup": (425, 425),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "bpf": (321, 280),
    "ptrace": (101, 117),
    "unshare": (272, 97),
    "mount": (165, 40),
    "keyctl": (250, 219),
    "kexec_load": (246, 104),
    "process_vm_readv": (310, 270),
}


def attack_syscall_surface() -> None:
    arch = 0 if platform.machine() in ("x86_64", "AMD64") else 1
    calls = {name: numbers[arch] for name, numbers in _SYSCALLS.items()}
    code = (
        "import ctypes, json, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        f"calls = {calls!r}\n"
        "out = {}\n"
        "buf = ctypes.create_string_buffer(256)\n"
        "for name, nr in calls.items():\n"
        "    args = (0x10000000,) if name == 'unshare' else (1, ctypes.addressof(buf), 0, 0, 0)\n"
        "    ret = libc.syscall(nr, *args)\n"
        "    out[name] = [ret, ctypes.get_errno()]\n"
        "status = open('/proc/self/status').read()\n"
        "out['seccomp'] = [l.split()[1] for l in status.splitlines() if l.startswith('Seccomp:')]\n"
        "out['nnp'] = [l.split()[1] for l in status.splitlines() if l.startswith('NoNewPrivs:')]\n"
        "out['oom'] = open('/proc/self/oom_score_adj').read().strip()\n"
        "out['uid_map'] = open('/proc/self/uid_map').read().split()\n"
        "out['caps'] = [l.split()[1] for l in status.splitlines() if l.startswith('CapEff:')]\n"
        "print(json.dumps(out))\n"
    )
    result = run_python(code, timeout=4)
    assert result.status == "ok", result
    out = json.loads(result.stdout)
    for name in calls:
        ret, err = out[name]
        assert ret == -1 and err in (errno.EPERM, errno.ENOSYS), f"{name} returned {ret} (errno {err})"
    assert out["seccomp"] == ["2"], out["seccomp"]  # a seccomp filter is installed
    assert out["nnp"] == ["1"]
    assert out["oom"] == "1000"
    assert out["caps"] == ["0000000000000000"]
    assert out["uid_map"][0] == "1000"


# Holds until the host has looked at it: SIGWINCH's default action is to ignore it, so one sent before the mask is
# set is lost rather than fatal (the host sends it again until the run ends).
_HOLD_UNTIL_SIGWINCH = (
    "import signal\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH})\n"
    "print('released' if signal.sigtimedwait({signal.SIGWINCH}, 50) else 'not released')\n"
)


def attack_never_root_on_the_host() -> None:
    """Seen from the host, every sandboxed process runs under an unprivileged uid (a per-run one for root callers).

    The sandboxed program waits until the host has read its uid and released it with a signal, so no window of the
    clock decides whether the host sees it; the host keeps reading every sandbox process until the run ends."""
    import threading

    box: dict = {}

    def run() -> None:
        try:
            box["r"] = run_python(_HOLD_UNTIL_SIGWINCH, timeout=60)
        except BaseException as e:  # noqa: BLE001 -- re-raised below, on the test's thread
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    uids: set[int] = set()
    programs: set[int] = set()
    deadline = time.monotonic() + 90
    while thread.is_alive() and time.monotonic() < deadline:
        for pid in _leftovers():
            try:
                with open(f"/proc/{pid}/status") as f:
                    uids.update(int(line.split()[1]) for line in f if line.startswith("Uid:"))
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"main.py" in f.read():
                        programs.add(pid)  # its uid is read: it may go
            except OSError:
                continue
        for pid in programs:
            with contextlib.suppress(OSError):  # it ended already
                os.kill(pid, signal.SIGWINCH)
        thread.join(0.05)
    thread.join()
    if "error" in box:
        raise box["error"]
    assert box["r"].ok and box["r"].stdout.strip() == "released", box["r"]
    assert programs, "the sandboxed program was never seen"
    assert 0 not in uids, f"sandboxed processes ran as root on the host: {uids}"
    if os.geteuid() != 0:
        assert uids == {os.geteuid()}


def _sandboxes_of(ancestor: int) -> dict[int, str]:
    """Sandbox processes (see :func:`_leftovers`) descended from ``ancestor``, with their pid namespace."""
    found = {}
    for pid in _leftovers():
        chain, cur = set(), pid
        while cur > 1 and cur not in chain and len(chain) < 64:
            chain.add(cur)
            try:
                with open(f"/proc/{cur}/status") as f:
                    cur = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
            except (OSError, StopIteration):
                break
        if ancestor in chain:
            try:
                found[pid] = os.readlink(f"/proc/{pid}/ns/pid")
            except OSError:
                continue
    return found


def _in_namespaces(namespaces: set[str]) -> list[int]:
    """Every process still in one of these pid namespaces."""
    left = []
    for path in glob.glob("/proc/[0-9]*/ns/pid"):
        try:
            if os.readlink(path) in namespaces:
                left.append(int(path.split("/")[2]))
        except OSError:
            continue
    return left


def attack_caller_killed_mid_run() -> None:
    """If the trainer dies (SIGKILL) while a sandbox runs, the whole sandbox dies with it (--die-with-parent)."""
    script = (
        "import faulthandler, signal, threading, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"  # where it waits, if the sandbox never starts
        "from posttrain.rewards import run_python, sandbox_capabilities\n"
        "sandbox_capabilities()\n"  # the capability probe's own brief sandbox runs now, not during the wait below
        "threading.Thread(target=run_python, args=('import time\\ntime.sleep(30)',), kwargs={'timeout': 30}).start()\n"
        "time.sleep(30)\n"
    )
    log = tempfile.TemporaryFile()  # the trainer's stderr, to say why when the sandbox never starts
    trainer = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "POSTTRAIN_ATTACK_CALLER": "1"}, stderr=log
    )
    try:
        # Only the trainer's own sandbox counts (other test processes may run sandboxes meanwhile), and only once
        # it has lasted half a second: the 30-second run, not a brief one.
        seen: dict[int, str] = {}
        deadline = time.monotonic() + 90  # the trainer imports torch first: slow on a loaded machine
        while trainer.poll() is None and time.monotonic() < deadline:
            if _sandboxes_of(trainer.pid):
                time.sleep(0.5)
                seen = _sandboxes_of(trainer.pid)
                if seen:
                    break
            time.sleep(0.05)
        if not seen:
            if trainer.poll() is None:
                trainer.send_signal(signal.SIGUSR1)  # faulthandler writes every thread's stack to its stderr
                time.sleep(1.0)
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise AssertionError(f"the sandbox did not start (trainer exit code {trainer.poll()}); stderr:\n{tail}")
    finally:
        trainer.kill()
        trainer.wait()
        log.close()
    namespaces = set(seen.values())
    deadline = time.monotonic() + 2.0
    while _in_namespaces(namespaces) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _in_namespaces(namespaces), f"the killed trainer's sandbox survived: {_in_namespaces(namespaces)}"
    # the next trainer to start sweeps what the dead one left: its cgroups and temporary directories
    sweep = "from posttrain.rewards import run_python\nassert run_python('pass').ok\n"
    subprocess.run([sys.executable, "-c", sweep], check=True, env={**os.environ, "POSTTRAIN_ATTACK_CALLER": "1"})
    from posttrain.rewards import _sandbox_cgroup

    backend, _ = _sandbox_cgroup.backend()
    bases = [os.path.dirname(p) for p in backend.parents.values()] if backend else []
    stale = [os.path.join(b, f"posttrain-sandbox-{trainer.pid}") for b in bases]
    stale += glob.glob(os.path.join(tempfile.gettempdir(), f"posttrain-sandbox-{trainer.pid}-*"))
    assert not [p for p in stale if os.path.exists(p)], f"left behind by the killed trainer: {stale}"


ATTACKS = {name[len("attack_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("attack_")}


def main() -> None:
    os.environ["POSTTRAIN_ATTACK_CALLER"] = "1"
    results = {"_uid": os.geteuid(), "_cgroup": sandbox_capabilities().get("cgroup")}
    for name, fn in ATTACKS.items():
        try:
            fn()
            results[name] = "ok"
        except BaseException as e:  # noqa: BLE001 -- report every failure, keep going
            results[name] = f"FAIL: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    print(json.dumps(results))


if __name__ == "__main__":
    main()
