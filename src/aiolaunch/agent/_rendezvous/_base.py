"""The interface every rendezvous implements (:class:`Rendezvous`).

Its own module so that the implementations (:mod:`._static`, :mod:`._torch`)
and the package's :func:`~aiolaunch.agent._rendezvous.resolve`, which picks
one of them, do not import each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._env import GroupAssignment

__all__ = ["Rendezvous"]


class Rendezvous(ABC):
    """One agent's view of a rendezvous."""

    #: whether :meth:`num_nodes_waiting` can ever be non-zero (a torch backend);
    #: the agent only watches membership when it can.
    elastic: bool = False

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
