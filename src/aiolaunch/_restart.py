"""Per-worker restart policies for long-running service groups.

:class:`Restarts` (private) is the mechanism of one group: trackers and one
restart of a rank at a time; the group's state keeps which ranks restart.

This is not the agent's whole-group restart (``max_restarts`` in
``aiolaunch.agent``, for training): here a single worker that exits is started
again on its own, while the rest of the group keeps running.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ._cancel import shielded
from ._events import WorkerRestarting
from ._observer import GroupObserver

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from ._events import EventBus
    from ._group import GroupState
    from ._workers._handle import WorkerHandle

__all__ = ["RankStarter", "RestartPolicy", "RestartTracker", "Restarts"]

_MODES = ("never", "on-failure", "always")


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a worker is started again.

    :param mode: ``"never"`` (the default: the group fails fast, as torch),
        ``"on-failure"`` (restart after a non-zero exit or a signal), or
        ``"always"`` (also after exit code 0: a service that must keep running).
    :param max_restarts: the restart budget: at most this many restarts of one
        worker within ``window`` seconds; one more exit then fails the group -
        in mode ``"always"`` an exit with code 0 too (a failure whose message
        says the budget is spent).
    :param window: seconds of the budget's sliding window.
    :param backoff: delay before the first restart; doubles with each restart
        in the window, up to ``max_backoff``.
    :param max_backoff: the cap of the delay.
    :param jitter: the delay is multiplied by a random factor in
        ``[1 - jitter, 1 + jitter]`` so a group does not restart in lockstep.

    The worker sees its restart count in ``AIOLAUNCH_RESTART_COUNT``.
    """

    mode: str = "never"
    max_restarts: int = 5
    window: float = 60.0
    backoff: float = 0.1
    max_backoff: float = 30.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(
                f"RestartPolicy(mode={self.mode!r}) must be one of {', '.join(_MODES)}"
            )
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise TypeError(
                f"RestartPolicy(max_restarts={self.max_restarts!r}) must be an int >= 0, "
                "e.g. max_restarts=3"
            )
        for what in ("window", "backoff", "max_backoff", "jitter"):
            value = getattr(self, what)
            # NaN passes no comparison below, so refuse it with the wrong types.
            if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
                raise TypeError(
                    f"RestartPolicy({what}={value!r}) must be a number of seconds "
                    f"(a fraction for jitter), e.g. {what}={getattr(RestartPolicy, what)!r}"
                )
        if self.max_restarts < 0 or self.window <= 0:
            raise ValueError("RestartPolicy needs max_restarts >= 0 and window > 0")
        if self.backoff < 0 or self.max_backoff < self.backoff or not 0 <= self.jitter < 1:
            raise ValueError("RestartPolicy needs 0 <= backoff <= max_backoff and 0 <= jitter < 1")

    def wants_restart(self, exitcode: int) -> bool:
        """Whether an exit with ``exitcode`` calls for a restart (budget aside)."""
        return self.mode == "always" or (self.mode == "on-failure" and exitcode != 0)


@dataclass
class RestartTracker:
    """The restart budget of one worker: the restarts within its window.

    How many times the rank was restarted is the group's state
    (:meth:`GroupState.attempts`), not kept here.
    """

    policy: RestartPolicy
    recent: deque[float] = field(default_factory=deque)
    #: the last exit wanted a restart but the budget was spent
    spent: bool = False

    def next_delay(self, exitcode: int, now: float) -> float | None:
        """The delay before the next start, or ``None``: do not restart."""
        self.spent = False
        if not self.policy.wants_restart(exitcode):
            return None
        while self.recent and now - self.recent[0] > self.policy.window:
            self.recent.popleft()
        if len(self.recent) >= self.policy.max_restarts:
            self.spent = True
            return None
        delay: float = min(self.policy.max_backoff, self.policy.backoff * 2.0 ** len(self.recent))
        if self.policy.jitter:
            delay *= random.uniform(1 - self.policy.jitter, 1 + self.policy.jitter)
        self.recent.append(now)
        return delay


class RankStarter(Protocol):
    """How a restart reaches its group: the two steps between one incarnation
    of a rank and the next (the context's :class:`~aiolaunch._launch.RankLauncher`)."""

    async def drain(self, rank: int) -> None:
        """Finish the old incarnation's streams: its bytes precede the new one's."""

    async def start(self, rank: int) -> None:
        """Spawn and wire up ``rank``'s next incarnation."""


