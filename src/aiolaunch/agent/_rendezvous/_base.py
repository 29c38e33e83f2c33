"""The interface every rendezvous implements (:class:`Rendezvous`).

Its own module so that the implementations (:mod:`._static`, :mod:`._torch`)
and the package's :func:`~aiolaunch.agent._rendezvous.resolve`, which picks
one of them, do not import each other.
"""

from __future__ import annotations

import asyncio
import socket
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from .._ledger import LocalLedger

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._env import GroupAssignment
    from .._ledger import Ledger
    from .._quarantine import QuarantinePolicy

#: the slowest pace of the membership check (``num_nodes_waiting``), seconds
MEMBERSHIP_POLL_MIN = 1.0

__all__ = ["Rendezvous", "SpareReleased"]


class SpareReleased(Exception):
    """The job ended while this agent waited as a spare: it was not needed
    (not a failure; torch's ``RendezvousGracefulExitError``)."""


class Rendezvous(ABC):
    """One agent's view of a rendezvous."""

    #: whether :meth:`num_nodes_waiting` can ever be non-zero (a torch backend);
    #: the agent only watches membership when it can.
    elastic: bool = False
    #: whether the rendezvous runs the agent's health check itself, before
    #: each round it joins (aiolaunch's rounds); else the agent runs it first
    admits: bool = False

    _local_ledger: LocalLedger | None = None

    @property
    def ledger(self) -> Ledger:
        """The job's records (restarts, progress, hosts): in memory here; in the
        rendezvous store with aiolaunch's rounds."""
        if self._local_ledger is None:
            self._local_ledger = LocalLedger()
        return self._local_ledger

    @property
    def node_id(self) -> str:
        """This agent's name in the job's records."""
        return f"{self.host}_{id(self)}"

    @property
    def host(self) -> str:
        """This agent's host, as the job's records name it."""
        return socket.gethostname()

    def configure(  # noqa: B027 - optional hook
        self,
        *,
        quarantine: QuarantinePolicy | None = None,
        admit: Callable[[], str | None] | None = None,
    ) -> None:
        """The quarantine policy and the admission check (see :attr:`admits`)."""

    def hosts(self) -> dict[str, Any] | None:
        """What the live view shows of the job's hosts, or ``None`` (one machine)."""
        return None

    async def membership_changed(self, interval: float) -> str:
        """Return, with why, once the running round must re-form; never, if it cannot.

        Here: torch's way, ``num_nodes_waiting()`` every ``interval`` seconds
        (at least one).
        """
        if not self.elastic:
            await asyncio.Event().wait()
        interval = max(interval, MEMBERSHIP_POLL_MIN)
        while True:
            await asyncio.sleep(interval)  # allowed: torch offers no event for joining nodes
            waiting = await self.num_nodes_waiting()
            if waiting > 0:
                return f"{waiting} new node(s) waiting to join"

    async def leave(self) -> None:  # noqa: B027 - optional hook
        """This agent goes for good (a signal): let the others know now."""

    @property
    @abstractmethod
    def run_id(self) -> str:
        """``TORCHELASTIC_RUN_ID``."""

    @abstractmethod
    async def next_rendezvous(
        self,
        *,
        role: str,
        local_world_size: int,
        master_addr: str | None,
        master_port: int | None,
    ) -> GroupAssignment:
        """Join the next round and return this agent's rank block.

        ``master_addr``/``master_port`` (from the spec) override what the
        rendezvous would choose.
        """

    async def num_nodes_waiting(self) -> int:
        """Agents waiting to join (a membership change); 0 when not elastic."""
        return 0

    async def exit_barrier(self, timeout: float) -> None:  # noqa: B027 - optional hook
        """Wait (up to ``timeout``) until every agent's group has finished."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Close the rendezvous for good (after the last attempt)."""
