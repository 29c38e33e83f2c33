"""The collective records of one group: pulled, kept, judged, written: :class:`Collectives`.

The hang forensics hold one (with a watchdog: the workers arm their record
servers only then). Its users:

- the watchdog (:class:`~aiolaunch._hangs._watcher.StallWatcher`) at a stall:
  :meth:`Collectives.look` pulls every live rank and judges
  (:func:`~aiolaunch._hangs._collective.judge`), which tells waits from work
  and names the culprits;
- the group's first failure (:meth:`HangObserver.before_stop`);
- the straggler watch, which reads each pull's arrival times.

Records are kept per rank (the latest pulled, with the pid it came from). A
rank that died, or is dying, is judged by the record it left as it exited
(its *last words*, :func:`~aiolaunch._hangs._pull.last_words`: gloo fails the
others' collective when a peer exits, and they all die within a second), else
by the last one pulled. A verdict kept (a stall's, the first failure's)
has the ranks' records written next to the report
(``{log_dir}/flight-recorder-<n>/rank_<global rank>``, torch's pickles:
``torchfrtrace`` reads the folder). Ranks without a record (an old torch)
are said once per group, in one warning.

Global ranks: each rank's record server reports ``RANK`` and ``WORLD_SIZE``
as its launcher set them; without them, the local rank and the group's size.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._child._record_server import info_path
from ._collective import CollectiveVerdict, RankView, judge
from ._culprits import ranks_text
from ._pull import PULL_TIMEOUT, Pulled, last_words, pull_records, read_info
from ._records import members, parse_record, write_dumps

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from .._group import GroupState
    from ._records import Entry, Group, Record

__all__ = ["Collectives", "Look"]

logger = logging.getLogger("aiolaunch")


@dataclass(frozen=True)
class Look:
    """One pull of every live rank and its verdict.

    :param verdict: the collectives' verdict.
    :param records: the records judged, by global rank.
    :param local: ``{global rank: local rank}`` of this group's ranks.
    :param groups: every group's members.
    :param pulled: each live local rank's answer.
    :param seconds: how long the pull took.
    """

    verdict: CollectiveVerdict
    records: dict[int, Record]
    local: dict[int, int]
    groups: dict[Group, frozenset[int]] = field(default_factory=dict)
    pulled: dict[int, Pulled] = field(default_factory=dict)
    seconds: float = 0.0
    #: the ranks pending at each collective (global)
    _at: dict[tuple[str, str, int], set[int]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def global_rank(self, local: int) -> int | None:
        """The global rank of local rank ``local``."""
        for g, r in self.local.items():
            if r == local:
                return g
        return None

    def __post_init__(self) -> None:
        for g, rec in self.records.items():
            p = rec.pending()
            if p is not None:
                self._at.setdefault(p.key, set()).add(g)

    def absent(self, entry: Entry) -> list[int]:
        """The members of ``entry``'s group that are not pending in it (global)."""
        there = self._at.get(entry.key, set())
        return sorted(self.groups.get(entry.group, frozenset()) - there)

    def waited_for(self, rank: int, wall: float) -> float | None:
        """How long (s, by the wall clock ``wall``) the longest-waiting rank has
        waited in a collective that ``rank`` (global) has not entered; ``None``
        if nobody waits for it."""
        longest: float | None = None
        for rec in self.records.values():
            p = rec.pending()
            if p is not None and rank in self.absent(p):
                waited = wall - p.created_ns / 1e9
                longest = waited if longest is None else max(longest, waited)
        return longest


