"""Waits versus work: which stalls stand once the ranks' collective records are read. Pure.

The stall rule (:mod:`aiolaunch._hangs._stall`) sees a rank without output
whose stack does not move; it cannot tell a rank *waiting* in a collective
from one *working* while others wait for it. The records can
(:class:`~aiolaunch._hangs._collectives.Look`), for each rank the rule
flagged:

- inside a collective (a pending entry), waiting for members that all
  *work* (CPU, and output or a moving stack within the last two samples): a
  wait on a working rank - a rank 0 evaluating or checkpointing while the
  others wait in the next collective. Not a stall; reported once.
- in no collective, its main thread using the CPU, and nobody waiting for it
  for ``stall_after`` yet: working between collectives, whatever its frames
  (a one-line compute loop looks like a spin). Not a stall. Once peers have
  waited for it that long and its stack stopped moving, it is (``in_compute``).
- otherwise the stall stands, its reason naming the collectives' verdict: a
  rank waiting for a member that is idle, spinning at the same frames, dead
  or waiting elsewhere; a rank others wait for, whose stack stopped; an idle
  rank in no collective (the rule as before).

A rank without a record keeps the rule as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._culprits import ranks_text

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._group import GroupState
    from ._collective import CollectiveVerdict
    from ._collectives import Collectives, Look
    from ._stall import Stall, StallDetector

__all__ = ["Weighed", "Weigher", "weigh"]

logger = logging.getLogger("aiolaunch")


@dataclass(frozen=True)
class Weighed:
    """What the records say of the stalls of one sample.

    :param stalls: the stalls that stand, their reasons naming the verdict.
    :param excused: the ranks that are not stalled after all (waiting on
        working ranks, or working between collectives).
    :param waits: ``{"all_reduce #5 of default_pg for rank 0": [waiting ranks]}``:
        the waits on working ranks.
    :param roles: what each excused rank does, for its status row (``None``:
        nothing to show).
    """

    stalls: list[Stall]
    excused: list[int] = field(default_factory=list)
    waits: dict[str, list[int]] = field(default_factory=dict)
    roles: dict[int, str | None] = field(default_factory=dict)


def weigh(
    newly: list[Stall],
    look: Look,
    *,
    working: Callable[[int], bool],
    busy: Callable[[int], bool],
    wall: float,
    stall_after: float,
) -> Weighed:
    """Weigh ``newly`` (stalls of local ranks) against ``look``.

    :param working: whether a live local rank works now (output, or CPU with
        a moving stack, lately).
    :param busy: whether a local rank's main thread used the CPU in the last
        interval.
    :param wall: the wall clock now (``time.time()``: the records' clock).
    :param stall_after: the watchdog's stall time.
    """
    out = Weighed([])
    for s in newly:
        g = look.global_rank(s.rank)
        rec = None if g is None else look.records.get(g)
        if rec is None or g is None:
            out.stalls.append(s)
            continue
        entry = rec.pending()
        if entry is not None:
            absent = look.absent(entry)
            members = [look.local.get(a) for a in absent]
            if absent and all(r is not None and working(r) for r in members):
                what = f"{entry.label} for {ranks_text(absent)}"
                out.excused.append(s.rank)
                out.waits.setdefault(what, []).append(s.rank)
                out.roles[s.rank] = f"waits in {what} (working)"
                continue
        elif busy(s.rank) and (look.waited_for(g, wall) or 0.0) < stall_after:
            out.excused.append(s.rank)
            out.roles[s.rank] = None
            continue
        reason = f"{s.reason}; collectives: {look.verdict.text}"
        out.stalls.append(dataclasses.replace(s, reason=reason))
    return out


class Weigher:
    """The watchdog's look at the collective records when ranks stall.

    :param collectives: the group's records.
    :param detector: the stall rule's state (what it flagged, who is busy);
        excused ranks are counted active there.
    :param period: the watchdog's sampling period.
    """

    def __init__(
        self, collectives: Collectives, state: GroupState, detector: StallDetector, period: float
    ) -> None:
        self._collectives = collectives
        self._state = state
        self._detector = detector
        self._period = period
        self._said: set[str] = set()
        #: this sample's pull and verdict (``None``: none taken)
        self.look: Look | None = None
        #: the verdict of the last stall, kept (with its records' folder)
        self.collective: CollectiveVerdict | None = None

    def working(self, rank: int, now: float) -> bool:
        """Whether live local ``rank`` works now: its main thread used the CPU
        in the last interval, and it was active (output, or CPU with a moving
        stack) within the last two samples. One sample at the frames of the one
        before is no spin (a recursion comes back to the same depth); output
        without CPU is no work (a rank printing "waiting for data")."""
        w = self._state.worker(rank)
        idle = self._detector.idle(rank, now)
        return (
            w is not None
            and w.alive
            and self._detector.busy(rank)
            and idle is not None
            and idle < 2 * self._period + 0.5
        )

    async def weigh(self, newly: list[Stall], now: float) -> list[Stall]:
        """The stalls of this sample that stand (:func:`weigh`); the excused
        ranks are counted active, their waits logged once."""
        self.look = None
        c = self._collectives
        if not newly or not c.armed():
            return newly
        look = self.look = await c.look(self._detector.busy)
        if look is None:
            return newly
        w = weigh(
            newly,
            look,
            working=lambda r: self.working(r, now),
            busy=self._detector.busy,
            wall=time.time(),
            stall_after=self._detector.stall_after,
        )
        for rank in w.excused:
            self._detector.excuse(rank, now)
            c.set_role(rank, w.roles.get(rank))
        for what, ranks in w.waits.items():
            if what not in self._said:
                self._said.add(what)
                logger.warning(
                    "aiolaunch: %s of %r wait in %s, which works: a wait on a working rank, "
                    "not a stall",
                    ranks_text(ranks),
                    self._state.name,
                    what,
                )
        return w.stalls

    def keep(self) -> CollectiveVerdict | None:
        """This sample's verdict, kept (records written) for the stall at hand."""
        if self.look is None:
            return None
        self.collective = self._collectives.keep(self.look)
        return self.collective
