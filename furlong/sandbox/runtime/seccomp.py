"""The sandbox's seccomp filter: a deny list of kernel attack surface, compiled once per policy by libseccomp.

The list is Docker's default profile seen from a container without capabilities (what it refuses outright
or leaves to a capability the sandbox has dropped), plus io_uring (newer Docker refuses it too), adjtimex,
clock_adjtime and name_to_handle_at. Everything else is allowed: ptrace (tasks use gdb and strace) and
personality (gdb's ADDR_NO_RANDOMIZE; libseccomp cannot say "any value but these" in an allow-by-default
filter). A denied call fails with EPERM rather than killing the caller, so programs that probe for a
feature (io_uring, userfaultfd, keyrings) fall back. A policy's `allow` takes names off the list.

Architectures: the filter covers the native ABI only, and a syscall made through any other ABI (i386's
`int 0x80`, x32 on x86_64, AArch32 on arm64) KILLS the process: those ABIs number syscalls differently, so
a deny list written for one is no defence against another. 32-bit binaries therefore cannot run in a
filtered sandbox; a task that needs them sets `seccomp = false`.

bwrap reads the compiled program (an array of struct sock_filter) from an fd with `--seccomp FD`; it
reads to the end of the file, so each sandbox gets its own fd over the cached bytes (`filter_fd`).
"""

from __future__ import annotations

import errno
import functools
import os

from furlong.sandbox.base import SandboxError, SyscallPolicy

try:
    import pyseccomp as scmp
except (ImportError, RuntimeError) as exc:  # pyseccomp loads libseccomp.so.2 when imported
    scmp, _MISSING = None, str(exc)

DENIED: tuple[str, ...] = (
    # new namespaces and mounts: the sandbox's own layout is fixed by bwrap
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "chroot",
    # kernel attack surface that ordinary programs do without
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "lookup_dcookie",
    "fanotify_init",
    # the machine itself: modules, kexec, reboot, swap, clocks, accounting, quotas, host names, raw I/O
    "init_module",
    "finit_module",
    "delete_module",
    "create_module",
    "get_kernel_syms",
    "query_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "syslog",
    "_sysctl",
    "settimeofday",
    "stime",
    "clock_settime",
    "adjtimex",
    "clock_adjtime",
    "quotactl",
    "quotactl_fd",
    "sethostname",
    "setdomainname",
    "vhangup",
    "iopl",
    "ioperm",
    "nfsservctl",
    "uselib",
    "ustat",
    "sysfs",
    # file handles bypass path checks (the "shocker" container escape)
    "open_by_handle_at",
    "name_to_handle_at",
    # other processes' memory placement and file tables
    "mbind",
    "set_mempolicy",
    "get_mempolicy",
    "set_mempolicy_home_node",
    "migrate_pages",
    "move_pages",
    "kcmp",
    "pidfd_getfd",
    "process_madvise",
    # only some calls of these are refused (see _conditions)
    "clone",
    "clone3",
    "socket",
)

_NEW_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
_AF_VSOCK = 40  # reaches the hypervisor's host when the machine is a VM
# clone3 takes its flags in memory, where seccomp cannot look: ENOSYS makes glibc fall back to clone,
# whose flags it can (Docker does the same).
_ERRNO = {"clone3": errno.ENOSYS}


class SeccompError(SandboxError):
    """A syscall policy the filter cannot be built from (an unknown name, no libseccomp)."""


def _conditions(name: str) -> list[tuple]:
    """The argument tests under which `name` is refused; [()] means every call."""
    if name == "clone":  # refused only with a flag asking for a new namespace (x86_64/arm64: flags are arg 0)
        return [(scmp.Arg(0, scmp.MASKED_EQ, bit, bit),) for bit in _NEW_NAMESPACE_FLAGS]
    if name == "socket":
        return [(scmp.Arg(0, scmp.EQ, _AF_VSOCK),)]
    return [()]


def _lib():
    """pyseccomp, or a one-line error saying how to get it or do without."""
    if scmp is None:
        raise SeccompError(
            f"the seccomp filter needs libseccomp.so.2 ({_MISSING}): install Debian's "
            "libseccomp2, or turn the filter off with sandbox.seccomp=false"
        )
    return scmp


def _number(name: str) -> int:
    """The native syscall number; negative for a name libseccomp knows only on other architectures."""
    nr = _lib().resolve_syscall(scmp.Arch.NATIVE, name)
    if nr == -1:  # __NR_SCMP_ERROR: not a syscall name on any architecture libseccomp knows
        raise SeccompError(f"unknown syscall name {name!r} in the seccomp allow list")
    return nr


def check(allow: tuple[str, ...] | list[str]) -> None:
    """Raises SeccompError naming the first entry of `allow` that is not a syscall name."""
    for name in allow:
        _number(name)


@functools.lru_cache(maxsize=64)
def program(allow: frozenset[str] = frozenset()) -> bytes:
    """The compiled BPF program for the default deny list minus `allow`; built once per distinct list."""
    check(sorted(allow))
    filt = _lib().SyscallFilter(scmp.ALLOW)
    filt.set_attr(scmp.Attr.ACT_BADARCH, scmp.KILL_PROCESS)
    for name in DENIED:
        if name in allow or _number(name) < 0:  # not a syscall on this architecture: nothing to deny
            continue
        action = scmp.ERRNO(_ERRNO.get(name, errno.EPERM))
        for args in _conditions(name):
            filt.add_rule(action, name, *args)
    fd = os.memfd_create("furlong-seccomp", os.MFD_CLOEXEC)
    try:
        filt.export_bpf(_Fileno(fd))
        size = os.lseek(fd, 0, os.SEEK_CUR)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def filter_fd(policy: SyscallPolicy) -> int | None:
    """A fresh fd to hand bwrap as `--seccomp FD` (the caller closes it once bwrap has started), or None
    when the policy is off. After the first sandbox of a policy this is a memfd write: microseconds."""
    if not policy.enabled:
        return None
    data = program(frozenset(policy.allow))
    fd = os.memfd_create("furlong-seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


class _Fileno:
    """pyseccomp's export takes a file object; this lends it a bare fd."""

    def __init__(self, fd: int):
        self._fd = fd

    def fileno(self) -> int:
        return self._fd
