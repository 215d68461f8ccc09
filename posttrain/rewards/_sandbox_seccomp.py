"""The sandbox's seccomp filter: a deny list compiled to a BPF program with libseccomp (``pyseccomp`` binding).

The program is built once per process and handed to bubblewrap (``bwrap --seccomp FD``), which installs it on the
sandboxed program after the sandbox is set up (so bwrap itself may still mount and unshare). Default action: allow;
the listed system calls fail with ``EPERM`` (``clone3`` with ``ENOSYS`` so the C library falls back to ``clone``,
whose flags the filter can inspect). System calls of a foreign architecture (e.g. the 32-bit ABI on x86-64) kill
the process (libseccomp's default for architectures not added to the filter).
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading

# Kernel attack surface a Python test program never needs, and escape / interference primitives.
DENIED_SYSCALLS = (  # fmt: skip
    # asynchronous I/O rings, kernel performance counters, page-fault handling in user space, eBPF
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "perf_event_open",
    "userfaultfd",
    "bpf",
    # inspecting or writing other processes' memory, comparing kernel objects, stealing file descriptors
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "process_madvise",
    # namespaces and mounts (bubblewrap has already built the sandbox)
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    # kernel modules, kexec, reboot, swap, accounting, quotas, kernel log, keyrings, clocks
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "add_key",
    "request_key",
    "keyctl",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    # hardware / NUMA / personality tricks
    "iopl",
    "ioperm",
    "personality",
    "vhangup",
    "lookup_dcookie",
    "fanotify_init",
    "move_pages",
    "migrate_pages",
    "mbind",
    "set_mempolicy",
    "nfsservctl",
    "uselib",
    "_sysctl",
)
# Without a memory cgroup, anonymous in-memory files are not counted by RLIMIT_AS once unmapped: deny them.
MEMFD_SYSCALLS = ("memfd_create", "memfd_secret")
_CLONE_NEWUSER = 0x10000000

_cache: dict[bool, bytes] = {}
_lock = threading.Lock()


class SeccompUnavailable(RuntimeError):
    pass


def bpf_program(deny_memfd: bool) -> bytes:
    """The compiled filter (raw ``struct sock_filter`` array, as ``bwrap --seccomp`` expects), cached."""
    with _lock:
        if deny_memfd not in _cache:
            _cache[deny_memfd] = _build(deny_memfd)
        return _cache[deny_memfd]


def _build(deny_memfd: bool) -> bytes:
    try:
        import pyseccomp as seccomp
    except Exception as e:  # noqa: BLE001 -- ImportError, or OSError/AttributeError when libseccomp.so.2 is missing
        raise SeccompUnavailable(
            f"the seccomp binding could not be loaded ({type(e).__name__}: {e}). Install it with "
            "`pip install pyseccomp` (or `pip install posttrain[sandbox]`) and the library with "
            "`apt-get install libseccomp2`."
        ) from e
    eperm = seccomp.ERRNO(errno.EPERM)
    filt = seccomp.SyscallFilter(seccomp.ALLOW)
    names = DENIED_SYSCALLS + (MEMFD_SYSCALLS if deny_memfd else ())
    for name in names:
        try:
            filt.add_rule(eperm, name)
        except (OSError, ValueError, RuntimeError):
            continue  # not a system call on this architecture
    filt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    filt.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER))
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x20000000, 0x40000000):
        filt.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # TIOCSTI (push characters into a terminal's input) -- bwrap --new-session also prevents it.
    filt.add_rule(eperm, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, 0x5412))
    with tempfile.TemporaryFile() as f:
        filt.export_bpf(f)
        f.seek(0)
        program = f.read()
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp exported a malformed BPF program ({len(program)} bytes).")
    return program


def program_fd(deny_memfd: bool) -> int:
    """A fresh readable file descriptor holding the program (bwrap reads it to EOF); the caller closes it."""
    program = bpf_program(deny_memfd)
    fd = os.memfd_create("posttrain-seccomp", os.MFD_CLOEXEC) if hasattr(os, "memfd_create") else -1
    if fd < 0:
        f = tempfile.TemporaryFile()
        fd = os.dup(f.fileno())
        f.close()
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
