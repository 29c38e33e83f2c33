"""Single-machine rendezvous: no torch, no store, nothing to wait for."""

from __future__ import annotations

import uuid

from ..._api import free_port
from .._env import GroupAssignment
from ._base import Rendezvous

__all__ = ["StaticRendezvous", "free_port"]

DEFAULT_MASTER_ADDR = "127.0.0.1"


class StaticRendezvous(Rendezvous):
    """The whole world is this machine: group rank 0 of 1.

    There is no agent-hosted store (``TORCHELASTIC_USE_AGENT_STORE=False``),
    so ``torch.distributed``'s ``env://`` rendezvous makes worker rank 0 host
    the TCPStore on ``MASTER_PORT``.

    :param run_id: ``TORCHELASTIC_RUN_ID``; ``None``: a fresh UUID (what
        ``torchrun --standalone`` does).
    :param master_addr: ``MASTER_ADDR``; ``None``: ``local_addr`` or ``127.0.0.1``.
    :param master_port: ``MASTER_PORT``; ``None``: a free port, picked anew
        for every attempt.
    :param local_addr: this machine's address (used when ``master_addr`` is None).
    """

    def __init__(
        self,
        run_id: str | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        local_addr: str | None = None,
    ) -> None:
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(f"run_id={run_id!r} must be a non-empty str, or None for a UUID")
        if master_port is not None and (
            not isinstance(master_port, int) or not 0 < master_port < 65536
        ):
            raise ValueError(f"master_port={master_port!r} must be an int in 1..65535, or None")
        self._run_id = run_id or str(uuid.uuid4())
        self._master_addr = master_addr or local_addr or DEFAULT_MASTER_ADDR
        self._master_port = master_port

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def auto_port(self) -> bool:
        """Whether ``MASTER_PORT`` is ours to pick (none was given): any free port will do."""
        return self._master_port is None

    async def next_rendezvous(
        self,
        *,
        role: str,
        local_world_size: int,
        master_addr: str | None,
        master_port: int | None,
    ) -> GroupAssignment:
        addr = master_addr or self._master_addr
        port = master_port or self._master_port or free_port()
        return GroupAssignment(
            group_rank=0,
            group_world_size=1,
            base_global_rank=0,
            global_world_size=local_world_size,
            base_role_rank=0,
            role_world_size=local_world_size,
            master_addr=addr,
            master_port=port,
            run_id=self._run_id,
            use_agent_store=False,
        )

    def __repr__(self) -> str:
        return (
            f"StaticRendezvous(run_id={self._run_id!r}, master_addr={self._master_addr!r}, "
            f"master_port={self._master_port!r})"
        )
