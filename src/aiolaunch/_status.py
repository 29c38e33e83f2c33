"""What ``ctx.status()`` and ``aiolaunch status`` show: one :class:`WorkerStatus` per rank.

Built on demand from the group's state and a ``/proc`` reading of each live
worker (:class:`~aiolaunch._watchdog.Sampler`); nothing is kept here.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._group import GroupState
    from ._watchdog import Sampler

__all__ = ["WorkerStatus", "worker_statuses"]

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
        ``"straggling"`` (named a straggler by the watchdog: its peers wait
        for it), ``"restarting"`` or ``"exited"``.
    :param restarts: how many times this rank was restarted.
    :param last_output_s: seconds since it last wrote anything (``None`` until
        known: the first sample only sets the baseline).
    :param cpu_percent: CPU use since the previous sample, % of one core.
    :param rss: resident memory in bytes.
    :param exitcode: the exit status once ``"exited"``, else ``None``.
    :param straggling: named a straggler by the watchdog now.
    """

    rank: int
    pid: int
    state: str
    restarts: int
    last_output_s: float | None
    cpu_percent: float
    rss: int
    exitcode: int | None = None
    straggling: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return asdict(self)


def worker_statuses(
    state: GroupState,
    sampler: Sampler,
    stalled: Callable[[int], bool],
    straggling: Callable[[int], bool] = lambda rank: False,
) -> list[WorkerStatus]:
    """Every rank of ``state`` now; live ranks are read through ``sampler``
    (CPU % since its previous reading), ``stalled(rank)`` and
    ``straggling(rank)`` mark the watchdog's."""
    now = time.monotonic()
    out: list[WorkerStatus] = []
    for rank in range(state.nprocs):
        w = state.worker(rank)
        if w is None:
            out.append(WorkerStatus(rank, 0, "starting", 0, None, 0.0, 0))
            continue
        restarts = state.attempts(rank)
        if state.restarting(rank):
            out.append(WorkerStatus(rank, w.pid, "restarting", restarts, None, 0.0, 0))
            continue
        act = sampler.reading(rank, w.pid, now) if w.alive else None
        if act is None:
            out.append(WorkerStatus(rank, w.pid, "exited", restarts, None, 0.0, 0, w.returncode))
            continue
        slow = straggling(rank)
        if stalled(rank):
            name = "stalled"
        elif slow:
            name = "straggling"
        else:
            name = _STATES.get(act.state, act.state)
        age = None if act.last_output is None else round(now - act.last_output, 3)
        cpu = round(act.cpu_percent, 1)
        out.append(WorkerStatus(rank, w.pid, name, restarts, age, cpu, act.rss, straggling=slow))
    return out