class Collectives:
    """The collective records of one group (see the module docstring).

    :param state: the group.
    :param stacks_dir: where the workers' record servers listen.
    :param out_dir: where the records of a verdict are written (the group's folder).
    """

    def __init__(self, state: GroupState, stacks_dir: str, out_dir: str) -> None:
        self._state = state
        self._stacks_dir = stacks_dir
        self._out_dir = out_dir
        #: the latest record of each local rank, with the pid it came from
        self._records: dict[int, tuple[int, Record]] = {}
        #: the description of each local rank's record server, with its pid
        self._info: dict[int, tuple[int, dict[str, object]]] = {}
        self._said: set[int] = set()
        self._written = 0
        #: ranks that left their last words: the pid, and when they began to exit
        self._exiting: dict[int, tuple[int, float]] = {}
        #: the last verdict kept (a stall's, or the first failure's)
        self.verdict: CollectiveVerdict | None = None
        self._roles: dict[int, str] = {}

    # -- what is known ------------------------------------------------------------
    def armed(self) -> bool:
        """Whether some live rank serves its record. Ranks that said why they
        have none (an old torch) are said once, when no rank serves one."""
        off: dict[int, str] = {}
        for w in self._state.workers():
            if not w.alive or not w.pid:
                continue
            if os.path.exists(info_path(self._stacks_dir, w.pid)):
                return True
            if w.local_rank not in self._said:
                status, _, note = read_info(self._stacks_dir, w.pid)
                if status == "off":
                    off[w.local_rank] = note
        self._say_off(off)
        return False

    def role(self, rank: int) -> str | None:
        """What local rank ``rank`` does in the verdict kept (its status row)."""
        return self._roles.get(rank)

    def _global(self, local: int) -> int:
        info = self._info.get(local)
        rank = None if info is None else info[1].get("rank")
        return rank if isinstance(rank, int) else local

    def _world_size(self) -> int:
        sizes = [i.get("world_size") for _, i in self._info.values()]
        known = [s for s in sizes if isinstance(s, int)]
        return max([*known, self._state.nprocs])

    # -- pulling ---------------------------------------------------------------------
    async def pull(self, timeout: float = PULL_TIMEOUT) -> dict[int, Pulled]:
        """Every live rank's record now (kept); ``{local rank: answer}``."""
        pids = {
            w.local_rank: w.pid
            for w in self._state.workers()
            if w.alive and w.pid and not self._state.restarting(w.local_rank)
        }
        known = {pid: info for pid, info in self._info.values() if pid in pids.values()}
        pulled = await pull_records(self._stacks_dir, pids, timeout, known)
        for rank, p in pulled.items():
            if p.info:
                self._info[rank] = (p.pid, p.info)
            if p.status == "ok":
                try:
                    rec = parse_record(self._global(rank), p.dumps)
                except ValueError as exc:
                    pulled[rank] = dataclasses.replace(p, status="failed", note=str(exc))
                    continue
                self._records[rank] = (p.pid, rec)
        self._say_off({r: p.note for r, p in pulled.items() if p.status == "off"})
        return pulled

    def fresh(self, pulled: Mapping[int, Pulled]) -> dict[int, Record]:
        """The records ``pulled`` brought, by local rank."""
        out: dict[int, Record] = {}
        for rank, p in pulled.items():
            kept = self._records.get(rank)
            if p.status == "ok" and kept is not None and kept[0] == p.pid:
                out[rank] = kept[1]
        return out

    def _say_off(self, off: Mapping[int, str]) -> None:
        """One warning for the ranks that have no record, and why (``{rank: why}``)."""
        off = {r: why for r, why in off.items() if r not in self._said}
        if not off:
            return
        self._said.update(off)
        notes = sorted(set(off.values()))
        logger.warning(
            "aiolaunch: no collective record for %s of %r (%s): hangs there are judged by "
            "their stacks only",
            ranks_text(off),
            self._state.name,
            "; ".join(notes),
        )

    # -- judging -------------------------------------------------------------------
    async def look(
        self, busy: Callable[[int], bool], *, stale: bool = False, timeout: float = PULL_TIMEOUT
    ) -> Look | None:
        """Pull every live rank and judge; ``None`` if no rank has a record.

        :param busy: whether a local rank's main thread used the CPU lately.
        :param stale: judge a live rank that did not answer now by its last
            record (at a failure: the others may be dying); else only what
            answered now, and the dead ranks' last records.
        """
        t0 = time.monotonic()
        pulled = await self.pull(timeout)
        seconds = time.monotonic() - t0
        records: dict[int, Record] = {}
        local: dict[int, int] = {}
        views: dict[int, RankView] = {}
        gone: dict[int, float] = {}  # the ranks that exited or are exiting, since when
        for w in self._state.workers():
            fresh = pulled.get(w.local_rank)
            if fresh is None or fresh.status != "ok":
                self._last_words(w.local_rank, w.pid, alive=w.alive)
            began = self._exiting.get(w.local_rank)
            if began is not None and began[0] == w.pid:
                gone[w.local_rank] = began[1]  # its last words: when it began to exit
            elif not w.alive:
                gone[w.local_rank] = w.exit_time or 0.0
        order = {rank: i for i, rank in enumerate(sorted(gone, key=gone.__getitem__))}
        for w in self._state.workers():
            fresh = pulled.get(w.local_rank)
            answered = fresh is not None and fresh.status == "ok"
            g = self._global(w.local_rank)
            local[g] = w.local_rank
            kept = self._records.get(w.local_rank)
            current = kept is not None and kept[0] == w.pid
            if kept is not None and current and (answered or w.local_rank in gone or stale):
                records[g] = kept[1]
            note = "" if fresh is None else fresh.note
            views[g] = RankView(
                exited=w.local_rank in gone and not answered,
                exit_order=order.get(w.local_rank, 0),
                exitcode=w.returncode,
                busy=w.alive and busy(w.local_rank),
                note=note,
            )
        if not records:
            return None
        world = self._world_size()
        groups = members(records, world)
        verdict = judge(records, views, world, groups)
        return Look(verdict, records, local, groups, pulled, seconds)

    def _last_words(self, rank: int, pid: int, *, alive: bool) -> None:
        """Keep the record local ``rank``'s process ``pid`` left as it began to
        exit, if any (a live one is exiting: its description must name this
        very process)."""
        words = last_words(self._stacks_dir, pid)
        if words is None:
            return
        if self._info.get(rank, (0, {}))[0] != pid or alive:
            status, info, _ = read_info(self._stacks_dir, pid, alive=alive)
            if status != "ok":
                return
            self._info[rank] = (pid, info)
        dumps, when = words
        try:
            self._records[rank] = (pid, parse_record(self._global(rank), dumps))
        except ValueError:
            return
        self._exiting[rank] = (pid, when)

    def keep(self, look: Look) -> CollectiveVerdict:
        """Keep ``look``'s verdict: the status rows' roles, and the records
        written next to the report (``flight-recorder-<n>``). Returns it with
        its ``dumps`` folder."""
        verdict = look.verdict
        self._written += 1
        folder = os.path.join(self._out_dir, f"flight-recorder-{self._written}")
        try:
            write_dumps(folder, look.records, look.groups)
            verdict = dataclasses.replace(verdict, dumps=folder)
        except OSError as exc:
            logger.warning("aiolaunch: cannot write the collective records: %s", exc)
        self.verdict = verdict
        self._roles = {}
        for g, local in look.local.items():
            role = verdict.role(g)
            if role is not None:
                self._roles[local] = role
        return verdict

    def set_role(self, rank: int, role: str | None) -> None:
        """What local ``rank`` does now, beside a verdict (a wait on a working rank)."""
        if role is None:
            self._roles.pop(rank, None)
        else:
            self._roles[rank] = role
