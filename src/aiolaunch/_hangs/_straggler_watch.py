"""The straggler watch: ``Watchdog(stragglers=period)``'s sampling loop.

Every ``period`` seconds (jittered ±25 %, so it cannot lock onto the
training step's rhythm), one look at every live rank:

- where the ranks serve their collective records
  (:class:`~aiolaunch._hangs._collectives.Collectives`: torch.distributed with
  torch >= 2.8), a pull of every record; each collective's arrival times on
  its members feed the lateness statistic
  (:class:`~aiolaunch._hangs._lateness.LatenessStat`, ``source="collectives"``);
- else one stack sample of every live rank at the same instant
  (:class:`~aiolaunch._hangs._stack_sampler.StackSampler`, the dump signal), each
  classified as waiting inside a ``torch.distributed`` collective or not
  (:func:`~aiolaunch._hangs._straggler.waiting_in_collective`), fed to the pure
  statistic (:class:`~aiolaunch._hangs._straggler.StragglerStat`,
  ``source="stacks"``).

A rank either names gets a :class:`~aiolaunch.WorkerStraggling` event and a
warning; ``status()`` shows it as ``"straggling"`` and the report lists it.
Nothing is ever stopped for it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING

from .._events import WorkerStraggling
from .._workers._proc import read_proc_file
from ._dump_text import main_frames
from ._lateness import LatenessStat
from ._records import DEFAULT_PG_DESC
from ._report import Straggler
from ._straggler import StragglerStat, Straggling, starting, waiting_in_collective

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._events import Event
    from .._group import GroupState
    from ._collectives import Collectives
    from ._lateness import Late
    from ._records import Record
    from ._stack_sampler import StackSampler

__all__ = ["StragglerWatch"]

logger = logging.getLogger("aiolaunch")


class StragglerWatch:
    """The straggler statistic of one group, fed by its own sampling loop.

    :param period: seconds between two samples (on average).
    :param emit: where :class:`WorkerStraggling` goes (the event bus).
    :param discount: ``(pid, rank, nbytes)``: a sample's own writes, which
        are not the rank's output (the stall rule reads writes).
    """

    def __init__(
        self,
        period: float,
        state: GroupState,
        stacks: StackSampler,
        *,
        emit: Callable[[Event], None],
        discount: Callable[[int, int, int], None],
        collectives: Collectives | None = None,
    ) -> None:
        self.period = period
        self.stat = StragglerStat()
        #: the lateness statistic (local ranks), fed where records are served
        self.lateness_stat = LatenessStat()
        self._collectives = collectives
        self._state = state
        self._stacks = stacks
        self._emit = emit
        self._discount = discount
        self._pids: dict[int, int] = {}
        self._started: set[int] = set()  # ranks seen past their start
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sampling."""
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Stop sampling. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def straggling(self, rank: int) -> bool:
        """Whether ``rank`` is named a straggler now (by either statistic)."""
        return rank in self.stat.named or rank in self.lateness_stat.named

    def lateness(self, rank: int) -> float | None:
        """``rank``'s median lateness at collectives (s), where measured."""
        return self.lateness_stat.lateness(rank)

    def named(self) -> list[Straggling]:
        """The ranks the stack statistic names now."""
        return [self.stat.named[r] for r in sorted(self.stat.named)]

    def report(self) -> list[Straggler]:
        """Every rank named now, as the report lists it."""
        out = [Straggler(g.rank, g.wait_share, g.peers_wait_share, g.samples) for g in self.named()]
        for rank in sorted(self.lateness_stat.named):
            late = self.lateness_stat.named[rank]
            out.append(_straggler(late))
        return out

    async def _loop(self) -> None:
        jitter = random.Random()
        while True:
            # Sampling on a period is the point; jittered so ranks' phases vary.
            await asyncio.sleep(self.period * jitter.uniform(0.75, 1.25))  # allowed: sampling
            try:
                c = self._collectives
                if c is not None and c.armed():
                    self._late(c.fresh(await c.pull()))
                else:
                    self._count(await self._sample())
            except Exception:  # a statistic must never stop a job
                logger.exception("aiolaunch: straggler sample of %r failed", self._state.name)

    def _late(self, records: dict[int, Record]) -> None:
        """One pull's records (by local rank) into the lateness statistic."""
        for rank, pid in list(self._pids.items()):
            w = self._state.worker(rank)
            if w is None or w.pid != pid or not w.alive:
                self.lateness_stat.forget(rank)
                del self._pids[rank]
        self._pids.update({r: w.pid for r in records if (w := self._state.worker(r)) is not None})
        arrivals: dict[tuple[str, str, int], dict[int, int]] = {}
        expected: dict[tuple[str, str, int], set[int]] = {}
        mention: dict[tuple[str, str], set[int]] = {}
        default: set[tuple[str, str]] = set()
        for rank, rec in records.items():
            for e in rec.entries:
                if e.p2p:
                    continue
                arrivals.setdefault(e.key, {})[rank] = e.created_ns
                mention.setdefault(e.group, set()).add(rank)
                if e.desc == DEFAULT_PG_DESC:
                    default.add(e.group)
        for key in arrivals:
            group = (key[0], key[1])
            expected[key] = set(records) if group in default else mention[group]
        for late in self.lateness_stat.add(arrivals, expected, time.monotonic()):
            self._emit(
                WorkerStraggling(
                    rank=late.rank,
                    time=time.monotonic(),
                    wait_share=round(1 - late.last_share, 3),
                    peers_wait_share=round(1 - late.peers_last_share, 3),
                    lateness_s=late.lateness_s,
                    source="collectives",
                )
            )
            logger.warning(
                "aiolaunch: rank %d of %r is a straggler: it arrived %.3fs after the earliest "
                "rank at collectives (median of the last %d), last at %.0f%% of them",
                late.rank,
                self._state.name,
                late.lateness_s,
                late.collectives,
                100 * late.last_share,
            )

    async def _sample(self) -> dict[int, bool]:
        pids: dict[int, int] = {}
        for w in self._state.workers():
            rank = w.local_rank
            if w.alive and not self._state.restarting(rank):
                pids[rank] = w.pid
        for rank, pid in list(self._pids.items()):
            if pids.get(rank) != pid:  # exited, or restarted: its samples go
                self.stat.forget(rank)
                self._started.discard(rank)
                del self._pids[rank]
        self._pids.update(pids)
        # A starting rank is not signalled while it waits on a socket: it may
        # be in torch's rendezvous, whose store client logs an interrupted
        # connect or read (sockets with a timeout are not restarted) as an
        # error. Once seen past its start, it is sampled whatever it does.
        wanted = {r: p for r, p in pids.items() if r in self._started or not _on_socket(p)}
        texts = await self._stacks.sample(wanted, min(self.period, 2.0))
        waits: dict[int, bool] = {}
        for rank, text in texts.items():
            self._discount(pids[rank], rank, self._stacks.wrote.get(rank, 0))
            frames = main_frames(text)
            if not frames:
                continue
            if rank not in self._started:
                if starting(frames):
                    continue
                self._started.add(rank)
            waits[rank] = waiting_in_collective(frames)
        return waits

    def _count(self, waits: dict[int, bool]) -> None:
        for s in self.stat.add(waits):
            self._emit(
                WorkerStraggling(
                    rank=s.rank,
                    time=time.monotonic(),
                    wait_share=s.wait_share,
                    peers_wait_share=s.peers_wait_share,
                    lateness_s=None,
                    source="stacks",
                )
            )
            logger.warning(
                "aiolaunch: rank %d of %r is a straggler: it waited in collectives in %.0f%% of "
                "its last %d stack samples, its peers in %.0f%% (they wait for it)",
                s.rank,
                self._state.name,
                100 * s.wait_share,
                s.samples,
                100 * s.peers_wait_share,
            )


#: kernel functions a process waits in on a socket (``/proc/<pid>/wchan``)
_SOCKET_WAITS = ("sk_wait", "wait_woken", "inet_", "tcp_", "unix_", "poll_schedule", "do_select")


def _on_socket(pid: int) -> bool:
    """Whether ``pid``'s main thread waits on a socket (or in poll/select) now."""
    raw = read_proc_file(pid, "wchan", 128)
    return raw is not None and raw.decode(errors="replace").startswith(_SOCKET_WAITS)


def _straggler(late: Late) -> Straggler:
    return Straggler(
        late.rank,
        round(1 - late.last_share, 3),
        round(1 - late.peers_last_share, 3),
        late.collectives,
        lateness_s=late.lateness_s,
        source="collectives",
    )
