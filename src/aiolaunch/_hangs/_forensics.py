"""Per-group forensics: where its parts live, and their lifetime.

The context owns one :class:`Forensics`, which assembles small parts, each
behind a narrow interface (see docs/ARCHITECTURE.md, "Hangs"):

- :class:`~aiolaunch._hangs._sampler.Sampler`: ``/proc`` readings of live ranks;
- :class:`~aiolaunch._hangs._dumper.StackDumper`: numbered, bounded stack dumps;
- :class:`~aiolaunch._hangs._stack_sampler.StackSampler`: periodic stack samples (no
  files), sharing the dumper's lock;
- :func:`~aiolaunch._live._status.worker_statuses`: what ``status()`` shows;
- :class:`~aiolaunch._hangs._watcher.StallWatcher` (with a watchdog): the sampling
  loop, the pure stall rule, and actions through the group's commands;
- :class:`~aiolaunch._hangs._straggler_watch.StragglerWatch` (``stragglers=``):
  its own sampling loop and the pure straggler statistic;
- the stacks of every live rank at the group's first failure
  (:meth:`Forensics.before_stop`, with a watchdog);
- the control socket (:class:`~aiolaunch._live._control.ControlServer`) serving the
  command table of ``_commands.py`` with this object as its target;
- :class:`~aiolaunch._live._view.LiveView`: the metrics server, ``attach``
  sessions, the marks of a status row, and the output age of ranks whose
  streams the log pipeline does not read (its ``OutputClock``);
- the report (:class:`~aiolaunch._hangs._report.RunReport`).

It gives every worker ``$AIOLAUNCH_STACKS_DIR`` (the bootstraps register the
dump signal there) and owns the group's forensic files: the stacks folder,
the socket, a temporary log dir of its own.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from .._cancel import DelayedTask
from .._live._commands import dispatch, status_answer
from .._live._output_clock import OutputClock
from .._live._status import worker_statuses
from .._live._view import LiveView
from .._logs._specs import make_temp_dir, prune_empty_dirs
from .._workers._guardian import clean_up_after
from ._dumper import StackDumper, check_dump_timeout
from ._report import AtFailure, RunReport, Straggler, write_report
from ._sampler import Sampler
from ._stack_sampler import StackSampler
from ._stacks import STACKS_DIR_ENV, StackReport
from ._straggler_watch import StragglerWatch
from ._watcher import StallWatcher

if TYPE_CHECKING:
    import socket
    from collections.abc import AsyncIterator, Callable, Mapping, Sequence
    from contextlib import AbstractAsyncContextManager

    from .._events import Event, EventBus
    from .._group import GroupState
    from .._live._attach import Session
    from .._live._control import ControlServer
    from .._live._status import WorkerStatus
    from .._logs import LogWiring
    from .._results import RunProcsResult
    from ._dumper import Dump
    from ._watchdog import Watchdog

__all__ = ["Forensics"]

logger = logging.getLogger("aiolaunch")

#: Seconds between the last spawn and the group's files and control socket (#26).
SERVE_DELAY = 0.02
#: At a rank's failure, at most this long for the other ranks' stacks.
AT_FAILURE_TIMEOUT = 2.0


class Forensics:
    """Stacks, watchdog, status, control socket and reports of one group.

    :param state: the group.
    :param logs: its streams: where the rank folders are (beside the error
        files), the stderr logs the report quotes, and the output age the
        log pipeline saw.
    :param bus: where :class:`WorkerStalled` goes.
    :param restartable: whether a rank has a restart policy.
    :param metrics: the bound socket of the metrics server (``None``: none);
        owned from here on.
    """

    def __init__(
        self,
        state: GroupState,
        watchdog: Watchdog | None,
        *,
        logs: LogWiring,
        bus: EventBus,
        restartable: Callable[[int], bool],
        metrics: socket.socket | None = None,
    ) -> None:
        self._state = state
        self._bus = bus
        self._error_files = dict(logs.dest.error_files)
        self._stderrs = dict(logs.dest.stderrs)
        log_dir, self._own_dir = _group_dir(getattr(logs.dest, "root", ""), self._error_files)
        self.log_dir = os.path.abspath(log_dir)
        # Made by the first worker that registers for dumps, not by us: a
        # folder costs a mkdir and an rmdir, and ext4 -o discard frees its
        # block synchronously (ms; #26, docs/ARCHITECTURE.md).
        self.stacks_dir = os.path.join(self.log_dir, ".aiolaunch-stacks")
        #: where the group's own small files go (the stop-deadline file)
        self.private_dir = self.log_dir
        if not os.access(self.log_dir, os.W_OK | os.X_OK):
            # A LogsSpecs with an unusual layout may leave no writable group
            # folder: dumps still work from a private one.
            self.stacks_dir = self.private_dir = tempfile.mkdtemp(prefix="aiolaunch_stacks_")
        self.sampler = Sampler(logs.last_output)
        self.dumper = StackDumper(state, self.stacks_dir, self._rank_dir, self.sampler.rebase)
        self.stacks = StackSampler(self.stacks_dir, self.dumper.lock)
        self.watcher: StallWatcher | None = None
        if watchdog is not None:
            self.watcher = StallWatcher(
                watchdog, state, self.sampler, self.dumper, self.stacks, emit=bus.emit,
                restartable=restartable, write_report=lambda: self.write_report(None),
                paused=lambda rank: self.live.attached(rank),
            )  # fmt: skip
        self.stragglers: StragglerWatch | None = None
        if watchdog is not None and watchdog.stragglers is not None:
            self.stragglers = StragglerWatch(
                watchdog.stragglers, state, self.stacks, emit=bus.emit,
                discount=self.sampler.discount,
            )  # fmt: skip
        #: where every live rank was at the group's first failure (watchdog only)
        self.at_failure: AtFailure | None = None
        self.live = LiveView(
            state, self.stacks_dir, self.watcher, metrics,
            straggling=self.stragglers.straggling if self.stragglers is not None else None,
            clock=OutputClock(state, self.sampler, logs.unread, self.dumper.lock),
        )  # fmt: skip
        self._server: ControlServer | None = None
        self._forget_stacks: Callable[[], None] = lambda: None
        self._serving: DelayedTask | None = None
        self._closed = False
        #: the paths of the last report written
        self.reported: tuple[str, str] | None = None

    @property
    def name(self) -> str:
        """The group's name (:class:`~aiolaunch._live._commands.ControlTarget`)."""
        return self._state.name

    @property
    def progress_lines(self) -> StallWatcher | None:
        """With a progress regex, the line listener the group subscribes to its
        log pipeline (the watcher), else ``None``."""
        if self.watcher is not None and self.watcher.watchdog.progress is not None:
            return self.watcher
        return None

    def env(self) -> dict[str, str]:
        """Environment every worker gets."""
        return {STACKS_DIR_ENV: self.stacks_dir}

    # -- lifetime -----------------------------------------------------------
    def start(self, make_files: Callable[[], None] = lambda: None) -> None:
        """Start the watchdog and, in a task of its own, ``make_files()`` (the
        group's files) and the control socket.

        Called once every rank started; the task does its work
        :data:`SERVE_DELAY` later (together ~0.5 ms of CPU, and a wake-up of
        the guardian): not beside the workers just spawned, which on a small
        host share the supervisor's CPU until they run. ``status``/``stacks``
        clients are separate processes, which take far longer to start.
        """
        self._serving = DelayedTask(SERVE_DELAY, functools.partial(self._serve, make_files))
        if self.watcher is not None:
            self.watcher.start()
        if self.stragglers is not None:
            self.stragglers.start()

    async def _serve(self, make_files: Callable[[], None]) -> None:
        from .._live._control import ControlServer

        # The folder (made by the first worker that registers for dumps) is
        # removed by the guardian if the supervisor dies before cleanup().
        self._forget_stacks = clean_up_after("T", self.stacks_dir)
        make_files()
        try:
            self._server = await ControlServer.start(self.log_dir, lambda r: dispatch(self, r))
        except OSError as exc:  # a status endpoint must never stop a job
            logger.warning("aiolaunch: no control socket in %s: %s", self.log_dir, exc)
        from .._live._metrics import render_metrics

        await self.live.start(lambda: render_metrics(status_answer(self)))

    async def stop(self) -> None:
        """Stop the watchdog and the control socket (the group is ending). Idempotent."""
        serving, self._serving = self._serving, None
        if serving is not None:
            # A server still being set up is stopped too (ControlServer.start
            # removes its files when cancelled).
            await serving.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.stragglers is not None:
            await self.stragglers.stop()
        await self.live.stop()
        if self._server is not None:
            # Stop listening now; the socket's files go in cleanup() (file
            # I/O, off wait()'s path).
            self._server.close()

    def conclude(self, result: RunProcsResult) -> None:
        """Write the report if the group failed, then :meth:`cleanup`. Plain
        file I/O on state that no longer changes: safe in a worker thread."""
        if self._closed:  # concluded (or cleaned up) already
            return
        if result.is_failed():
            self.reported = self.write_report(result)
            if self.reported is not None:
                logger.warning(
                    "aiolaunch: group %r failed; report: %s", self._state.name, self.reported[1]
                )
        self.cleanup()

    def cleanup(self) -> None:
        """Remove the control socket's files, the dump scratch folder (and a
        temporary log dir of our own, unless it holds stacks or a report)."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.remove()
            self._server = None
        self.sampler.close()
        self.stacks.close()
        self.live.close()
        _remove_folder(self.stacks_dir)
        self._forget_stacks()
        if self._own_dir and not self.dumper.count and not self.reported:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if self._own_dir:  # gone, or kept with stacks or a report; the guardian forgets it
            prune_empty_dirs([self.log_dir])

    # -- what clients see -----------------------------------------------------
    def status(self) -> list[WorkerStatus]:
        """Every rank's state now (see :class:`WorkerStatus`)."""
        return worker_statuses(self._state, self.sampler, self.live)

    @property
    def started(self) -> float:
        """When the group started (Unix time)."""
        return self.live.started

    @property
    def metrics_url(self) -> str | None:
        """Where the metrics are served (``None``: nowhere)."""
        return self.live.metrics_url

    def events(self) -> AsyncIterator[Event]:
        """The group's lifecycle events, its history first (``ctx.events()``)."""
        return self._bus.iterate()

    def attach(self, rank: int, timeout: float) -> AbstractAsyncContextManager[Session]:
        """A pdb session with ``rank`` (:meth:`LiveView.attach`)."""
        return self.live.attach(rank, timeout)

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

    # -- the first failure -----------------------------------------------------
    async def before_stop(self) -> None:
        """The group is about to be stopped: with a watchdog, when a rank
        failed on its own (a stall's dump is done), every live rank's stacks
        first (:func:`dump_at_failure`), for the report and the summary."""
        if self.watcher is not None and self.at_failure is None:
            self.at_failure = await dump_at_failure(self._state, self.dumper)

    def annotate(self, result: RunProcsResult) -> None:
        """Put where the other ranks were on the first failure's ``others``
        (shown by its ``ChildFailedError`` summary)."""
        a = self.at_failure
        if a is not None and a.rank in result.failures:
            result.failures[a.rank].others = a.lines()

    def write_report(self, result: RunProcsResult | None) -> tuple[str, str] | None:
        """Write ``report.json``/``report.txt`` now (``result``: ``None`` while running)."""
        w = self.watcher
        report = RunReport.build(
            name=self._state.name,
            log_dir=self.log_dir,
            result=result,
            stopped=[h.local_rank for h in self._state.workers() if h.stopped_by_us],
            forced=self._state.forced,
            stderrs=self._stderrs,
            stalls=w.reported_stalls() if w is not None else (),
            verdict=w.verdict if w is not None else None,
            dumps=w.dumps if w is not None else None,
            at_failure=self.at_failure,
            stragglers=[
                Straggler(g.rank, g.wait_share, g.peers_wait_share, g.samples)
                for g in (self.stragglers.named() if self.stragglers is not None else ())
            ],
        )
        return write_report(report)

    # -- files --------------------------------------------------------------
    def _rank_dir(self, rank: int) -> str:
        path = self._error_files.get(rank, "")
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and path != os.devnull and folder != self.log_dir:
            return folder
        # no rank folder (logs to /dev/null, or a flat error file): made now
        d = os.path.join(self.log_dir, str(rank))
        os.makedirs(d, exist_ok=True)
        return d


def _remove_folder(path: str) -> None:
    try:
        os.rmdir(path)  # one rmdir: empty, unless a dump wrote into it
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def _check_ranks(ranks: object, nprocs: int) -> None:
    if ranks is not None and not isinstance(ranks, list | tuple | set | frozenset | range):
        raise TypeError(f"dump_stacks(ranks={ranks!r}) must be a list of local ranks or None")
    bad = [r for r in ranks or () if isinstance(r, bool) or r not in range(nprocs)]
    if bad:
        raise ValueError(f"dump_stacks(ranks={ranks!r}): local ranks are 0..{nprocs - 1}")


def _group_dir(root: str, error_files: Mapping[int, str]) -> tuple[str, bool]:
    # The folder holding the rank folders: {log_dir} in aiolaunch's layout,
    # {run}/attempt_N in torch's. Without one (logs to /dev/null), our own.
    if root:
        return root, False
    for path in error_files.values():
        if path and path != os.devnull:
            return os.path.dirname(os.path.dirname(path)), False
    return make_temp_dir("aiolaunch_forensics_"), True


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
