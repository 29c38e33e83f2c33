"""Stopping processes: death signal -> grace -> SIGKILL -> gone.

Every way a group ends (``close()``, fail-fast in ``wait()``, a forwarded
signal, cancellation, leaving ``async with``) stops its workers through
:func:`terminate` (``_ending.GroupEnding`` calls it, shielded from
cancellation), so no path leaves an orphan behind; :func:`sweep_tagged`
finds escaped descendants afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from typing import TYPE_CHECKING

from ._cancel import move_on_after
from ._workers._proc import proc_pids, read_stat
from ._workers._processes import ProcTable, find_tagged, open_exit_fd

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ._workers._handle import WorkerHandle

__all__ = ["Escalation", "sweep_tagged", "terminate"]

logger = logging.getLogger("aiolaunch")

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Bound for processes to vanish after SIGKILL (a process in uninterruptible
# sleep can take a moment; we never wait forever).
_KILL_WAIT = 10.0
# Scan-and-SIGKILL rounds at most (a fork tree may grow while it is killed).
_KILL_ROUNDS = 5
# Processes whose environment one slice of a token scan reads before the loop
# gets a turn.
_SCAN_SLICE = 64


class Escalation:
    """A flag that, once set, ends every grace period at once (a second
    signal, a second cancellation: SIGKILL now). Set once, never cleared.

    Waiting grace periods hook a callback (:meth:`on_set`) instead of a
    waiter task each: the wait needs no task of its own (close() of a small
    group spent ~0.1 ms of its ~1.5 starting and unwinding two).
    """

    __slots__ = ("_callbacks", "_set")

    def __init__(self) -> None:
        self._set = False
        self._callbacks: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._set

    def set(self) -> None:
        """Set the flag and call the hooked callbacks (on the loop). Idempotent."""
        if not self._set:
            self._set = True
            callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` when the flag is set; returns the call that unhooks it."""
        self._callbacks.append(callback)

        def unhook() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return unhook


async def _wait_exited(workers: Sequence[WorkerHandle], timeout: float) -> None:
    if not workers:
        return
    async with move_on_after(timeout):
        for w in workers:
            if not w.exited.is_set():
                await w.exited.wait()


