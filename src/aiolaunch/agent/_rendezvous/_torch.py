"""torch's rendezvous behind the agent's async interface.

The only module of aiolaunch that imports torch, and only inside functions,
so that ``import aiolaunch.agent`` stays torch-free. Every torch call here
blocks (TCPStore round trips, the c10d rendezvous' own waiting), so each runs
in a worker thread via :func:`anyio.to_thread.run_sync`.

Rank assignment speaks torch's store protocol (``torchelastic/role_info/``,
``torchelastic/assigned_ranks/``, ``torchelastic/agent/terminal_state``), so
aiolaunch agents and torchrun agents can share one rendezvous.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from .._env import GroupAssignment
from ._base import Rendezvous, SpareReleased

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._ledger import Ledger
    from .._quarantine import QuarantinePolicy

__all__ = ["TorchRendezvous", "accelerator_count", "create_handler", "require_torch"]

log = logging.getLogger("aiolaunch.agent")

_ROLE_INFO_PREFIX = "torchelastic/role_info/"
_ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"
_TERMINAL_STATE_SYNC_ID = "torchelastic/agent/terminal_state"
#: torch's LaunchConfig default for the rendezvous ``timeout`` config (seconds)
_DEFAULT_RDZV_TIMEOUT = 900


def require_torch(what: str) -> Any:
    """Import torch, or explain how to get it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            f"{what} needs torch, which is not installed; install it with "
            "pip install 'aiolaunch[torch]'"
        ) from exc
    return torch


def create_handler(
    *,
    backend: str,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str | None = None,
    **config: Any,
) -> Any:
    """Build a torch ``RendezvousHandler`` the way torchrun does.

    ``RendezvousParameters`` + ``rendezvous.registry`` (c10d, etcd, static, and
    any backend registered by a plugin); ``timeout`` defaults to 900 s as in
    torch's ``LaunchConfig``.
    """
    require_torch(f"the {backend!r} rendezvous backend")
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    if backend == "etcd-v3":
        from ._etcd_v3 import register

        register()  # also done by the torchrun.handlers entry point, when installed
    config.setdefault("timeout", _DEFAULT_RDZV_TIMEOUT)
    params = RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=local_addr,
        **config,
    )
    if backend == "c10d" and config.get("store_type", "tcp") == "tcp":
        return _c10d_handler(params)
    return rdzv_registry.get_rendezvous_handler(params)


def _c10d_handler(params: Any) -> Any:
    """torch's c10d handler, but whether this agent hosts the TCPStore is decided
    from this machine's interface addresses too, not only its host name.

    torch compares the endpoint with the host name and what it resolves to,
    so two hosts that share a host name (containers, network namespaces) or a
    host reached by an address its name does not resolve to never host the
    store: every agent waits as a client until the rendezvous times out
    unless ``is_host`` is given. Here an endpoint address that this machine
    can bind (:func:`is_local_address`) also makes it the host; as in torch,
    a host that finds the port taken (another agent of the same machine got
    there first) joins as a client - unless ``is_host`` was told.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        DEFAULT_PORT,
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.utils import (
        _matches_machine_hostname,
        parse_rendezvous_endpoint,
    )

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    told = params.get_as_bool("is_host")
    is_host = is_local_address(host) or _matches_machine_hostname(host) if told is None else told
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    store: Any = None
    for is_server in [is_host] if told is not None else dict.fromkeys([is_host, False]):
        try:
            store = TCPStore(
                host,
                port,
                is_master=is_server,
                multi_tenant=True,
                timeout=timedelta(seconds=read_timeout),
            )
        except (ValueError, RuntimeError, TimeoutError) as exc:
            if not is_server:
                raise RendezvousConnectionError(
                    f"cannot reach the c10d store at {host}:{port}: {exc}"
                ) from exc
            continue
        if is_server:
            log.info("this agent hosts the c10d rendezvous store on %s:%d", host, port)
        break
    backend = C10dRendezvousBackend(store, params.run_id)
    from ._rounds import create_rounds_handler

    return create_rounds_handler(store, backend, params)


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine: loopback, or an address this machine
    can bind (one of its interfaces' addresses; the kernel knows them all).

    With ``net.ipv4.ip_nonlocal_bind=1`` any address binds, so only loopback
    counts there.
    """
    import ipaddress
    import socket

    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    from ..._workers._proc import sysctl

    nonlocal_bind = sysctl("net/ipv4/ip_nonlocal_bind") == "1"
    for family, _, _, _, sockaddr in infos:
        addr = str(sockaddr[0])
        try:
            if ipaddress.ip_address(addr.partition("%")[0]).is_loopback:
                return True
        except ValueError:
            continue
        if nonlocal_bind:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((addr, 0, *sockaddr[2:]))
            except OSError:
                continue
            return True
    return False


