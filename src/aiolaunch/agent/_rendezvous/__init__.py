"""How agents agree on a world: the small async interface the agent talks to.

Two implementations sit behind it:

- :mod:`._static`: one machine, no torch, nothing to wait for.
- :mod:`._torch`: adapts a torch ``RendezvousHandler`` (c10d over a TCPStore,
  etcd, static TCP, ...); its blocking calls run in worker threads so the
  event loop stays responsive. With :mod:`._etcd_v3` (loaded only from it,
  or by torch itself), the only modules allowed to import torch.
"""

from __future__ import annotations

from typing import Any

from .._env import GroupAssignment
from ._base import Rendezvous, SpareReleased

__all__ = ["GroupAssignment", "Rendezvous", "SpareReleased", "resolve"]


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