async def _wait_pids_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until processes that are not our children exit; return survivors."""
    if not pids:
        return set()
    loop = asyncio.get_running_loop()
    fds: dict[int, int] = {}
    survivors: set[int] = set()
    for pid in pids:
        fd = open_exit_fd(pid)
        if fd is None:
            try:
                os.kill(pid, 0)
                survivors.add(pid)  # no pidfd here: cannot wait, report as alive
            except OSError:
                pass
        else:
            fds[pid] = fd
    if not fds:
        return survivors
    remaining = set(fds)
    done = asyncio.Event()

    def on_gone(pid: int) -> None:
        loop.remove_reader(fds[pid])
        remaining.discard(pid)
        if not remaining:
            done.set()

    for pid, fd in fds.items():
        loop.add_reader(fd, on_gone, pid)
    try:
        async with move_on_after(timeout):
            await done.wait()
    finally:
        for pid, fd in fds.items():
            if pid in remaining:
                loop.remove_reader(fd)
            os.close(fd)
    return survivors | remaining


async def terminate(
    workers: Sequence[WorkerHandle],
    death_sig: int = signal.SIGTERM,
    grace: float = 30.0,
    *,
    on_sent: Callable[[], None] | None = None,
    escalate: Escalation | None = None,
    token: str | None = None,
) -> None:
    """Stop every worker and all of its descendants; return when they are gone.

    1. Send ``death_sig`` to each live worker's process group and to every
       descendant found in ``/proc`` (also those in other groups or sessions);
       exited workers' leftover group members get it too, and so does every
       process carrying the context's ``token`` in its environment
       (``CONTEXT_ENV``: double-forked daemons, re-parented away in a session
       of their own). Then ``on_sent()`` is called.
    2. Wait up to ``grace`` seconds for the exits (events, not polling) - or
       until ``escalate`` is set (a second signal, a second cancellation),
       which ends the grace period at once.
    3. SIGKILL whatever is left - logging a warning naming rank and pid when
       the grace period ran out - and wait for it to vanish.

    Workers signalled here are marked ``stopped_by_us``: their exits are not
    failures - except those that were already failing on their own when
    signalled: their error file (``error_file``) written since they started
    (the bootstraps record an exception before the traceback and the
    teardown). Signalled too, their exits stay failures of their own. Never
    raises for processes that are already gone.
    """
    death_sig = signal.Signals(death_sig)
    alive = [w for w in workers if w.alive]
    for w in alive:
        w.stopped_by_us = not _failing_on_its_own(w)
    leftovers = _leftover_candidates(workers)
    since = min((w.pid for w in workers), default=0)
    table = ProcTable(since, [w.pid for w in alive]) if (alive or leftovers) else None
    extras: set[int] = set()
    if token is not None and workers and _may_have_escaped(workers, table):
        tagged = await _tagged(token, since, workers)
        extras |= tagged
        for pid in tagged:
            with contextlib.suppress(OSError):
                os.kill(pid, death_sig)
    for w in workers:
        tree = table.tree(w.pid) if table is not None else set()
        extras |= tree
        if w.alive:
            w.signal_tree(death_sig, tree)
        else:
            for pid in tree:
                with contextlib.suppress(OSError):
                    os.kill(pid, death_sig)
    if on_sent is not None:
        on_sent()
    escalated = False
    # Nothing signalled (every worker exited by itself, nothing left in its
    # group or tree): no grace period to wait out.
    if death_sig != signal.SIGKILL and (alive or extras):

        async def gone() -> None:
            await _wait_exited(alive, math.inf)
            if extras:
                await _wait_pids_gone(_alive_pids(extras), math.inf)

        escalated = await _grace_period(gone, grace, escalate)
    survivors = [w for w in alive if w.alive]
    for w in survivors:
        if death_sig != signal.SIGKILL and not escalated:
            logger.warning(
                "aiolaunch: local rank %d (pid %d) still running %.1fs after %s; sending SIGKILL",
                w.local_rank,
                w.pid,
                grace,
                death_sig.name,
            )
    if survivors or extras:
        # Descendants may have been born during the grace period, and a
        # process may fork between a scan and its SIGKILL: scan, kill, wait
        # for them to be gone, until a scan finds nothing new (converges: the
        # dead cannot fork).
        killed: set[int] = set()
        for _ in range(_KILL_ROUNDS):
            table = ProcTable(since)
            if token is not None:
                extras |= await _tagged(token, since, workers)
            found: set[int] = set()
            for w in workers:
                tree = table.tree(w.pid) | (extras & _alive_pids(extras))
                if w.alive:
                    w.signal_tree(signal.SIGKILL, tree)
                else:
                    for pid in tree - killed:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                found |= tree
            extras |= found
            if not (found - killed):
                break
            killed |= found
            # A fork in flight completes before its parent dies: once the
            # killed are gone, the next scan sees every child they made.
            await _wait_pids_gone(_alive_pids(found), _KILL_WAIT)
        await _wait_exited(survivors, _KILL_WAIT)
        still = await _wait_pids_gone(_alive_pids(extras), _KILL_WAIT)
        if still:  # pragma: no cover - D-state processes
            logger.warning("aiolaunch: processes %s did not exit after SIGKILL", sorted(still))


async def _tagged(token: str, since: int, workers: Sequence[WorkerHandle]) -> set[int]:
    return await _scan_tagged(token, since, [w.pid for w in workers])


async def sweep_tagged(
    token: str,
    since: int,
    exclude: Sequence[int],
    death_sig: int = signal.SIGTERM,
    grace: float = 30.0,
    *,
    escalate: Escalation | None = None,
) -> None:
    """Stop every process carrying ``token`` (``CONTEXT_ENV``); return when they are gone.

    The second half of :func:`terminate`, for a group whose workers are all
    gone already (``wait()`` decided): the escaped descendants (double-forked
    daemons, re-parented away, in a session of their own) get ``death_sig``,
    up to ``grace`` seconds to exit (cut short once ``escalate`` is set),
    then SIGKILL, re-scanned until a scan finds nothing new. ``exclude``:
    pids never signalled (the workers). When nothing carries the token this
    is one ``/proc`` scan, on the loop. Never raises for processes that are
    already gone. Cancelled during the grace period, it SIGKILLs them and
    waits (up to 10 s) until they are gone before it raises.
    """
    tagged = await _scan_tagged(token, since, exclude)
    if not tagged:
        return
    death_sig = signal.Signals(death_sig)
    for pid in tagged:
        with contextlib.suppress(OSError):
            os.kill(pid, death_sig)
    if death_sig != signal.SIGKILL:
        try:
            await _grace_period(
                lambda: _wait_pids_gone(_alive_pids(tagged), math.inf), grace, escalate
            )
        except asyncio.CancelledError:
            # Cancelled in the grace period (asyncio.run ending without close()):
            # SIGKILL what still carries the token (a fresh read: a pid seen
            # earlier may be recycled) and wait, bounded, for all that was
            # signalled. A process already exiting shows no environment, so the
            # caller's re-scan would not see it, and it could outlive the run.
            alive = _alive_pids(tagged)
            for pid in find_tagged(token, exclude=exclude, pids=alive):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            await _wait_pids_gone(alive, _KILL_WAIT)
            raise
    # As in terminate(): a process may fork between a scan and its SIGKILL.
    # Only fresh scans are signalled: a pid seen earlier may be recycled.
    killed: set[int] = set()
    found: set[int] = set()
    for _ in range(_KILL_ROUNDS):
        found = await _scan_tagged(token, since, exclude)
        if not (found - killed):
            break
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        killed |= found
        await _wait_pids_gone(found, _KILL_WAIT)
    still = _alive_pids(found)
    if still:  # pragma: no cover - D-state processes
        logger.warning("aiolaunch: processes %s did not exit after SIGKILL", sorted(still))


async def _grace_period(
    gone: Callable[[], Awaitable[object]], grace: float, escalate: Escalation | None
) -> bool:
    """Await ``gone()`` for up to ``grace`` seconds, cut short once ``escalate``
    is set; ``True`` if it was cut short. In the caller's task."""
    if escalate is not None and escalate.is_set():
        return True
    scope = move_on_after(grace)
    async with scope:
        unhook = escalate.on_set(scope.expire) if escalate is not None else None
        try:
            await gone()
        finally:
            if unhook is not None:
                unhook()
    return scope.cancelled_caught and escalate is not None and escalate.is_set()


