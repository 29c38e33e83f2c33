"""Live observation of a running group: the metrics server, attach sessions, status marks.

One :class:`LiveView` per group, owned by its :class:`~aiolaunch._hangs._forensics.Forensics`
and started and stopped with the control socket:

- the Prometheus endpoint (``metrics_port``): a :class:`~aiolaunch._live._metrics.MetricsServer`
  on the socket bound by ``start_processes`` (before any worker started, so
  a port in use is an error at the call), serving the same snapshot as the
  ``status`` command;
- ``aiolaunch attach`` sessions: at most one per rank; while one is open the
  rank is marked ``attached`` and the watchdog leaves it alone (a rank at a
  pdb prompt has no output and no CPU, and is no hang);
- the marks of a status row (:class:`~aiolaunch._live._status.RankMarks`): the
  watchdog's stalls and step rate, stragglers, attach sessions;
- the output age of ranks whose streams nobody reads (an
  :class:`~aiolaunch._live._output_clock.OutputClock`, run from :meth:`LiveView.start`
  to :meth:`LiveView.stop`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socket
    from collections.abc import AsyncIterator, Callable

    from .._group import GroupState
    from .._hangs._watcher import StallWatcher
    from ._attach import Session
    from ._metrics import MetricsServer
    from ._output_clock import OutputClock

__all__ = ["LiveView"]

logger = logging.getLogger("aiolaunch")


class LiveView:
    """Metrics, attach sessions and status marks of one group (see the module docstring).

    :param metrics: the bound metrics socket (``None``: no metrics); owned
        from here on, closed by :meth:`stop` or :meth:`close`.
    :param straggling: whether a rank is named a straggler now (the
        straggler detection's own flag; none: never).
    :param clock: keeps the output age of unread ranks current while the
        view is live.
    """

    def __init__(
        self,
        state: GroupState,
        stacks_dir: str,
        watcher: StallWatcher | None,
        metrics: socket.socket | None = None,
        straggling: Callable[[int], bool] | None = None,
        clock: OutputClock | None = None,
    ) -> None:
        self._state = state
        self._stacks_dir = stacks_dir
        self._watcher = watcher
        self._metrics_sock = metrics
        self._metrics: MetricsServer | None = None
        self._attached: set[int] = set()
        self._straggling = straggling
        self._clock = clock
        #: when the group started (Unix time; set by :meth:`start`)
        self.started = time.time()

    # -- lifetime ---------------------------------------------------------------
    async def start(self, collect: Callable[[], str]) -> None:
        """Serve the metrics (if asked for): ``collect()`` gives the exposition text."""
        self.started = time.time()
        if self._clock is not None:
            self._clock.start()
        sock, self._metrics_sock = self._metrics_sock, None
        if sock is None:
            return
        from ._metrics import MetricsServer

        try:
            self._metrics = await MetricsServer.start(sock, collect)
        except OSError as exc:  # a metrics endpoint must never stop a job
            logger.warning("aiolaunch: no metrics server: %s", exc)

    async def stop(self) -> None:
        """Stop serving metrics; end open scrapes. Idempotent."""
        if self._clock is not None:
            await self._clock.stop()
        self.close()
        if self._metrics is not None:
            server, self._metrics = self._metrics, None
            await server.aclose()

    def close(self) -> None:
        """Close the metrics socket (also one never served). Idempotent."""
        if self._metrics_sock is not None:
            self._metrics_sock.close()
            self._metrics_sock = None
        if self._metrics is not None:
            self._metrics.close()

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` while metrics are served, else ``None``."""
        return None if self._metrics is None else self._metrics.url

    # -- attach -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def attach(self, rank: int, timeout: float) -> AsyncIterator[Session]:
        """A pdb session with ``rank``'s process, open for the ``async with`` block.

        :raises AttachError: no such live rank, one session is open already,
            or the rank cannot be attached to (the message says why).
        """
        from ._attach import AttachError, open_session

        if not 0 <= rank < self._state.nprocs:
            raise AttachError(f"rank {rank}: local ranks are 0..{self._state.nprocs - 1}")
        w = self._state.worker(rank)
        if w is None or not w.alive or self._state.restarting(rank):
            raise AttachError(f"rank {rank} is not running")
        if rank in self._attached:
            raise AttachError(f"rank {rank} has an attach session open already")
        self._attached.add(rank)
        try:
            session = await open_session(self._stacks_dir, w.pid, timeout)
            try:
                yield session
            finally:
                session.writer.close()
        finally:
            self._attached.discard(rank)

    # -- RankMarks ------------------------------------------------------------------
    def stalled(self, rank: int) -> bool:
        """Whether the watchdog flags ``rank`` now."""
        return self._watcher is not None and self._watcher.stalled(rank)

    def stalls(self, rank: int) -> int:
        """How many times the watchdog flagged ``rank``."""
        return 0 if self._watcher is None else self._watcher.stall_count(rank)

    def steps(self, rank: int, now: float) -> tuple[int, float] | None:
        """Progress lines of ``rank`` and their rate; ``None`` without a regex."""
        return None if self._watcher is None else self._watcher.steps(rank, now)

    def straggling(self, rank: int) -> bool:
        """Whether ``rank`` is named a straggler now."""
        return self._straggling is not None and self._straggling(rank)

    def attached(self, rank: int) -> bool:
        """Whether an attach session holds ``rank`` now."""
        return rank in self._attached
