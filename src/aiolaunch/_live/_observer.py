"""The live view of one group: :class:`LiveObserver`: control socket, metrics, attach sessions.

The context holds one :class:`LiveObserver` (a
:class:`~aiolaunch._observer.GroupObserver`), started once every rank runs
and stopped when the group's end begins:

- the control socket ``{log_dir}/control.sock``
  (:class:`~aiolaunch._live._control.ControlServer`), serving the command
  table of :mod:`aiolaunch._live._commands` with this object as its target
  (:class:`~aiolaunch._live._commands.ControlTarget`);
- the Prometheus endpoint (``metrics_port``): a
  :class:`~aiolaunch._live._metrics.MetricsEndpoint` on the socket bound by
  ``start_processes`` (before any worker started, so a port in use is an
  error at the call) or by the elastic agent for its whole run, showing the
  same snapshot as the ``status`` command while the group runs;
- ``aiolaunch attach`` sessions: at most one per rank; while one is open the
  group's state marks the rank attached (the watchdog leaves it alone: a rank
  at a pdb prompt has no output and no CPU, and is no hang).

What it shows of the group comes from three calls it is given - the
status rows, a round of stack dumps, the event history - never from the
other observers' parts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING

from .._cancel import DelayedTask
from .._observer import GroupObserver
from ._commands import dispatch, status_answer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

    from .._events import Event
    from .._group import GroupState
    from .._hangs._dumper import Dump
    from .._logs._folder import GroupFolder
    from .._results import RunProcsResult
    from ._attach import Session
    from ._control import ControlServer
    from ._metrics import MetricsEndpoint
    from ._status import WorkerStatus

__all__ = ["SERVE_DELAY", "LiveObserver"]

logger = logging.getLogger("aiolaunch")

#: Seconds between the last spawn and the control socket and metrics.
SERVE_DELAY = 0.02


class LiveObserver(GroupObserver):
    """The control socket, metrics and attach sessions of one group (see the module docstring).

    :param state: the group.
    :param folder: where ``control.sock`` goes (and attach sockets, beside the dumps).
    :param metrics: where the group's metrics are shown (``None``: no metrics).
    :param owns_metrics: the endpoint is the group's own: closed with it
        (else the job's: only the group's showing ends with it).
    :param status: every rank's status row now (``PContext.status``).
    :param dump: a round of stack dumps of some ranks (``None``: all).
    :param events: the group's lifecycle events, history first.
    """

    def __init__(
        self,
        state: GroupState,
        folder: GroupFolder,
        metrics: MetricsEndpoint | None,
        *,
        owns_metrics: bool = True,
        status: Callable[[], list[WorkerStatus]],
        dump: Callable[[Sequence[int] | None, float], Awaitable[Dump]],
        events: Callable[[], AsyncIterator[Event]],
        earlier: Sequence[Event] = (),
    ) -> None:
        self._state = state
        self._folder = folder
        #: the events of the job's earlier attempts (see ``JobAttempt.history``)
        self.earlier = earlier
        self._metrics = metrics
        self._owns_metrics = owns_metrics
        self._unshow: Callable[[], None] = lambda: None
        self._status = status
        self._dump = dump
        self._events = events
        self._server: ControlServer | None = None
        self._serving: DelayedTask | None = None
        self._concluded = False
        #: when the group started (Unix time; set when it is served)
        self.started = time.time()

    # -- GroupObserver ------------------------------------------------------------
    def group_started(self) -> None:
        """Serve the control socket and metrics :data:`SERVE_DELAY` later, in a
        task of its own: not beside the workers just spawned, which on a small
        host share the supervisor's CPU until they run (``status``/``top``
        clients are separate processes, which take far longer to start)."""
        self._serving = DelayedTask(SERVE_DELAY, functools.partial(self._serve))

    async def aclose(self) -> None:
        """Stop listening and serving metrics; end open scrapes. Idempotent."""
        serving, self._serving = self._serving, None
        if serving is not None:
            # A server still being set up is stopped too (ControlServer.start
            # removes its files when cancelled).
            await serving.stop()
        self._unshow()
        if self._metrics is not None and self._owns_metrics:
            await self._metrics.aclose()
        if self._server is not None:
            # Stop listening now; the socket's files go in conclude() (file
            # I/O, off wait()'s path).
            self._server.close()

    def conclude(self, result: RunProcsResult) -> None:
        """Remove the control socket's files; close what is left. Idempotent."""
        if self._concluded:
            return
        self._concluded = True
        if self._server is not None:
            self._server.remove()
            self._server = None
        self._unshow()
        if self._metrics is not None and self._owns_metrics:
            self._metrics.close()  # also an endpoint never served (a group that ended at once)

    async def _serve(self) -> None:
        from ._control import ControlServer

        self.started = time.time()
        try:
            self._server = await ControlServer.start(self.log_dir, lambda r: dispatch(self, r))
        except OSError as exc:  # a status endpoint must never stop a job
            logger.warning("aiolaunch: no control socket in %s: %s", self.log_dir, exc)
        if self._metrics is None:
            return
        from ._metrics import render_metrics

        await self._metrics.serve()
        self._unshow = self._metrics.show(lambda: render_metrics(status_answer(self)))

    # -- ControlTarget: what a command sees ---------------------------------------
    @property
    def name(self) -> str:
        """The group's name."""
        return self._state.name

    @property
    def log_dir(self) -> str:
        """The folder holding the rank folders and ``control.sock``."""
        return self._folder.path

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` while metrics are served, else ``None``."""
        metrics = self._metrics
        return metrics.url if metrics is not None and metrics.serving else None

    def status(self) -> list[WorkerStatus]:
        """Every rank's state now."""
        return self._status()

    async def dump(self, ranks: Sequence[int] | None, timeout: float) -> Dump:
        """A round of stack dumps of ``ranks`` (all: ``None``)."""
        return await self._dump(ranks, timeout)

    def events(self) -> AsyncIterator[Event]:
        """The group's lifecycle events, history first, until it stops."""
        return self._events()

    @contextlib.asynccontextmanager
    async def attach(self, rank: int, timeout: float) -> AsyncIterator[Session]:
        """A pdb session with ``rank``'s process, open for the ``async with`` block.

        :raises AttachError: no such live rank, one session is open already,
            or the rank cannot be attached to (the message says why).
        """
        from ._attach import AttachError, open_session

        state = self._state
        if not 0 <= rank < state.nprocs:
            raise AttachError(f"rank {rank}: local ranks are 0..{state.nprocs - 1}")
        w = state.worker(rank)
        if w is None or not w.alive or state.restarting(rank):
            raise AttachError(f"rank {rank} is not running")
        if state.attached(rank):
            raise AttachError(f"rank {rank} has an attach session open already")
        state.attach_begun(rank)
        try:
            session = await open_session(self._folder.stacks_dir, w.pid, timeout)
            try:
                yield session
            finally:
                session.writer.close()
        finally:
            state.attach_ended(rank)