def accelerator_count(kind: str) -> tuple[int, str]:
    """``(count, device type)`` for ``--nproc-per-node gpu|xpu|auto`` (torch's rules)."""
    torch = require_torch(f"--nproc-per-node {kind}")
    if kind == "gpu":
        if not torch.cuda.is_available():
            raise ValueError("--nproc-per-node gpu: CUDA is not available; pass a number")
        return int(torch.cuda.device_count()), "gpu"
    if kind == "xpu":
        if not torch.xpu.is_available():
            raise ValueError("--nproc-per-node xpu: XPU is not available; pass a number")
        return int(torch.xpu.device_count()), "xpu"
    if kind == "auto" and torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        return int(torch.accelerator.device_count()), str(getattr(acc, "type", "accelerator"))
    raise ValueError(f"no accelerator kind {kind!r}")


class TorchRendezvous(Rendezvous):
    """Adapts a torch ``RendezvousHandler`` (blocking) to :class:`Rendezvous` (async).

    The store the handler returns stays referenced here for the agent's
    lifetime: with c10d it is the TCPStore the workers connect to
    (``TORCHELASTIC_USE_AGENT_STORE=True``).
    """

    elastic = True

    def __init__(self, handler: Any) -> None:
        self._handler = handler
        self._store: Any = None
        self._group_world_size = 1
        #: aiolaunch's rounds (``_rounds.RoundsHandler``): spares, liveness, records
        self._rounds = callable(getattr(handler, "watch", None))
        self.admits = self._rounds

    @property
    def ledger(self) -> Ledger:
        if self._rounds:
            ledger: Ledger = self._handler.ledger
            return ledger
        return super().ledger

    @property
    def host(self) -> str:
        return str(self._handler.host) if self._rounds else super().host

    @property
    def node_id(self) -> str:
        return str(self._handler.node_id) if self._rounds else super().node_id

    def configure(
        self,
        *,
        quarantine: QuarantinePolicy | None = None,
        admit: Callable[[], str | None] | None = None,
    ) -> None:
        if self._rounds:
            self._handler.configure(quarantine=quarantine, admit=admit)

    def hosts(self) -> dict[str, Any] | None:
        if not self._rounds:
            return None
        section: dict[str, Any] = self._handler.hosts()
        return section

    async def membership_changed(self, interval: float) -> str:
        if not self._rounds:
            return await super().membership_changed(interval)
        stop = threading.Event()
        try:
            reason = await anyio.to_thread.run_sync(
                self._handler.watch, stop.is_set, abandon_on_cancel=True
            )
        finally:
            stop.set()
            self._handler.wake()
        if reason is None:  # the job is ending: the workers' exits decide
            await asyncio.Event().wait()
        return str(reason)

    async def leave(self) -> None:
        if self._rounds:
            await anyio.to_thread.run_sync(self._handler.leave, abandon_on_cancel=True)

    @property
    def handler(self) -> Any:
        """The wrapped torch handler."""
        return self._handler

    @property
    def run_id(self) -> str:
        return str(self._handler.get_run_id())

    async def next_rendezvous(
        self,
        *,
        role: str,
        local_world_size: int,
        master_addr: str | None,
        master_port: int | None,
    ) -> GroupAssignment:
        # One thread hop for the whole exchange: the handler's rendezvous and
        # the rank assignment through its store are a sequence of blocking
        # store round trips. abandon_on_cancel: a cancelled agent (a signal)
        # must not wait for a rendezvous that may never complete.
        return await anyio.to_thread.run_sync(
            self._next_rendezvous_blocking,
            role,
            local_world_size,
            master_addr,
            master_port,
            abandon_on_cancel=True,
        )

    def _next_rendezvous_blocking(
        self, role: str, local_world_size: int, master_addr: str | None, master_port: int | None
    ) -> GroupAssignment:
        from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

        try:
            info = self._handler.next_rendezvous()
        except RendezvousGracefulExitError as exc:
            raise SpareReleased(str(exc)) from None
        store = info.store
        group_rank = int(info.rank)
        group_world_size = int(info.world_size)
        bootstrap = info.bootstrap_store_info
        if bootstrap is not None and bool(getattr(self._handler, "use_agent_store", False)):
            bootstrap = _share_bootstrap(store, group_rank, bootstrap)
        addr = master_addr or (bootstrap.master_addr if bootstrap is not None else None)
        port = master_port or (bootstrap.master_port if bootstrap is not None else None)
        if addr is None or port is None:
            raise RuntimeError(
                f"the {self._handler.get_backend()!r} rendezvous gave no master address/port; "
                "pass master_addr and master_port in the WorkerSpec"
            )
        self._store = store
        self._group_world_size = group_world_size
        base_global, global_size, base_role, role_size = _assign_ranks(
            store, group_rank, group_world_size, role, local_world_size
        )
        return GroupAssignment(
            group_rank=group_rank,
            group_world_size=group_world_size,
            base_global_rank=base_global,
            global_world_size=global_size,
            base_role_rank=base_role,
            role_world_size=role_size,
            master_addr=str(addr),
            master_port=int(port),
            run_id=self.run_id,
            use_agent_store=bool(self._handler.use_agent_store),
            rdzv_round=int(getattr(self._handler, "round", 0)),
        )

    async def num_nodes_waiting(self) -> int:
        n = await anyio.to_thread.run_sync(self._handler.num_nodes_waiting, abandon_on_cancel=True)
        return int(n)

    async def exit_barrier(self, timeout: float) -> None:
        if self._store is None:
            return
        await anyio.to_thread.run_sync(self._exit_barrier_blocking, timeout, abandon_on_cancel=True)

    def _exit_barrier_blocking(self, timeout: float) -> None:
        from torch.distributed.elastic.utils import store as store_util

        try:
            store_util.barrier(
                store=self._store,
                world_size=self._group_world_size,
                key_prefix=_TERMINAL_STATE_SYNC_ID,
                barrier_timeout=timeout,
            )
        except Exception:
            # As torch: a barrier that times out (another node is slow or
            # gone) is logged; this node's own result stands.
            log.exception("error waiting on the exit barrier (timeout %ss)", timeout)

    async def shutdown(self) -> None:
        await anyio.to_thread.run_sync(self._handler.shutdown, abandon_on_cancel=True)

    def __repr__(self) -> str:
        return f"TorchRendezvous({self._handler!r})"


