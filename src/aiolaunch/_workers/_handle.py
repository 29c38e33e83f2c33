from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from ._processes import signal_tree

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["WorkerHandle"]


class WorkerHandle:
    """One worker process, as the supervisor sees it.

    ``exited`` is set, and ``on_exit`` called, on the event-loop thread as soon
    as the exit is known - never later because a pipe is still open.
    """

    #: the worker writes its own Python exception to its error file (function
    #: workers, scripts run by the bootstrap): a failure without one died
    #: without a Python exception
    records_exceptions = False
    #: its error file (``$TORCHELASTIC_ERROR_FILE``; ``""``: none): written
    #: since it started, it was failing on its own when stopped (terminate())
    error_file = ""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank
        self.pid = 0
        self.returncode: int | None = None
        self.exited = asyncio.Event()
        #: set when the supervisor signalled it: such an exit is not a failure
        self.stopped_by_us = False
        #: function workers: the value sent back before exit
        self.return_value: Any = None
        self._failure_reason: str | None = None
        self.on_exit: Callable[[WorkerHandle], None] | None = None
        #: restart count of this rank when this process was started
        self.attempt = 0
        #: ``time.time()`` when the exit was detected (a failure's timestamp)
        self.exit_time: float | None = None

    @property
    def alive(self) -> bool:
        return self.returncode is None

    @property
    def failure_reason(self) -> str | None:
        """Why this incarnation's exit counts as a failure whatever its exit code
        (:meth:`fail`); ``None``: its exit code decides."""
        return self._failure_reason

    def fail(self, reason: str) -> None:
        """Record that this incarnation failed, and why: a clean exit still
        counts as a failure (a function worker that sent no result, a spent
        restart budget, a stall, a restart that could not start). The first
        reason wins: it names the cause, later ones its consequences."""
        if self._failure_reason is None:
            self._failure_reason = reason

    def set_exited(self, returncode: int) -> None:
        """Record the exit (called once by the spawner's exit reader; later calls
        are ignored): set :attr:`exited` and call :attr:`on_exit`, on the loop."""
        if self.returncode is not None:
            return
        self.returncode = returncode
        self.exit_time = time.time()
        self.exited.set()
        if self.on_exit is not None:
            self.on_exit(self)

    def signal_tree(self, sig: int, extra: set[int] | frozenset[int] = frozenset()) -> None:
        """Signal the worker's process group and ``extra`` descendants."""
        signal_tree(self.pid, sig, leader_alive=self.alive, extra=extra)

    def release(self) -> None:
        """Free OS resources held for an exited worker. Idempotent."""

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited({self.returncode})"
        return f"<{type(self).__name__} rank={self.local_rank} pid={self.pid} {state}>"
