"""Sampler: the ``/proc`` readings of a group, one :class:`RankActivity` per live rank.

Shared by ``status()`` (``aiolaunch status``/``top``, ``/metrics``), the
stall watchdog and the output clock of ranks whose streams nobody reads
(:class:`~aiolaunch._live._output_clock.OutputClock`): each rank's process
is read through one :class:`~aiolaunch._hangs._watchdog.RankActivity`, so
what one reader saw (the last write, the CPU window) the others see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._watchdog import RankActivity

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._stall import Sample

__all__ = ["Sampler"]


class Sampler:
    """The ``/proc`` readings of a group: one :class:`RankActivity` per live rank.

    Shared by ``status()`` and the watchdog. ``output_age(rank)``: seconds
    since the log pipeline last saw output of ``rank`` (``None``: unknown),
    merged into :attr:`RankActivity.last_output`.
    """

    def __init__(
        self, output_age: Callable[[int], float | None], *, suspect_after: float = 2.0
    ) -> None:
        self._output_age = output_age
        self._ranks: dict[int, RankActivity] = {}
        #: see :class:`RankActivity` (the watchdog sets a third of ``stall_after``)
        self.suspect_after = suspect_after

    def _activity(self, rank: int, pid: int, now: float) -> RankActivity:
        act = self._ranks.get(rank)
        if act is None or act.pid != pid:  # first sight, or a restarted rank
            if act is not None:
                act.close()
            act = self._ranks[rank] = RankActivity(pid, now, suspect_after=self.suspect_after)
        age = self._output_age(rank)
        if age is not None:
            act.seen(now - age)
        return act

    def sample(self, rank: int, pid: int, now: float, *, writes: bool = True) -> Sample | None:
        """Read ``rank``'s process ``pid`` now; ``None`` when it is gone."""
        return self._activity(rank, pid, now).read(now, writes=writes)

    def writes(self, rank: int, pid: int, now: float) -> float | None:
        """Read only whether ``rank``'s process ``pid`` wrote since the last
        reading (``wchar``); its :attr:`RankActivity.last_output` (monotonic),
        ``None`` while unknown."""
        act = self._ranks.get(rank)
        if act is None or act.pid != pid:
            act = self._activity(rank, pid, now)
        return act.read_writes(now)

    def reading(self, rank: int, pid: int, now: float) -> RankActivity | None:
        """Read ``rank``'s process now; its activity (CPU %, RSS, state,
        last output), or ``None`` when it is gone."""
        act = self._activity(rank, pid, now)
        return act if act.read(now) is not None else None

    def rebase(self, pids: Mapping[int, int]) -> None:
        """Forget the writes of these ``{rank: pid}`` since their last reading."""
        for rank, pid in pids.items():
            act = self._ranks.get(rank)
            if act is not None and act.pid == pid:
                act.rebase()

    def discount(self, pid: int, rank: int, nbytes: int) -> None:
        """``rank``'s process ``pid`` wrote ``nbytes`` of a stack sample: not output."""
        act = self._ranks.get(rank)
        if act is not None and act.pid == pid:
            act.discount(nbytes)

    def forget(self, rank: int) -> None:
        """``rank``'s process is gone: close what is held for it."""
        act = self._ranks.pop(rank, None)
        if act is not None:
            act.close()

    def close(self) -> None:
        """Close every held ``/proc`` fd. Idempotent."""
        for rank in list(self._ranks):
            self.forget(rank)
