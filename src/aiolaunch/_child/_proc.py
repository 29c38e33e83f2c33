"""``/proc/self``, read from inside a worker or the zygote: the worker side's one door to it.

Six readings, each a few system calls; every one has a fallback where there
is no procfs (macOS), stated in its docstring. Standard library only, like
everything in this folder.
"""

from __future__ import annotations

import os

__all__ = [
    "fd_path",
    "fd_target",
    "library_loaded",
    "memory_layout",
    "open_fds",
    "start_time",
    "thread_ids",
]


def start_time() -> str:
    """This process's start time in clock ticks since boot (with the pid: one process).

    :raises OSError: no procfs.
    """
    with open("/proc/self/stat", "rb") as f:
        raw = f.read()
    # "pid (comm) state ...": comm may hold spaces or ')', so split after the last ')'.
    return raw[raw.rfind(b")") + 2 :].split()[19].decode()


#: the address-space fields of /proc/self/stat, by their number in proc(5)
_LAYOUT = {
    "start_code": 26,
    "end_code": 27,
    "start_stack": 28,
    "start_data": 45,
    "end_data": 46,
    "start_brk": 47,
    "arg_start": 48,
    "arg_end": 49,
    "env_start": 50,
    "env_end": 51,
}


def memory_layout() -> dict[str, int] | None:
    """This process's code, data, stack, argument and environment addresses
    (``start_code``... ``env_end``); ``None`` without procfs or before Linux 3.5."""
    try:
        with open("/proc/self/stat", "rb") as f:
            raw = f.read()
    except OSError:  # pragma: no cover - no procfs
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # fields[0] is field 3 (state)
    if len(fields) < 49:  # pragma: no cover - Linux < 3.5
        return None
    return {name: int(fields[n - 3]) for name, n in _LAYOUT.items()}


def thread_ids() -> set[int] | None:
    """The kernel ids of this process's threads; ``None`` without procfs."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # pragma: no cover - no procfs
        return None


def library_loaded(name: bytes) -> bool:
    """Whether a shared library whose path contains ``name`` is mapped into this
    process (``b"/libcuda.so"``); ``False`` without procfs."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return name in f.read()
    except OSError:  # pragma: no cover - no procfs
        return False


def open_fds() -> list[int]:
    """This process's open file descriptors; without procfs, every number below 256
    (the caller closes what it does not keep: closing a closed fd is harmless)."""
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:  # pragma: no cover - no procfs
        return list(range(256))


def fd_path(fd: int) -> str:
    """A path naming what this process's ``fd`` is open on (a folder's fd: a
    short path into it, for a unix socket whose own path is too long)."""
    return f"/proc/self/fd/{fd}"


def fd_target(fd: int) -> str | None:
    """What this process's ``fd`` points to (``"socket:[123]"``, a path...);
    ``None`` once it is closed, or without procfs."""
    try:
        return os.readlink(fd_path(fd))
    except OSError:
        return None
