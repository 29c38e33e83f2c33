"""The one owner of a group's state: its workers, their exits, restarts and forced failures.

Everything that observes or steers a running group - ``wait()``,
``wait_ready()``, the restart policies, the watchdog, the control socket, the
result - reads the group through :class:`GroupState` and changes it only
through its commands. Nothing else keeps a copy of "who exited" or "who is
restarting", and nobody shares a mutable container.

The wake-up rule lives here too (:class:`Wakeup`): every change notifies;
waiters never clear anything.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from ._workers._handle import WorkerHandle

__all__ = ["ForcedFailure", "GroupState", "Wakeup"]


class Wakeup:
    """Change notification with a version number instead of a shared ``clear()``.

    The rule, for every waiter: read :attr:`version` *before* checking the
    state, then ``await changed(seen)`` with that number. It returns at once
    when anything changed since the read - also a change that happened while
    the checker itself awaited - and otherwise on the next :meth:`notify`.
    Nobody clears anything, so two waiters (``wait()`` and ``wait_ready()``,
    say) can never consume each other's wake-up, and no invariant depends on
    the absence of an ``await`` between a clear and a re-check.
    """

    def __init__(self) -> None:
        self._version = 0
        self._event = asyncio.Event()

    @property
    def version(self) -> int:
        """A number that grows with every :meth:`notify`."""
        return self._version

    def notify(self) -> None:
        """Something changed: wake every waiter (on the loop thread)."""
        self._version += 1
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def changed(self, seen: int) -> None:
        """Return once :attr:`version` differs from ``seen`` (at once if it does)."""
        if self._version == seen:
            await self._event.wait()


@dataclass(frozen=True)
class ForcedFailure:
    """A rank the supervisor declared failed while it was still running (a stall).

    :param message: the failure's message (``ProcessFailure.message``).
    :param time: ``time.time()`` of the decision: the failure's timestamp,
        so that the root-cause rule (earliest first) sees it when it happened.
    """

    message: str
    time: float


class GroupState:
    """The state of one group of ``nprocs`` workers, and the only place it changes.

    Holds each rank's current incarnation (:meth:`worker`), the order in which
    ranks exited for good (:attr:`exit_order`), the ranks with a restart
    pending (:meth:`restarting`), each rank's restart count
    (:meth:`attempts`), and the failures the supervisor forced on live ranks
    (:meth:`fail`). Every command calls :meth:`Wakeup.notify` on
    :attr:`wakeup`. All methods run on the loop thread.
    """

    def __init__(self, name: str, nprocs: int, *, restarts: int = 0) -> None:
        self.name = name
        self.nprocs = nprocs
        #: how many times the job restarted before this group (its agent's attempt):
        #: every rank's count starts there
        self.job_restarts = restarts
        #: notified on every change (see :class:`Wakeup` for the waiting rule)
        self.wakeup = Wakeup()
        self._workers: dict[int, WorkerHandle] = {}
        self._exit_order: list[int] = []
        self._restarting: dict[int, int] = {}  # rank -> restarts planned, not finished
        self._attempts = dict.fromkeys(range(nprocs), restarts)  # restarts started, per rank
        self._planned = dict.fromkeys(range(nprocs), restarts)  # restarts planned, per rank
        self._forced: dict[int, ForcedFailure] = {}
        self._attached: set[int] = set()
        self._ending = False

    # -- queries -------------------------------------------------------------
    def worker(self, rank: int) -> WorkerHandle | None:
        """The current incarnation of ``rank``, or ``None`` before its first start."""
        return self._workers.get(rank)

    def workers(self) -> list[WorkerHandle]:
        """The current incarnation of every started rank, by rank."""
        return [self._workers[r] for r in sorted(self._workers)]

    def __iter__(self) -> Iterator[WorkerHandle]:
        return iter(self.workers())

    def pids(self) -> dict[int, int]:
        """``{rank: pid}`` of every started rank's current incarnation."""
        return {rank: w.pid for rank, w in sorted(self._workers.items())}

    @property
    def exit_order(self) -> tuple[int, ...]:
        """The ranks that exited for good (no restart follows), in order."""
        return tuple(self._exit_order)

    def restarting(self, rank: int) -> bool:
        """Whether a restart of ``rank`` is planned or under way."""
        return rank in self._restarting

    def any_restarting(self) -> bool:
        """Whether any rank has a restart planned or under way."""
        return bool(self._restarting)

    def attempts(self, rank: int) -> int:
        """How many times ``rank`` was restarted (its current incarnation's number),
        the job's restarts before this group included (:attr:`job_restarts`)."""
        return self._attempts[rank]

    def attached(self, rank: int) -> bool:
        """Whether an ``aiolaunch attach`` session holds ``rank`` now (its main
        thread waits at a pdb prompt: the watchdog leaves it alone)."""
        return rank in self._attached

    @property
    def ending(self) -> bool:
        """Whether the group's end has begun: nothing new starts, waiters give up."""
        return self._ending

    @property
    def forced(self) -> Mapping[int, ForcedFailure]:
        """The failures forced on live ranks (:meth:`fail`), in the order decided."""
        return dict(self._forced)

    def failed_ranks(self) -> list[int]:
        """The failed ranks: forced ones first (in the order decided), then those
        whose last incarnation failed on its own, in exit order.

        A rank stopped by the supervisor, still alive, or restarting (a new
        incarnation follows) has not failed on its own; any other one in the
        exit order has if it exited non-zero or has a ``failure_reason``
        (e.g. a spent restart budget).
        """
        failed = list(self._forced)
        for rank in self._exit_order:
            w = self._workers[rank]
            if rank in self._forced or w.stopped_by_us or rank in self._restarting or w.alive:
                continue
            if w.returncode != 0 or w.failure_reason is not None:
                failed.append(rank)
        return failed

    def decided(self) -> bool:
        """Whether the outcome is known: a rank failed (:meth:`failed_ranks`), or
        every rank started, none is restarting, and every one exited."""
        if self.failed_ranks():
            return True
        return (
            len(self._workers) == self.nprocs
            and not self._restarting
            and all(not w.alive for w in self._workers.values())
        )

    # -- commands ------------------------------------------------------------
    def started(self, handle: WorkerHandle) -> None:
        """A new incarnation of ``handle.local_rank`` runs."""
        handle.attempt = self._attempts[handle.local_rank]
        self._workers[handle.local_rank] = handle
        self.wakeup.notify()

    def gone(self, rank: int) -> None:
        """``rank``'s last incarnation exited and no restart follows."""
        self._exit_order.append(rank)
        self.wakeup.notify()

    def restart_planned(self, rank: int) -> int:
        """A restart of ``rank`` was planned: it counts as neither exited nor
        ready. Returns the plan's number (1 for the rank's first restart; a
        plan the group's end cancels keeps its number)."""
        self._restarting[rank] = self._restarting.get(rank, 0) + 1
        self._planned[rank] += 1
        self.wakeup.notify()
        return self._planned[rank]

    def next_attempt(self, rank: int) -> int:
        """A planned restart of ``rank`` starts its next incarnation now: its number."""
        self._attempts[rank] += 1
        return self._attempts[rank]

    def restart_finished(self, rank: int) -> None:
        """A planned restart of ``rank`` finished (started, failed or cancelled)."""
        left = self._restarting.get(rank, 0) - 1
        if left > 0:
            self._restarting[rank] = left
        else:
            self._restarting.pop(rank, None)
        self.wakeup.notify()

    def attach_begun(self, rank: int) -> None:
        """An ``aiolaunch attach`` session opens on ``rank``. No waiter depends
        on it: nothing is notified."""
        self._attached.add(rank)

    def attach_ended(self, rank: int) -> None:
        """The attach session on ``rank`` ended."""
        self._attached.discard(rank)

    def end_begun(self) -> None:
        """The group's end has begun (``GroupEnding.begin``)."""
        self._ending = True
        self.wakeup.notify()

    def fail(self, rank: int, message: str, when: float | None = None) -> None:
        """Declare the live ``rank`` failed (the watchdog's verdict): the group
        is decided, and ``rank``'s failure says ``message``. The first call for
        a rank wins."""
        if rank not in self._forced:
            self._forced[rank] = ForcedFailure(message, time.time() if when is None else when)
            self.wakeup.notify()

    def kill(self, rank: int, sig: int, reason: str) -> bool:
        """Signal ``rank``'s current incarnation and its process tree with
        ``sig``, recording ``reason`` as why its exit is a failure (a stalled
        rank handed to its restart policy, say). ``False`` if it is not running."""
        w = self._workers.get(rank)
        if w is None or not w.alive:
            return False
        w.fail(reason)
        w.signal_tree(sig)
        return True

    def __repr__(self) -> str:
        return (
            f"<GroupState {self.name!r} started={len(self._workers)}/{self.nprocs} "
            f"exited={self._exit_order} restarting={sorted(self._restarting)} "
            f"forced={sorted(self._forced)}>"
        )