async def _scan_tagged(token: str, since: int, exclude: Sequence[int]) -> set[int]:
    """:func:`find_tagged` on the loop, :data:`_SCAN_SLICE` processes at a time.

    One open+read per process from ``since`` on (~20-60 us each on a loaded
    2-core host): a slice holds the loop for a few milliseconds at most. Not
    in a thread: a thread waits for the GIL before each of its small
    syscalls while the loop is busy (the convoy effect: one switch interval,
    5 ms, per syscall beside a CPU-bound asyncio task), which made close()
    of 64 exited workers take seconds.
    """
    pids = proc_pids(since)
    found: set[int] = set()
    for i in range(0, len(pids), _SCAN_SLICE):
        if i:
            await asyncio.sleep(0)  # allowed: one loop turn between slices
        found |= find_tagged(token, exclude=exclude, pids=pids[i : i + _SCAN_SLICE])
    return found


def _may_have_escaped(workers: Sequence[WorkerHandle], table: ProcTable | None) -> bool:
    """Whether a descendant of the workers may live outside their trees, so
    that only the token scan (``/proc/*/environ``) would find it.

    Not when every worker is alive and nothing in its tree ever lost a child
    (:meth:`ProcTable.may_have_escaped`): then the trees and process groups
    reach everything the workers started, and the scan - one read per
    process on the machine born since the first worker - is skipped.
    """
    if table is None or not all(w.alive for w in workers):
        return True
    return any(table.may_have_escaped(w.pid) for w in workers)


def _leftover_candidates(workers: Sequence[WorkerHandle]) -> list[WorkerHandle]:
    # Cheap check first: killpg(pgid, 0) fails with ESRCH when a group is empty.
    found = []
    for w in workers:
        if w.alive:
            continue
        try:
            os.killpg(w.pid, 0)
        except OSError:
            continue
        found.append(w)
    return found


def _alive_pids(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        stat = read_stat(pid)
        if stat is not None and stat.alive:
            alive.add(pid)
    return alive


def _failing_on_its_own(w: WorkerHandle) -> bool:
    """Whether ``w`` wrote its error file since it started: it recorded an
    exception (the bootstraps do before they print the traceback and tear
    down), its exit under way. ``False`` without an error file, or once the
    process is gone (a file of an earlier incarnation is older than it)."""
    path = w.error_file
    if not path or path == os.devnull:
        return False
    try:
        written = os.stat(path).st_mtime
    except OSError:
        return False
    stat = read_stat(w.pid)
    boot = getattr(time, "CLOCK_BOOTTIME", None)
    if stat is None or boot is None:
        return False
    started = time.time() - time.clock_gettime(boot) + stat.starttime / _CLK_TCK
    # The start time comes in clock ticks (10 ms): the margin keeps a file
    # written in the process's first tick.
    return written >= started - 0.02
