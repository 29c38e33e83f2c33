"""Linux inotify through ctypes: the kernel tells us when a log file grew.

Used by the direct-write path (``_follow``): the worker writes its log file
itself, and the supervisor learns of new bytes from ``IN_MODIFY`` events on
the loop (``add_reader`` on the inotify fd) - no polling, no copy through the
supervisor unless someone reads the stream (tee, a probe, ``LogLine``).

A file is watched only while someone needs its bytes (``_follow``): a
redirect-only group has no watch at all, so a worker's ``write()`` wakes
nothing in the supervisor (measured before: 96 ms of supervisor CPU per
128 MiB written by one worker, an ``IN_MODIFY`` event per write).

One instance per group at most (:class:`Watches`, closed with it), made at
its first watch: an inotify instance is an fd and a per-user kernel object
(``fs.inotify.max_user_instances``, 128 by default); :meth:`Inotify.create`
returns ``None`` where there is none (not Linux, the limit reached), and the
caller falls back to pipes.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["IN_MODIFY", "Inotify", "Watches"]

IN_MODIFY = 0x00000002
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)

_libc: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.inotify_init1.argtypes = [ctypes.c_int]
            libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
            libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
            _libc = libc
        except (OSError, AttributeError):
            return None
    return _libc


class Inotify:
    """One inotify instance read on the running loop.

    :meth:`watch` calls ``callback()`` on the loop after the watched file was
    modified; several modifications between two wakeups give one call (the
    callback reads whatever is new). If the kernel's event queue overflows,
    every callback is called.
    """

    def __init__(self, fd: int, libc: ctypes.CDLL, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = fd
        self._libc = libc
        self._loop = loop
        self._watches: dict[int, list[Callable[[], None]]] = {}
        loop.add_reader(fd, self._readable)

    @classmethod
    def create(cls) -> Inotify | None:
        """A new instance on the running loop, or ``None`` where inotify is unavailable."""
        libc = _load()
        if libc is None:
            return None
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return None
        return cls(fd, libc, asyncio.get_running_loop())

    def watch(self, path: str, callback: Callable[[], None]) -> int:
        """Call ``callback`` whenever ``path`` is modified; returns the watch id.

        Watches are per inode: two paths of one file share a watch id.
        """
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), IN_MODIFY)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_add_watch({path!r}): {os.strerror(err)}")
        self._watches.setdefault(wd, []).append(callback)
        return int(wd)

    def unwatch(self, wd: int, callback: Callable[[], None]) -> None:
        """Stop calling ``callback`` for ``wd`` (the watch goes with its last callback)."""
        callbacks = self._watches.get(wd)
        if callbacks is None or callback not in callbacks:
            return
        callbacks.remove(callback)
        if not callbacks:
            del self._watches[wd]
            if self._fd >= 0:
                self._libc.inotify_rm_watch(self._fd, wd)  # fails harmlessly if gone

    def _readable(self) -> None:
        wds: set[int] = set()
        overflow = False
        while True:
            try:
                buf = os.read(self._fd, 64 * 1024)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # pragma: no cover - EBADF after close
                if exc.errno == errno.EBADF:
                    return
                raise
            pos = 0
            while pos + _EVENT.size <= len(buf):
                wd, mask, _, length = _EVENT.unpack_from(buf, pos)
                pos += _EVENT.size + length
                if mask & _IN_Q_OVERFLOW:
                    overflow = True
                elif not mask & _IN_IGNORED:
                    wds.add(wd)
            if len(buf) < 32 * 1024:
                break  # drained (a full buffer may have more behind it)
        targets = list(self._watches) if overflow else wds
        for wd in targets:
            for callback in list(self._watches.get(wd, ())):
                callback()

    def close(self) -> None:
        """Remove every watch and close the instance. Idempotent."""
        if self._fd < 0:
            return
        self._loop.remove_reader(self._fd)
        # Closing an inotify instance waits for an RCU grace period in the
        # kernel (~15 ms measured under load): never on the loop. The close
        # removes the watches with it.
        from ._file import file_executor

        file_executor().submit(os.close, self._fd)
        self._fd = -1
        self._watches.clear()


class Watches:
    """The inotify watches of one group: the instance is made at the first
    watch, so a group whose files nobody follows has none (no fd, no kernel
    object, no wakeup)."""

    def __init__(self) -> None:
        self._inotify: Inotify | None = None
        #: the instance could not be made (the per-user limit): never retried
        self._failed = False
        self._warned = False

    def available(self) -> bool:
        """Whether watches can be expected to work (Linux, inotify loadable)."""
        return not self._failed and _load() is not None

    def ensure(self) -> bool:
        """Make the instance now; ``False`` where it cannot be made."""
        if self._inotify is None and not self._failed:
            self._inotify = Inotify.create()
            self._failed = self._inotify is None
        return self._inotify is not None

    def watch(self, path: str, callback: Callable[[], None]) -> int | None:
        """:meth:`Inotify.watch`; ``None`` where there is no instance."""
        if not self.ensure():
            if not self._warned:
                self._warned = True
                logging.getLogger("aiolaunch").warning(
                    "aiolaunch: no inotify instance (fs.inotify.max_user_instances reached?): "
                    "new lines of redirected log files are not read for events(lines=True)"
                )
            return None
        assert self._inotify is not None
        return self._inotify.watch(path, callback)

    def unwatch(self, wd: int, callback: Callable[[], None]) -> None:
        """:meth:`Inotify.unwatch`."""
        if self._inotify is not None:
            self._inotify.unwatch(wd, callback)

    def close(self) -> None:
        """Close the instance, if any. Idempotent."""
        if self._inotify is not None:
            self._inotify.close()
