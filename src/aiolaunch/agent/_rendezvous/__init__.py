"""How agents agree on a world: the small async interface the agent talks to.

Two implementations sit behind it:

- :mod:`._static`: one machine, no torch, nothing to wait for.
- :mod:`._torch`: adapts a torch ``RendezvousHandler`` (c10d over a TCPStore,
  etcd, static TCP, ...); its blocking calls run in worker threads so the
  event loop stays responsive. With :mod:`._etcd_v3` (loaded only from it,
  or by torch itself), the only modules allowed to import torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from .._env import GroupAssignment

__all__ = ["GroupAssignment", "Rendezvous", "resolve"]


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


def resolve(handler: Any, *, local_addr: str | None = None) -> Rendezvous:
    """Wrap ``WorkerSpec.rdzv_handler`` in the interface.

    ``None`` → a single-machine :class:`StaticRendezvous`; an instance of it
    → itself; anything else must be a torch ``RendezvousHandler``.
    """
    from ._static import StaticRendezvous

    if handler is None:
        return StaticRendezvous(local_addr=local_addr)
    if isinstance(handler, Rendezvous):
        return handler
    if all(hasattr(handler, m) for m in ("next_rendezvous", "get_run_id", "num_nodes_waiting")):
        from ._torch import TorchRendezvous

        return TorchRendezvous(handler)
    raise TypeError(
        f"rdzv_handler={handler!r} is neither None (one machine), a StaticRendezvous, "
        "nor a torch RendezvousHandler (torch.distributed.elastic.rendezvous)"
    )