class Restarts(GroupObserver):
    """The per-worker restarts of one group.

    Holds each rank's :class:`RestartTracker` and one lock per rank, so that
    restarts of a rank run one at a time, in the order the exits happened.
    What the group must know - which ranks are restarting, how often each was
    restarted, which exited for good - it tells the group's state
    (:class:`~aiolaunch._group.GroupState`); a restart starts the rank again
    through the :class:`RankStarter` that reported the exit.

    :param state: the group.
    :param bus: where :class:`WorkerRestarting` events go.
    """

    def __init__(
        self,
        policies: Mapping[int, RestartPolicy],
        state: GroupState,
        *,
        bus: EventBus,
    ) -> None:
        self._trackers = {r: RestartTracker(p) for r, p in policies.items()}
        self._state = state
        self._locks: dict[int, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._bus = bus

    def has_policy(self, rank: int) -> bool:
        """Whether ``rank`` has a restart policy."""
        return rank in self._trackers

    def env(self, rank: int) -> dict[str, str]:
        """What a restartable rank's environment gets: its restart count."""
        if rank not in self._trackers:
            return {}
        return {"AIOLAUNCH_RESTART_COUNT": str(self._state.attempts(rank))}

    def after_exit(self, handle: WorkerHandle, starter: RankStarter) -> bool:
        """An incarnation exited: restart it through ``starter`` if it exited
        on its own (not stopped by the supervisor), the group is not ending,
        its policy wants a restart and the budget allows it.

        :returns: whether a restart follows (:meth:`respawn`, in a task, after
            the rank's earlier restarts; the rank is restarting meanwhile). If
            not, a spent budget fails ``handle`` even for exit code 0:
            ``"always"`` promises a service that keeps running, so an exit it
            cannot restart any more fails the group.
        """
        rank = handle.local_rank
        tracker = self._trackers.get(rank)
        if tracker is None or handle.stopped_by_us or self._state.ending:
            return False
        failed = handle.returncode != 0 or handle.failure_reason is not None
        delay = tracker.next_delay(1 if failed else 0, time.monotonic())
        if delay is None:
            spent = self.budget_spent(rank)
            if spent is not None and not failed:
                handle.fail(spent)
            return False
        attempt = self._state.restart_planned(rank)
        self._bus.emit(
            WorkerRestarting(rank=rank, time=time.monotonic(), attempt=attempt, delay=delay)
        )
        # A new incarnation that exits while it is still being wired up
        # queues its own restart behind this one.
        task = asyncio.ensure_future(self._run(rank, lambda: self.respawn(handle, delay, starter)))
        self._tasks.add(task)
        # A done callback, not a ``finally``: it runs even for a task cancelled
        # before its first step (aclose() at once after an exit).
        task.add_done_callback(lambda t: self._finished(t, rank))
        return True

    def _finished(self, task: asyncio.Task[None], rank: int) -> None:
        self._tasks.discard(task)
        self._state.restart_finished(rank)

    async def respawn(self, old: WorkerHandle, delay: float, starter: RankStarter) -> None:
        """Start the next incarnation of ``old``'s rank after ``delay`` seconds.

        First the old incarnation's pipes are drained and it is released;
        nothing starts once the group is ending. A start that fails marks
        ``old`` failed (``"restart failed"``), the rank gone, and raises.
        """
        rank = old.local_rank
        # Shielded: a cancelled drain would lose bytes and fds.
        await shielded(starter.drain(rank))
        old.release()
        await asyncio.sleep(delay)  # allowed: the policy's backoff
        if self._state.ending:
            return
        self._state.next_attempt(rank)
        try:
            # Shielded: once a process is spawned its pipes must be wired.
            await shielded(starter.start(rank))
        except Exception:
            old.fail("restart failed")
            self._state.gone(rank)
            raise

    def budget_spent(self, rank: int) -> str | None:
        """Why ``rank``'s last exit ends it although its policy wanted a
        restart (the budget is spent), for the failure message; else ``None``."""
        tracker = self._trackers.get(rank)
        if tracker is None or not tracker.spent:
            return None
        p = tracker.policy
        return (
            f"local rank {rank} exited with its restart budget spent: "
            f"RestartPolicy({p.mode!r}) allows {p.max_restarts} restart(s) within "
            f"{p.window:g}s"
        )

    async def _run(self, rank: int, restart: Callable[[], Awaitable[None]]) -> None:
        async with self._locks.setdefault(rank, asyncio.Lock()):
            await restart()

    async def aclose(self) -> None:
        """Cancel every restart in progress; nothing is restarting afterwards."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
