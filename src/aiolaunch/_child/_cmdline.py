"""A forked worker's command line and environment, as ``ps`` and ``/proc`` show them.

``/proc/<pid>/cmdline`` and ``/proc/<pid>/environ`` are not the process's
``sys.argv`` or ``os.environ``: the kernel reads them from the memory where
``exec`` laid them out, between addresses it keeps for the process. A forked
worker never exec'd: it showed the zygote's command line (``pgrep -f
train.py`` found nothing) and the zygote's start-up environment, without
``RANK`` and the rest of the worker's variables.

:func:`show` lays the worker's own out in a buffer of its own and points the
kernel at it with ``prctl(PR_SET_MM, PR_SET_MM_MAP)`` - the call CRIU
restores processes with, which needs no privilege (``PR_SET_MM_ARG_START``
and its kind do: ``CAP_SYS_RESOURCE``), only a kernel built with
``CONFIG_CHECKPOINT_RESTORE`` (the distributions' kernels are). Where the call
is refused (another kernel, a seccomp filter), the command line is written
over the zygote's own in place, as ``setproctitle`` does, cut to that room
(about 150 bytes), and the environment stays the zygote's: a real limit,
documented.

Standard library only, like everything in this folder.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

from ._proc import memory_layout

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["show"]

_PR_SET_MM = 35
_PR_SET_MM_MAP = 14
_FIELDS = (
    "start_code",
    "end_code",
    "start_data",
    "end_data",
    "start_brk",
    "brk",
    "start_stack",
    "arg_start",
    "arg_end",
    "env_start",
    "env_end",
)


class _MmMap(ctypes.Structure):
    """``struct prctl_mm_map`` (linux/prctl.h)."""

    _fields_ = [
        *((name, ctypes.c_uint64) for name in _FIELDS),
        ("auxv", ctypes.c_uint64),
        ("auxv_size", ctypes.c_uint32),
        ("exe_fd", ctypes.c_uint32),
    ]


#: the buffer the kernel reads the worker's command line and environment from:
#: it lives as long as the process
_shown: ctypes.Array[ctypes.c_char] | None = None


def show(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Make ``/proc/self/cmdline`` show ``argv`` and ``/proc/self/environ`` ``env``.

    ``True`` if both do; ``False`` if only the command line could be written
    over the zygote's (cut to its room), or nothing could. Never raises.
    """
    args = b"".join(os.fsencode(a) + b"\0" for a in argv)
    environ = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    try:
        layout = memory_layout()
        if layout is None:
            return False
        if _remap(layout, args, environ):
            return True
        _overwrite(layout, args)
    except Exception:  # pragma: no cover - no libc here: /proc shows the zygote's
        pass
    return False


def _remap(layout: dict[str, int], args: bytes, env: bytes) -> bool:
    """Point the kernel's argument and environment ranges at a buffer of ours."""
    global _shown
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    sbrk = libc.sbrk
    sbrk.restype = ctypes.c_void_p
    sbrk.argtypes = [ctypes.c_long]
    buf = ctypes.create_string_buffer(args + env, len(args) + len(env))
    base = ctypes.addressof(buf)
    mm = _MmMap(**{name: layout[name] for name in _FIELDS if name in layout})
    mm.brk = sbrk(0) or layout["start_brk"]  # the break now (not in /proc/self/stat)
    mm.arg_start, mm.arg_end = base, base + len(args)
    mm.env_start, mm.env_end = base + len(args), base + len(args) + len(env)
    mm.auxv, mm.auxv_size, mm.exe_fd = 0, 0, 0xFFFFFFFF  # both left as they are
    if prctl(_PR_SET_MM, _PR_SET_MM_MAP, ctypes.addressof(mm), ctypes.sizeof(mm), 0) != 0:
        return False
    _shown = buf
    return True


def _overwrite(layout: dict[str, int], args: bytes) -> None:
    """Write ``args`` over the zygote's command line in place, cut to its room."""
    start, end = layout["arg_start"], layout["arg_end"]
    room = end - start
    if room > 0:
        text = args[: room - 1]
        ctypes.memmove(start, text + b"\0" * (room - len(text)), room)
