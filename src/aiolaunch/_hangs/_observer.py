"""The hang forensics of one group: :class:`HangObserver`, its parts and their lifetime.

The context holds one :class:`HangObserver` (a
:class:`~aiolaunch._observer.GroupObserver`), which assembles small parts,
each behind a narrow interface (see docs/hangs.md):

- :class:`~aiolaunch._hangs._activity.Sampler`: ``/proc`` readings of live ranks;
- :class:`~aiolaunch._hangs._dumper.StackDumper`: numbered, bounded stack dumps;
- :class:`~aiolaunch._hangs._stack_sampler.StackSampler`: periodic stack samples
  (no files), sharing the dumper's lock;
- :class:`~aiolaunch._hangs._output_clock.OutputClock`: the output age of
  ranks whose streams the log pipeline does not read;
- :class:`~aiolaunch._hangs._watcher.StallWatcher` (with a watchdog): the
  sampling loop, the pure stall rule, and actions through the group's commands;
- :class:`~aiolaunch._hangs._straggler_watch.StragglerWatch` (``stragglers=``):
  its own sampling loop and the pure straggler statistic;
- :class:`~aiolaunch._hangs._collectives.Collectives` (with a watchdog): the
  ranks' collective records (torch's Flight Recorder), read at a stall and
  at the group's first failure, and by the straggler watch;
- the stacks of every live rank at the group's first failure
  (:meth:`HangObserver.before_stop`, with a watchdog), and the collectives'
  verdict then;
- the report (:class:`~aiolaunch._hangs._report.RunReport`).

It gives every worker ``$AIOLAUNCH_STACKS_DIR`` (the bootstraps register the
dump signal there; with a watchdog also ``$AIOLAUNCH_COLLECTIVES``: the ranks
serve their collective records there once they import torch) and writes into
the group's folder
(:class:`~aiolaunch._logs._folder.GroupFolder`): dumps and the report. What a
status row shows of a rank's activity comes from here too (the
:class:`~aiolaunch._live._status.RankMarks` it implements); the live view
reads it through the context, never through this object's parts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .._child._record_server import COLLECTIVES_ENV
from .._observer import GroupObserver
from ._activity import Sampler
from ._collectives import Collectives
from ._dumper import StackDumper, check_dump_timeout
from ._output_clock import OutputClock
from ._report import AtFailure, RunReport, write_report
from ._stack_sampler import StackSampler
from ._stacks import STACKS_DIR_ENV, StackReport
from ._straggler_watch import StragglerWatch
from ._watcher import StallWatcher

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from .._events import Event
    from .._group import GroupState
    from .._logs._folder import GroupFolder
    from .._results import RunProcsResult
    from .._workers._handle import WorkerHandle
    from ._activity import RankActivity
    from ._collective import CollectiveVerdict
    from ._dumper import Dump
    from ._watchdog import Watchdog

__all__ = ["AT_FAILURE_TIMEOUT", "HangObserver", "dump_at_failure"]

logger = logging.getLogger("aiolaunch")

#: At a rank's failure, at most this long for the other ranks' stacks.
AT_FAILURE_TIMEOUT = 2.0


class HangObserver(GroupObserver):
    """Stacks, watchdog, stragglers and the report of one group.

    :param state: the group.
    :param watchdog: the settings (``None``: stacks and status only, no watching).
    :param folder: the group's folder: stack dumps, the report.
    :param last_output: when a rank last wrote, as the log pipeline saw it
        (``None``: not known there).
    :param stderrs: each rank's stderr log, quoted by the report.
    :param emit: where :class:`WorkerStalled` and :class:`WorkerStraggling` go.
    :param restartable: whether a rank has a restart policy.
    :param unread: whether the log pipeline misses some of a rank's output
        (a stream inherited or discarded): its output age is read from its
        count of written bytes (:class:`~aiolaunch._hangs._output_clock.OutputClock`).
    """

    def __init__(
        self,
        state: GroupState,
        watchdog: Watchdog | None,
        folder: GroupFolder,
        *,
        last_output: Callable[[int], float | None],
        stderrs: Mapping[int, str],
        emit: Callable[[Event], None],
        restartable: Callable[[int], bool],
        unread: Callable[[int], bool] | None = None,
    ) -> None:
        self._state = state
        self._folder = folder
        self._stderrs = dict(stderrs)
        self.sampler = Sampler(last_output)
        self.dumper = StackDumper(state, folder.stacks_dir, folder.rank_dir, self.sampler.rebase)
        self.stacks = StackSampler(folder.stacks_dir, self.dumper.lock)
        self.clock = OutputClock(state, self.sampler, unread or _none, self.dumper.lock)
        self.collectives: Collectives | None = None
        if watchdog is not None:
            self.collectives = Collectives(state, folder.stacks_dir, folder.path)
        self.watcher: StallWatcher | None = None
        if watchdog is not None:
            self.watcher = StallWatcher(
                watchdog,
                state,
                self.sampler,
                self.dumper,
                self.stacks,
                emit=emit,
                restartable=restartable,
                write_report=lambda: self.write_report(None),
                collectives=self.collectives,
            )
        self.stragglers: StragglerWatch | None = None
        if watchdog is not None and watchdog.stragglers is not None:
            self.stragglers = StragglerWatch(
                watchdog.stragglers,
                state,
                self.stacks,
                emit=emit,
                discount=self.sampler.discount,
                collectives=self.collectives,
            )
        #: where every live rank was at the group's first failure (watchdog only)
        self.at_failure: AtFailure | None = None
        #: the collectives' verdict at the group's first failure (watchdog only)
        self.at_failure_collective: CollectiveVerdict | None = None
        #: the paths of the last report written
        self.reported: tuple[str, str] | None = None
        self._concluded = False

    @property
    def progress_lines(self) -> StallWatcher | None:
        """With a progress regex, the line listener the group subscribes to its
        log pipeline (the watcher), else ``None``."""
        if self.watcher is not None and self.watcher.watchdog.progress is not None:
            return self.watcher
        return None

    # -- GroupObserver ----------------------------------------------------------
    def env(self, rank: int) -> Mapping[str, str]:
        """Every worker registers its dump handler in the stacks folder; with a
        watchdog, a torch rank serves its collective record there too."""
        if self.collectives is not None:
            return {STACKS_DIR_ENV: self._folder.stacks_dir, COLLECTIVES_ENV: "1"}
        return {STACKS_DIR_ENV: self._folder.stacks_dir}

    def worker_started(self, handle: WorkerHandle) -> None:
        """The output clock reads the new process at once."""
        self.clock.rank_started()

    def group_started(self) -> None:
        """Start the watchdog's and the straggler statistic's sampling, and
        the output clock of unread ranks."""
        self.clock.start()
        if self.watcher is not None:
            self.watcher.start()
        if self.stragglers is not None:
            self.stragglers.start()

    async def before_stop(self) -> None:
        """With a watchdog, when a rank failed on its own (a stall's dump is
        done), every live rank's stacks first (:func:`dump_at_failure`), for
        the report and the summary, and the collectives' verdict (read at the
        same time)."""
        if self.watcher is None or self.at_failure is not None:
            return
        stacks = dump_at_failure(self._state, self.dumper)
        if self.collectives is None or self.at_failure_collective is not None:
            self.at_failure = await stacks
            return
        self.at_failure, self.at_failure_collective = await asyncio.gather(
            stacks, self._collective_at_failure()
        )

    async def _collective_at_failure(self) -> CollectiveVerdict | None:
        c, w = self.collectives, self.watcher
        failed = [r for r in self._state.failed_ranks() if r not in self._state.forced]
        if c is None or w is None or not failed:
            return None
        try:
            look = await c.look(w.detector.busy, stale=True)
            return None if look is None else c.keep(look)
        except Exception:  # a report must never turn into a second failure
            logger.exception("aiolaunch: reading collective records of %r", self._state.name)
            return None

    async def aclose(self) -> None:
        """Stop the watchdog, the straggler statistic and the output clock. Idempotent."""
        self.clock.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.stragglers is not None:
            await self.stragglers.stop()

    def annotate(self, result: RunProcsResult) -> None:
        """Put where the other ranks were on the first failure's ``others``
        (shown by its ``ChildFailedError`` summary)."""
        a = self.at_failure
        if a is not None and a.rank in result.failures:
            result.failures[a.rank].others = a.lines()

    def conclude(self, result: RunProcsResult) -> None:
        """Write the report if the group failed; close the ``/proc`` readers."""
        if self._concluded:
            return
        self._concluded = True
        if result.is_failed():
            self.reported = self.write_report(result)
            if self.reported is not None:
                logger.warning(
                    "aiolaunch: group %r failed; report: %s", self._state.name, self.reported[1]
                )
        self.sampler.close()
        self.stacks.close()

    # -- RankMarks: what a status row shows of a rank ------------------------------
    def reading(self, rank: int, pid: int, now: float) -> RankActivity | None:
        """``rank``'s ``/proc`` reading now (:meth:`Sampler.reading`)."""
        return self.sampler.reading(rank, pid, now)

    def stalled(self, rank: int) -> bool:
        """Whether the watchdog flags ``rank`` now."""
        return self.watcher is not None and self.watcher.stalled(rank)

    def stalls(self, rank: int) -> int:
        """How many times the watchdog flagged ``rank``."""
        return 0 if self.watcher is None else self.watcher.stall_count(rank)

    def steps(self, rank: int, now: float) -> tuple[int, float] | None:
        """Progress lines of ``rank`` and their rate; ``None`` without a regex."""
        return None if self.watcher is None else self.watcher.steps(rank, now)

    def straggling(self, rank: int) -> bool:
        """Whether ``rank`` is named a straggler now."""
        return self.stragglers is not None and self.stragglers.straggling(rank)

    def lateness(self, rank: int) -> float | None:
        """``rank``'s median lateness at collectives (s), where measured."""
        return None if self.stragglers is None else self.stragglers.lateness(rank)

    def collective(self, rank: int) -> str | None:
        """What ``rank`` does in the collectives' last verdict (or waits on)."""
        return None if self.collectives is None else self.collectives.role(rank)

    # -- dumps and the report ------------------------------------------------------
    async def dump(self, ranks: Sequence[int] | None, timeout: float) -> Dump:
        """A round of stack dumps (:meth:`StackDumper.dump`)."""
        return await self.dumper.dump(ranks, timeout)

    async def dump_stacks(self, ranks: list[int] | None, timeout: float) -> dict[int, str]:
        """:meth:`PContext.dump_stacks`: check the arguments, then dump.

        :raises ValueError: an unknown rank, or ``timeout`` not a finite number > 0.
        """
        timeout = check_dump_timeout("dump_stacks(timeout)", timeout)
        _check_ranks(ranks, self._state.nprocs)
        return (await self.dump(ranks, timeout)).stacks

    def write_report(self, result: RunProcsResult | None) -> tuple[str, str] | None:
        """Write ``report.json``/``report.txt`` now (``result``: ``None`` while running)."""
        w = self.watcher
        report = RunReport.build(
            name=self._state.name,
            log_dir=self._folder.path,
            result=result,
            stopped=[h.local_rank for h in self._state.workers() if h.stopped_by_us],
            forced=self._state.forced,
            stderrs=self._stderrs,
            stalls=w.reported_stalls() if w is not None else (),
            verdict=w.verdict if w is not None else None,
            dumps=w.dumps if w is not None else None,
            at_failure=self.at_failure,
            stragglers=self.stragglers.report() if self.stragglers is not None else [],
            collective=self.at_failure_collective or (w.collective if w is not None else None),
        )
        return write_report(report)