def _share_bootstrap(store: Any, group_rank: int, info: Any) -> Any:
    """The workers' store address of this round, the same on every node.

    torch's dynamic rendezvous (2.13) computes it in a node's first round and
    caches it: a node that joins a *later* round (``--nnodes MIN:MAX``, a
    scale-up) waits for it under that round's keys, which the cached rank 0
    never writes (the join hangs), and a node whose rank moved keeps a stale
    one. So the node of group rank 0 publishes it in every round, and the
    others read it from there.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    addr_key, port_key = RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY
    if group_rank == 0:
        store.set(addr_key, str(info.master_addr).encode())
        store.set(port_key, str(info.master_port).encode())
        return info
    addr = bytes(store.get(addr_key)).decode()
    port = int(bytes(store.get(port_key)).decode())
    return RendezvousStoreInfo(master_addr=addr, master_port=port)


def _assign_ranks(
    store: Any, group_rank: int, group_world_size: int, role: str, local_world_size: int
) -> tuple[int, int, int, int]:
    """``(base_global_rank, global_world_size, base_role_rank, role_world_size)``.

    torch's ``SimpleElasticAgent._assign_worker_ranks``, same keys and JSON:
    every agent publishes ``{role, rank, local_world_size}``; the agent of
    group rank 0 (next to the TCPStore) computes contiguous blocks in group
    rank order and publishes them; everyone reads its own block.
    """
    if os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":
        size = group_world_size * local_world_size
        base = group_rank * local_world_size
        return base, size, base, size
    info = {"role": role, "rank": group_rank, "local_world_size": local_world_size}
    store.set(f"{_ROLE_INFO_PREFIX}{group_rank}", json.dumps(info).encode("utf-8"))
    if group_rank == 0:
        raw = store.multi_get([f"{_ROLE_INFO_PREFIX}{i}" for i in range(group_world_size)])
        infos = [json.loads(bytes(b).decode("utf-8")) for b in raw]
        role_sizes: dict[str, int] = defaultdict(int)
        global_size = 0
        for ri in infos:
            role_sizes[ri["role"]] += ri["local_world_size"]
            global_size += ri["local_world_size"]
        keys: list[str] = []
        values: list[str] = []
        base_global = 0
        role_ranks: dict[str, int] = defaultdict(int)
        for i, ri in enumerate(infos):
            keys.append(f"{_ASSIGNED_RANKS_PREFIX}{i}")
            values.append(
                json.dumps(
                    [base_global, global_size, role_ranks[ri["role"]], role_sizes[ri["role"]]]
                )
            )
            base_global += ri["local_world_size"]
            role_ranks[ri["role"]] += ri["local_world_size"]
        store.multi_set(keys, values)
    # get() blocks until rank 0 has published the blocks
    assigned = json.loads(bytes(store.get(f"{_ASSIGNED_RANKS_PREFIX}{group_rank}")).decode())
    return int(assigned[0]), int(assigned[1]), int(assigned[2]), int(assigned[3])
