"""What ``ctx.status()`` and ``aiolaunch status`` show: one :class:`WorkerStatus` per rank.

Built on demand from the group's state and what the hang forensics see of
each live worker (:class:`RankMarks`: a ``/proc`` reading, the watchdog's
flags); nothing is kept here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._group import GroupState
    from .._hangs._activity import RankActivity

__all__ = ["RankMarks", "WorkerStatus", "worker_statuses"]

_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk-sleep",
    "T": "stopped",
    "t": "stopped",
    "Z": "exited",
    "I": "sleeping",
}


@dataclass(frozen=True)
class WorkerStatus:
    """One worker as :meth:`PContext.status` sees it now.

    :param rank: local rank.
    :param pid: process id of its current incarnation.
    :param state: ``"running"``, ``"sleeping"``, ``"disk-sleep"`` (D state),
        ``"stopped"``, ``"stalled"`` (flagged by the watchdog),
        ``"straggling"`` (named a straggler: its peers wait for it),
        ``"restarting"`` or ``"exited"``.
    :param restarts: how many times this rank was restarted.
    :param last_output_s: seconds since it last wrote anything (``None`` until
        known: the first sample only sets the baseline).
    :param cpu_percent: CPU use since the previous sample, % of one core.
    :param rss: resident memory in bytes.
    :param exitcode: the exit status once ``"exited"``, else ``None``.
    :param cpu_s: CPU seconds its current process used (every thread).
    :param stalls: how many times the watchdog flagged it.
    :param steps: lines matching the watchdog's ``progress`` regex so far
        (``None`` without one).
    :param step_rate: those lines per second over the last minute (``None``
        without a ``progress`` regex).
    :param straggling: flagged as a straggler now.
    :param attached: an ``aiolaunch attach`` session holds it now (its main
        thread waits at the pdb prompt; the watchdog leaves it alone).
    :param lateness_s: its median lateness in arriving at collectives, against
        the earliest rank, over the straggler watch's window (``None``: not
        measured: no ``stragglers=``, or no collective record).
    :param collective: what it does in the collectives' last verdict, or the
        collective it waits in for a working rank (``"missing: all_reduce #5
        of default_pg"``, ``"waits in all_reduce #5 of default_pg"``...);
        ``None`` when nothing is known.
    """

    rank: int
    pid: int
    state: str
    restarts: int
    last_output_s: float | None
    cpu_percent: float
    rss: int
    exitcode: int | None = None
    cpu_s: float = 0.0
    stalls: int = 0
    steps: int | None = None
    step_rate: float | None = None
    straggling: bool = False
    attached: bool = False
    lateness_s: float | None = None
    collective: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        # Every field is a plain value: no deep copy (asdict() was half the
        # cost of a status answer at 64 ranks).
        return {name: getattr(self, name) for name in _FIELDS}


class RankMarks(Protocol):
    """What the hang forensics add to a rank's row
    (:class:`~aiolaunch._hangs._observer.HangObserver`)."""

    def reading(self, rank: int, pid: int, now: float) -> RankActivity | None:
        """``rank``'s ``/proc`` reading now (CPU % over at least the last half
        second); ``None`` once its process is gone."""

    def stalled(self, rank: int) -> bool:
        """Whether the watchdog flags ``rank`` now."""

    def stalls(self, rank: int) -> int:
        """How many times the watchdog flagged ``rank``."""

    def steps(self, rank: int, now: float) -> tuple[int, float] | None:
        """``(progress lines, per second)`` of ``rank``; ``None`` without a regex."""

    def straggling(self, rank: int) -> bool:
        """Whether ``rank`` is flagged as a straggler now."""

    def lateness(self, rank: int) -> float | None:
        """``rank``'s median lateness at collectives (s), where measured."""

    def collective(self, rank: int) -> str | None:
        """What ``rank`` does in the collectives' last verdict, if anything."""


def worker_statuses(state: GroupState, marks: RankMarks) -> list[WorkerStatus]:
    """Every rank of ``state`` now: ``marks`` reads the live ones and adds the
    watchdog's view; the group's state says which are attached."""
    now = time.monotonic()
    out: list[WorkerStatus] = []
    for rank in range(state.nprocs):
        w = state.worker(rank)
        if w is None:
            out.append(WorkerStatus(rank, 0, "starting", 0, None, 0.0, 0))
            continue
        restarts = state.attempts(rank)
        steps = marks.steps(rank, now)
        extra: dict[str, Any] = {
            "stalls": marks.stalls(rank),
            "steps": None if steps is None else steps[0],
            "step_rate": None if steps is None else round(steps[1], 3),
            "lateness_s": marks.lateness(rank),
            "collective": marks.collective(rank),
        }
        if state.restarting(rank):
            out.append(WorkerStatus(rank, w.pid, "restarting", restarts, None, 0.0, 0, **extra))
            continue
        act = marks.reading(rank, w.pid, now) if w.alive else None
        if act is None:
            out.append(
                WorkerStatus(rank, w.pid, "exited", restarts, None, 0.0, 0, w.returncode, **extra)
            )
            continue
        if marks.stalled(rank):
            name = "stalled"
        elif marks.straggling(rank):
            name = "straggling"  # what `aiolaunch status` shows
        else:
            name = _STATES.get(act.state, act.state)
        age = None if act.last_output is None else round(now - act.last_output, 3)
        out.append(
            WorkerStatus(
                rank,
                w.pid,
                name,
                restarts,
                age,
                round(act.cpu_percent, 1),
                act.rss,
                cpu_s=act.cpu_s,
                straggling=marks.straggling(rank),
                attached=state.attached(rank),
                **extra,
            )
        )
    return out


_FIELDS = tuple(f.name for f in fields(WorkerStatus))
