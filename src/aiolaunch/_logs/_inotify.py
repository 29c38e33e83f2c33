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

import array
import asyncio
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
import sys
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["IN_MODIFY", "Inotify", "Ticked", "Watches"]

IN_MODIFY = 0x00000002
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
# Events are read at most once per HOLD_S while they keep coming (see
# Inotify._readable); the first after a quiet spell at once. Also the first
# period of the tick that reads streaming files (Watches.repeat).
HOLD_S = 0.001
#: The tick's period after its first (Watches.repeat): while files keep
#: growing, their bytes reach the sinks at most this late (torch's tee: its
#: 0.1 s poll). Each tick is a wakeup of the supervisor beside CPU-bound
#: writers, and wakeups are what it costs them: print() writers tee'd on a
#: small host run faster at 4 ms than at 1 ms (benchmarks/README.md, "tee").
#: Under the 5 ms tail that tee lines are held to; quiet files are read on
#: their inotify event at once.
STREAM_TICK_S = 0.004

# The kernel's default queue (fs.inotify.max_queued_events = 16384) in one read.
_READ_SIZE = 16384 * _EVENT.size

_libc: ctypes.CDLL | None = None


def _parse(buf: bytes) -> tuple[set[int], bool]:
    """The watch ids in ``buf`` (events) and whether the queue overflowed.

    A watch on a file gives events without a name, 16 bytes each: read as an
    int array, not event by event in Python (16 workers writing at once queue
    events that do not merge: 69542 of them, 0.33 s, event by event).
    """
    ints = array.array("i")
    ints.frombytes(buf[: len(buf) - len(buf) % _EVENT.size])
    if len(ints) * 4 == len(buf) and not any(ints[3::4]):
        wds = set(ints[0::4])
        masks = ints[1::4]
    else:  # an event with a name (not from our watches): walk them
        wds, masks = set(), array.array("i")
        pos = 0
        while pos + _EVENT.size <= len(buf):
            wd, mask, _, length = _EVENT.unpack_from(buf, pos)
            pos += _EVENT.size + length
            wds.add(wd)
            masks.append(mask)
    overflow = -1 in wds and any(m & _IN_Q_OVERFLOW for m in masks)
    wds.discard(-1)
    return wds, overflow


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

    Latency: a modification after a quiet spell (no wakeup in the last
    :data:`HOLD_S`) is reported at once; while files keep growing, at most
    one wakeup per :data:`HOLD_S` (so no later than that).
    """

    def __init__(self, fd: int, libc: ctypes.CDLL, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = fd
        self._libc = libc
        self._loop = loop
        self._watches: dict[int, list[Callable[[], None]]] = {}
        self._last = -1.0
        #: the re-arm while held (the fd is off the loop meanwhile)
        self._held: asyncio.TimerHandle | None = None
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
        now = self._loop.time()
        if now - self._last < HOLD_S:
            # Events come faster than one per HOLD_S (many files growing at
            # once; a file that streams loses its watch after a few events,
            # _follow): off the loop until then, the events wait in the
            # kernel's queue and each wakeup takes many.
            self._loop.remove_reader(self._fd)
            self._held = self._loop.call_at(now + HOLD_S, self._rearm)
        self._last = now
        try:
            # One read per wakeup, not until empty: writers that keep writing
            # would keep us here (the loop is level-triggered: what is left
            # wakes us on its next iteration).
            buf = os.read(self._fd, _READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # pragma: no cover - EBADF after close
            if exc.errno == errno.EBADF:
                return
            raise
        wds, overflow = _parse(buf)
        targets = list(self._watches) if overflow else wds
        for wd in targets:
            for callback in list(self._watches.get(wd, ())):
                callback()

    def _rearm(self) -> None:
        self._held = None
        if self._fd >= 0:
            self._loop.add_reader(self._fd, self._readable)

    def close(self) -> None:
        """Remove every watch and close the instance. Idempotent."""
        if self._fd < 0:
            return
        if self._held is not None:
            self._held.cancel()
            self._held = None
        self._loop.remove_reader(self._fd)
        # Closing an inotify instance waits for an RCU grace period in the
        # kernel (~15 ms measured under load): never on the loop. The close
        # removes the watches with it.
        from ._file import file_executor

        file_executor().submit(os.close, self._fd)
        self._fd = -1
        self._watches.clear()


class Ticked(Protocol):
    """A file the group's tick reads while it streams (``_growth.Growth``)."""

    def measure(self) -> int:
        """A tick's first pass: the bytes the file grew since the tick before."""
        ...

    def tick(self, others: float) -> bool:
        """The second pass: ``others`` is what the group's other files grew
        by in this tick's period, in bytes per second. ``False``: no more
        ticks."""
        ...


class Watches:
    """The inotify watches of one group: the instance is made at the first
    watch, so a group whose files nobody follows has none (no fd, no kernel
    object, no wakeup)."""

    def __init__(self) -> None:
        self._inotify: Inotify | None = None
        #: the instance could not be made (the per-user limit): never retried
        self._failed = False
        self._warned = False
        #: ticked every STREAM_TICK_S while they return True (:meth:`repeat`)
        self._ticking: list[Ticked] = []
        self._tick: asyncio.TimerHandle | None = None
        #: the loop time of the tick before (or of the tick's start)
        self._ticked_at = 0.0

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

    def repeat(self, ticked: Ticked) -> None:
        """Tick ``ticked`` every :data:`STREAM_TICK_S` until its ``tick()`` returns ``False``.

        For a file that keeps growing, with its watch off (``_follow``): one
        timer for the whole group, so N streaming files cost one wakeup per
        period, not N. Nothing ticks once every callback returned ``False``.
        A tick that is not running starts :data:`HOLD_S` from now: a worker's
        first lines (its file begins streaming) and a burst that just turned
        a watched file into a streaming one are read as soon as before.
        Each tick measures every file first, then ticks each with what the
        others grew by (:class:`Ticked`).
        """
        self._ticking.append(ticked)
        if self._tick is None:
            loop = asyncio.get_running_loop()
            self._ticked_at = loop.time()
            self._tick = loop.call_later(HOLD_S, self._on_tick)

    def _on_tick(self) -> None:
        ticking, self._ticking = self._ticking, []
        now = asyncio.get_running_loop().time()
        seconds, self._ticked_at = now - self._ticked_at, now
        grown = [t.measure() for t in ticking]
        total = sum(grown)
        keep = [
            t
            for t, g in zip(ticking, grown, strict=True)
            if t.tick((total - g) / seconds if seconds > 0.0 else 0.0)
        ]
        # A callback may call repeat() again (the list is new by then).
        self._ticking[:0] = keep
        self._tick = None
        if self._ticking:
            self._tick = asyncio.get_running_loop().call_later(STREAM_TICK_S, self._on_tick)

    def close(self) -> None:
        """Close the instance, if any, and stop ticking. Idempotent."""
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        self._ticking.clear()
        if self._inotify is not None:
            self._inotify.close()
