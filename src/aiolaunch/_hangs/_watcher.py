"""The watchdog's loop: sample every rank, apply the stall rule, act on a stall.

The one place that samples on a period: hangs have no event. Once per
:attr:`Watchdog.period` the :class:`StallWatcher` reads each live rank's
``/proc`` (:class:`~aiolaunch._hangs._activity.Sampler`), samples the stacks of the
ranks whose main thread burns CPU without output and runs now
(:class:`~aiolaunch._hangs._stack_sampler.StackSampler`: the ones that may spin), and
hands each sample to the pure rule (:class:`~aiolaunch._hangs._stall.StallDetector`).
A stall is handled in
this order: a :class:`WorkerStalled` event, the stacks of every rank (the
others show what the stalled one waits for), the report, *then* the action,
taken only through the group's own commands (circus's watchdog casts
``kill``; it never touches the arbiter's insides):

- ``observe``: nothing more;
- ``restart``: ``GroupState.kill(rank, SIGKILL, why)`` for a rank with a
  restart policy (its policy restarts it);
- ``fail``: ``GroupState.fail(rank, message)``: the group is decided, and
  ``wait()`` stops it through the usual path.

Where the ranks serve their collective records (torch.distributed, with
:class:`~aiolaunch._hangs._collectives.Collectives`), a stall is weighed
against them first (:class:`~aiolaunch._hangs._waits.Weigher`): a rank waiting in a
collective for ranks that are working, and a rank computing between
collectives with nobody waiting for it (whatever its frames), are not
stalled; the others' reason names the collectives' verdict, and its culprits
are the ones that fail. Without a record, who fails is one story
(``_culprits.py``): the odd ones out of the stack verdict, whatever they do,
when the stalled ranks wait in one place; a verdict with no odd one out while
a live rank is still on its way waits for the next sample (at most
``stall_after``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import signal
import time
from typing import TYPE_CHECKING

from .._events import WorkerStalled
from ._culprits import collective_culprits, odd_ones, ranks_text, too_early
from ._dump_text import signature
from ._rates import StepRate
from ._stacks import StackReport
from ._stall import Sample, Stall, StallDetector
from ._waits import Weigher

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._events import Event
    from .._group import GroupState
    from ._activity import Sampler
    from ._collective import CollectiveVerdict
    from ._collectives import Collectives
    from ._dumper import StackDumper
    from ._stack_sampler import StackSampler
    from ._watchdog import Watchdog

__all__ = ["StallWatcher"]

logger = logging.getLogger("aiolaunch")

#: seconds a stall waits for every rank's stacks before it acts anyway
_STALL_DUMP_TIMEOUT = 5.0
#: at most this long a sample waits for a rank's stack (a stopped rank,
#: one in D state: it has no CPU and is judged by the CPU rule meanwhile)
_SAMPLE_TIMEOUT = 2.0


class StallWatcher:
    """The watchdog of one group (see the module docstring).

    With a progress regex it is also a line listener of the log pipeline
    (``reads``/``wants``/``line``): it needs every stream, and notes when each
    rank last printed a matching line.

    :param emit: where :class:`WorkerStalled` goes (the event bus).
    :param restartable: whether a rank has a restart policy.
    :param write_report: writes the report now; returns its paths or ``None``.
    """

    def __init__(
        self,
        watchdog: Watchdog,
        state: GroupState,
        sampler: Sampler,
        dumper: StackDumper,
        stacks: StackSampler,
        *,
        emit: Callable[[Event], None],
        restartable: Callable[[int], bool],
        write_report: Callable[[], tuple[str, str] | None],
        collectives: Collectives | None = None,
    ) -> None:
        self.watchdog = watchdog
        self._progress = re.compile(watchdog.progress) if watchdog.progress else None
        self.detector = StallDetector(watchdog.stall_after, progress=self._progress is not None)
        self._records = (
            None
            if collectives is None
            else Weigher(collectives, state, self.detector, watchdog.period)
        )
        self._state = state
        self._sampler = sampler
        # Costlier looks (every thread, every thread's children) for a rank
        # idle a third of stall_after: in time for the rule, rare otherwise.
        sampler.suspect_after = max(1.0, watchdog.stall_after / 3)
        self._dumper = dumper
        self._stacks = stacks
        self._emit = emit
        self._restartable = restartable
        self._write_report = write_report
        self._last_progress: dict[int, float] = {}
        self._since = time.monotonic()
        self._steps: dict[int, StepRate] = {}
        self._stall_counts: dict[int, int] = {}
        self._detected: dict[int, float] = {}  # rank -> time.time() of its stall
        #: every stall seen, the latest per rank, with its place in the verdict
        self.stalls: dict[int, Stall] = {}
        #: the verdict and the stacks of the last stall's dump
        self.verdict: StackReport | None = None
        self.dumps: dict[int, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        #: stalls waiting for their story (see _early), and since when
        self._pending: dict[int, Stall] = {}
        self._episode: float | None = None

    def start(self) -> None:
        """Start sampling."""
        self._since = time.monotonic()
        self._tasks.append(asyncio.ensure_future(self._watch()))

    async def stop(self) -> None:
        """Stop sampling. Idempotent."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def collective(self) -> CollectiveVerdict | None:
        """The collectives' verdict of the last stall (with its records' folder)."""
        return None if self._records is None else self._records.collective

    def stalled(self, rank: int) -> bool:
        """Whether ``rank`` is flagged now (and was not active since)."""
        return self.detector.flagged(rank)

    def stall_count(self, rank: int) -> int:
        """How many times ``rank`` was flagged."""
        return self._stall_counts.get(rank, 0)

    def steps(self, rank: int, now: float) -> tuple[int, float] | None:
        """``(lines matching the progress regex, per second over the last
        minute)`` of ``rank``; ``None`` without a regex."""
        if self._progress is None:
            return None
        rate = self._steps.get(rank)
        return (0, 0.0) if rate is None else (rate.total, rate.rate(now))

    def reported_stalls(self) -> list[Stall]:
        """The stalls for the report: ranks flagged now, and ranks failed for a stall."""
        forced = self._state.forced
        return [
            s
            for rank, s in sorted(self.stalls.items())
            if self.detector.flagged(rank) or rank in forced
        ]

    # -- the progress regex: a line listener of the log pipeline ---------------
    def reads(self, rank: int, stream: str) -> bool:
        """Every stream is read (none is inherited by the worker)."""
        return True

    def wants(self, rank: int, stream: str) -> bool:
        """Every line is wanted."""
        return True

    def line(self, rank: int, stream: str, text: str) -> None:
        """One line of ``rank``: progress if it matches the regex."""
        if self._progress is not None and self._progress.search(text) is not None:
            now = self._last_progress[rank] = time.monotonic()
            rate = self._steps.get(rank)
            if rate is None:
                rate = self._steps[rank] = StepRate(since=self._since)
            rate.add(now)

    # -- sampling -------------------------------------------------------------

    async def _watch(self) -> None:
        period = self.watchdog.period
        writes = self._progress is None
        while True:
            await asyncio.sleep(period)  # allowed: /proc has no change events
            now = time.monotonic()
            samples: dict[int, Sample] = {}
            pids: dict[int, int] = {}
            for w in self._state.workers():
                rank = w.local_rank
                if not w.alive or self._state.restarting(rank) or self._state.attached(rank):
                    self.detector.forget(rank)
                    self._stacks.forget(w.pid)
                    continue
                sample = self._sampler.sample(rank, w.pid, now, writes=writes)
                if sample is not None:
                    samples[rank], pids[rank] = sample, w.pid
            # Where the busy, quiet ranks are (those that may spin): the dump
            # signal, then the texts' signatures; the others, and ranks that
            # cannot be sampled, keep stack=None: the CPU rule.
            busy = {r: p for r, p in pids.items() if self.detector.wants_stack(r, samples[r], now)}
            texts = await self._stacks.sample(busy, min(_SAMPLE_TIMEOUT, period)) if busy else {}
            newly: list[Stall] = []
            for rank, sample in samples.items():
                text = texts.get(rank)
                if text is not None:
                    self._sampler.discount(pids[rank], rank, self._stacks.wrote.get(rank, 0))
                    sample = dataclasses.replace(sample, stack=signature(text))
                if not writes:
                    sample = dataclasses.replace(
                        sample, last_progress=self._last_progress.get(rank)
                    )
                stall = self.detector.observe(rank, sample, now)
                if stall is not None:
                    self._detected[rank] = time.time()
                    newly.append(stall)
            if self._records is not None:
                try:
                    newly = await self._records.weigh(newly, now)
                except Exception:  # the records are a help: the stall rule stands without them
                    logger.exception("aiolaunch: collective records of %r", self._state.name)
            if newly or self._pending:
                try:
                    await self._on_stall(newly)
                except Exception:  # the watchdog must outlive a failed dump or report
                    logger.exception("aiolaunch: handling a stall of %r failed", self._state.name)

    # -- a stall --------------------------------------------------------------
    async def _on_stall(self, newly: list[Stall]) -> None:
        wd = self.watchdog
        for s in newly:
            self._stall_counts[s.rank] = self._stall_counts.get(s.rank, 0) + 1
            self._emit(
                WorkerStalled(rank=s.rank, time=time.monotonic(), idle_s=s.idle_s, reason=s.reason)
            )
        # The stalls not acted on yet (an earlier one may wait for its story),
        # as long as their rank is still stalled.
        pending = {**self._pending, **{s.rank: s for s in newly}}
        pending = {r: s for r, s in pending.items() if self.detector.flagged(r)}
        self._pending = {}
        if not pending:
            self._episode = None
            return
        self._episode = self._episode or time.monotonic()
        # Every rank's stacks before anything is stopped: the others show what
        # the stalled one is waiting for (or what waits for it).
        dump = await self._dumper.dump(None, _STALL_DUMP_TIMEOUT)
        verdict = StackReport.from_dumps(dump.stacks)
        self.verdict, self.dumps = verdict, dump.stacks
        records = self._records
        look = None if records is None else records.look
        collective = None if records is None else records.keep()
        stalls = [
            dataclasses.replace(
                s,
                verdict_line=verdict.line_for(s.rank) or "",
                stacks_file=dump.files.get(s.rank, ""),
            )
            for s in sorted(pending.values(), key=lambda s: s.rank)
        ]
        self.stalls.update((s.rank, s) for s in stalls)
        paths = self._write_report()
        if newly:
            logger.warning(
                "aiolaunch: %s of %r stalled (%s); stacks of every rank dumped. Verdict:\n%s\n"
                "Report: %s",
                ranks_text(s.rank for s in newly),
                self._state.name,
                newly[0].reason,
                verdict,
                paths[1] if paths else "(not written)",
            )
        if wd.action == "observe":
            self._episode = None
            return
        now = time.monotonic()
        pids = {w.local_rank: w.pid for w in self._state.workers() if w.alive}
        live = [r for r in pids if not self._state.attached(r)]
        age = now - self._episode
        if collective is not None and look is not None and collective.ranks:
            why = f"the collectives' verdict ({collective.verdict}): {collective.text}"
            culprits = collective_culprits(
                stalls,
                collective.ranks,
                why,
                look.local,
                pids,
                verdict,
                dump.files,
                self.detector,
                now=now,
            )
        else:
            if too_early(stalls, verdict, live, self.detector, age=age, stall_after=wd.stall_after):
                self._pending = pending  # judged again with the next sample
                return
            culprits = odd_ones(
                stalls, verdict, pids, dump.files, self.detector, period=wd.period, now=now
            )
        self._episode = None
        for s in culprits:
            if s.rank not in pending:  # an odd one out that had not stalled itself
                self.detector.flag(s.rank)
                self._stall_counts[s.rank] = self._stall_counts.get(s.rank, 0) + 1
                self._detected.setdefault(s.rank, time.time())
                self.stalls[s.rank] = s
        for s in culprits:
            why = f"stalled: {s.reason}"
            # With "restart", the rank's restart policy takes it from here: a
            # SIGKILLed worker is a failed exit (its stacks are on disk already).
            restart = wd.action == "restart" and self._restartable(s.rank)
            if restart and self._state.kill(s.rank, signal.SIGKILL, why):
                continue
            self._state.fail(s.rank, s.message(), when=self._detected.get(s.rank))