def _check_ranks(ranks: object, nprocs: int) -> None:
    if ranks is not None and not isinstance(ranks, list | tuple | set | frozenset | range):
        raise TypeError(f"dump_stacks(ranks={ranks!r}) must be a list of local ranks or None")
    bad = [r for r in ranks or () if isinstance(r, bool) or r not in range(nprocs)]
    if bad:
        raise ValueError(f"dump_stacks(ranks={ranks!r}): local ranks are 0..{nprocs - 1}")


def _none(rank: int) -> bool:
    return False


async def dump_at_failure(state: GroupState, dumper: StackDumper) -> AtFailure | None:
    """Where every live rank is now that a rank failed on its own (not for a
    stall): their stacks, at most :data:`AT_FAILURE_TIMEOUT`; ``None`` when
    none failed on its own, or none is left alive."""
    failed = [r for r in state.failed_ranks() if r not in state.forced]
    live = [w.local_rank for w in state.workers() if w.alive]
    if not failed or not live:
        return None
    try:
        dump = await dumper.dump(live, AT_FAILURE_TIMEOUT)
    except Exception:  # a report must never turn into a second failure
        logger.exception("aiolaunch: dumping the stacks at the failure of %r", state.name)
        return None
    return AtFailure(failed[0], StackReport.from_dumps(dump.stacks), dump.stacks, dump.files)
