"""torch's dynamic rendezvous with aiolaunch's rounds: spares, fast re-forming, a store per round.

:class:`RoundsHandler` is torch's ``DynamicRendezvousHandler`` - same
backends (c10d, etcd-v3), same state, same keep-alive, same ``shutdown`` - whose
``next_rendezvous`` moves the agent by :mod:`._rules` (through
:class:`~._driver.RoundDriver`) instead of torch's join operation, and which
adds, in the same store under ``aiolaunch/{run_id}/``, what torch's state
cannot say: liveness beacons and the bell (:mod:`._liveness`), and the
job's records (:class:`~aiolaunch.agent._ledger.StoreLedger`: restarts,
progress, host failures, quarantine).

The workers' store: torch creates it once, on the agent that was rank 0 in
its first round, and keeps it for every later round, so plain ``env://``
workers of a new round read the keys of the last one (a dead peer's
address). Here the rank-0 agent of *every* round starts a fresh one.

``--rdzv-conf`` knobs (besides torch's): ``liveness_interval`` (seconds
between beacons, default 0.25), ``liveness_timeout`` (a beacon that does not
move for this long is dead, default 1.5), ``rules=torch`` (torch's handler
as it is). Imports torch: loaded only from ``_torch.py`` and ``_etcd_v3.py``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _BackendRendezvousStateHolder,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as _torch_handler,
)

from .._hosts import hosts_section
from .._ledger import StoreLedger
from .._quarantine import HostExcluded, in_force
from ._driver import RoundDriver, RoundTimeout
from ._liveness import DONE, GONE, Beacon, Bell, HostNames, Liveness
from ._rules import Action, Facts, waiting_nodes

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._quarantine import QuarantinePolicy

__all__ = ["RoundsHandler", "create_rounds_handler"]

log = logging.getLogger("aiolaunch.agent")

DEFAULT_INTERVAL = 0.25
DEFAULT_TIMEOUT = 1.5


def _seconds(params: Any, key: str, default: float) -> float:
    raw = params.get(key, None)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--rdzv-conf {key}={raw} must be a number of seconds > 0")
    return value


def create_rounds_handler(store: Any, backend: Any, params: Any) -> Any:
    """The handler of the ``c10d`` or ``etcd-v3`` backend: aiolaunch's rounds, or
    torch's own with ``--rdzv-conf rules=torch``.

    :raises ValueError: a bad ``--rdzv-conf`` value.
    """
    rules = str(params.get("rules", "aiolaunch"))
    if rules not in ("aiolaunch", "torch"):
        raise ValueError(f"--rdzv-conf rules={rules} must be aiolaunch (the default) or torch")
    torch_handler = _torch_handler(store, backend, params)  # torch parses its own knobs
    if rules == "torch":
        return torch_handler
    interval = _seconds(params, "liveness_interval", DEFAULT_INTERVAL)
    timeout = _seconds(params, "liveness_timeout", DEFAULT_TIMEOUT)
    if timeout < 2 * interval:
        raise ValueError(
            f"--rdzv-conf liveness_timeout={timeout:g} must be at least twice "
            f"liveness_interval={interval:g} (one late beacon is no death)"
        )
    return RoundsHandler.from_settings(
        torch_handler.settings, store, backend, params.local_addr, interval, timeout
    )


def _listener(store: Any) -> Callable[[], Any] | None:
    """How the beacon and the bell get a connection of their own to the store
    (the bell blocks in it), or ``None`` (the bell then polls)."""
    if isinstance(store, TCPStore):
        host, port = store.host, store.port

        def connect() -> Any:
            return TCPStore(host, port, is_master=False, timeout=Bell.LISTEN_TIMEOUT)

        return connect
    if type(store).__name__ == "EtcdV3Store":  # a connection per call: thread-safe
        return lambda: store
    return None


class RoundsHandler(DynamicRendezvousHandler):
    """torch's handler with aiolaunch's rounds (see the module docstring)."""

    @classmethod
    def from_settings(
        cls,
        settings: Any,
        store: Any,
        backend: Any,
        local_addr: str | None,
        interval: float,
        timeout: float,
    ) -> RoundsHandler:
        node = cls._node_desc_generator.generate(local_addr)
        # No cached state: a step reads the state it decides on.
        holder = _BackendRendezvousStateHolder(backend, settings, cache_duration=0)
        return cls(node, settings, backend.name, store, holder, interval=interval, timeout=timeout)

    def __init__(
        self,
        node: Any,
        settings: Any,
        backend_name: str,
        store: Any,
        state_holder: Any,
        *,
        interval: float = DEFAULT_INTERVAL,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(node, settings, backend_name, store, state_holder)
        prefix = f"aiolaunch/{settings.run_id}/"
        job = PrefixStore(prefix, store)
        connect = _listener(store)
        own = None if connect is None else (lambda: PrefixStore(prefix, connect()))
        self._job = job
        self._beacon = Beacon(own or job, node, interval)
        self._liveness = Liveness(job, timeout)
        self._bell = Bell(job, own)
        #: the job's records (restarts, progress, hosts), shared through the store
        self.ledger = StoreLedger(job, repr(node), None)
        # The host a quarantine record names: the machine, where the node's
        # address is not (a pod's IP changes when it is recreated).
        self._identity = host_identity(node.addr)
        self.host_of = HostNames(job, node, self._identity)
        self._driver = RoundDriver(
            state_holder,
            self._heartbeat_lock,
            settings,
            node,
            bell=self._bell,
            liveness=self._liveness,
            host=self.host_of,
            quarantined=lambda: set(self.ledger.quarantined()),
            charge=self.ledger.charge,
            on_dead=self._record_dead,
            last_call=settings.timeout.last_call,
            tick=interval,
        )
        self._admit: Callable[[], str | None] | None = None
        self._started = False
        #: the round of the current attempt, and its members in rank order
        self.round = -1
        self.members: list[Any] = []
        self._round_store: Any = None  # the workers' store of this round (rank 0)
        # what the live view shows, as last read (never read on its behalf)
        self._table: dict[str, Any] = {}
        self._restarts = 0

    # -- what the agent sets ------------------------------------------------
    def configure(
        self,
        *,
        quarantine: QuarantinePolicy | None = None,
        admit: Callable[[], str | None] | None = None,
    ) -> None:
        """The quarantine policy, and the check run before joining a round
        (``admit()`` returns ``None`` to join, else why not; it runs in the
        rendezvous thread)."""
        self.ledger.policy = quarantine
        self._admit = admit

    @property
    def host(self) -> str:
        """This agent's host: its address as the other agents see it."""
        return self._identity

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self.host_of.publish()
            self._beacon.start()
            self._bell.start()

    # -- rounds ---------------------------------------------------------------
    def next_rendezvous(self) -> RendezvousInfo:
        """Leave the round that ran (if any) and join the next complete one."""
        self._start()
        self._stop_heartbeats()
        began = time.monotonic()
        deadline = began + self._settings.timeout.join.total_seconds()
        driver = self._driver
        try:
            if self.round >= 0 and driver.leave_round(self.round) == Action.CLOSED:
                raise RendezvousClosedError
            while True:
                outcome = driver.join(deadline, self._admit)
                if outcome == Action.FINISH:
                    break
                if outcome == Action.CLOSED:
                    self._closed_while_waiting()
                if outcome == Action.QUARANTINED:
                    self._quarantined()
                # NOT_ADMITTED: out of every list until the next round forms
                log.warning(
                    "this host stays out of round %d: %s", driver.current_round(), (driver.refusal)
                )
                if not driver.wait_round_after(driver.current_round()):
                    raise HostExcluded(
                        f"{self.host} never joined: its health check failed ({driver.refusal})",
                        "health-check",
                    )
                deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        except RoundTimeout as exc:
            self._driver.leave_job()
            raise RendezvousTimeoutError(str(exc)) from None
        except RendezvousConnectionError:
            if driver.refusal is None:
                raise
            # Kept out by its check, it lost the store: the job ended (its
            # host went) or was lost; either way this host never ran.
            raise HostExcluded(
                f"{self.host} never joined: its health check failed ({driver.refusal}); "
                "the rendezvous store is gone",
                "health-check",
            ) from None
        self._start_heartbeats()
        self._table, self._restarts = self.ledger.table(), self.ledger.restarts()
        state = self._state_holder.state
        rank = int(state.participants[self._this_node])
        world = len(state.participants)
        self.round = int(state.round)
        self.members = sorted(state.participants, key=state.participants.__getitem__)
        if rank == 0:  # who ran this round, for whoever finds one of them dead later
            self.ledger.set_members(self.round, [repr(n) for n in self.members])
        steps, lost = driver.stats()
        log.info(
            "joined round %d as rank %d of %d in %.3f s (%d steps, %d writes lost a race)",
            self.round,
            rank,
            world,
            time.monotonic() - began,
            steps,
            lost,
        )
        store = self._get_store()
        # The workers' store of this round: a fresh one, hosted by the rank-0
        # agent; the last round's goes (its workers are gone).
        self._round_store = None
        bootstrap, self._round_store = round_store(
            rank, store, self._this_node.addr, use_agent_store=self.use_agent_store
        )
        return RendezvousInfo(store, rank, world, bootstrap)

    def _closed_while_waiting(self) -> None:
        state = self._state_holder.state
        if self._this_node in state.redundancy_list:
            raise RendezvousGracefulExitError("the job ended; this spare was not needed")
        raise RendezvousClosedError

    def _quarantined(self) -> None:
        records = in_force(self.ledger.table(), time.time())
        record = records.get(self.host, {})
        self._driver.leave_job()
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("until", 0)))
        raise HostExcluded(
            f"{self.host} is quarantined until {until}: {record.get('reason', '')}", "quarantine"
        )

    def watch(self, stop: Callable[[], bool]) -> str | None:
        """Block while the round runs; why it must re-form, or ``None`` once ``stop()``."""
        if self.round < 0:
            return None
        return self._driver.watch(self.round, self.members, stop)

    def wake(self) -> None:
        """Wake a :meth:`watch` so that it sees its ``stop()``."""
        self._bell.wake()

    def num_nodes_waiting(self) -> int:
        """Agents a restart would add (never spares, never the dead)."""
        with self._heartbeat_lock:
            self._state_holder.sync()
            state = self._state_holder.state
        facts = Facts(me=self._this_node, host=self.host_of, dead=())
        return len(waiting_nodes(state, self._settings, facts))

    # -- the job's records ----------------------------------------------------
    @property
    def node_id(self) -> str:
        """This agent's name in the job's records."""
        return repr(self._this_node)

    def hosts(self) -> dict[str, Any]:
        """The live view's ``"hosts"`` section, from what was last read (no I/O)."""
        return hosts_section(
            state=self._state_holder.state,
            me=self._this_node,
            host=self.host_of,
            table=self._table,
            restarts=self._restarts,
            now=time.time(),
        )

    def _record_dead(self, round_: int, complete: bool, nodes: list[Any]) -> None:
        """``nodes`` stopped answering: those that ran in the last complete round
        failed it (a restart of the job; their hosts are charged)."""
        ran = round_ if complete else round_ - 1
        members = self._members_of(ran)
        for node in nodes:
            if repr(node) in members:
                host = self.host_of(node)
                self.ledger.record(ran, "dead", repr(node), host, f"{host} stopped answering")

    def _members_of(self, round_: int) -> set[str]:
        if round_ == self.round:
            return {repr(n) for n in self.members}
        return self.ledger.members(round_)

    # -- the end ----------------------------------------------------------------
    def leave(self) -> None:
        """This agent goes (a signal): out of every list, its beacon ``gone``."""
        try:
            self._driver.leave_job()
        finally:
            self._stop(GONE)

    def shutdown(self) -> bool:
        """Close the rendezvous (torch's), wake every agent, beacon ``done``."""
        try:
            return bool(super().shutdown())
        finally:
            self._stop(DONE)

    def _stop(self, last: bytes) -> None:
        if not self._started:
            return
        self._beacon.stop(last)
        self._bell.close()  # rings: every agent wakes and sees the end
        self._round_store = None


def host_identity(addr: str) -> str:
    """This machine, as quarantine names it: ``$AIOLAUNCH_HOST`` (e.g. a
    Kubernetes node's name from the downward API), ``$SLURMD_NODENAME`` under
    Slurm, else the agent's address."""
    return os.environ.get("AIOLAUNCH_HOST") or os.environ.get("SLURMD_NODENAME") or addr


def round_store(
    rank: int, store: Any, addr: str, *, use_agent_store: bool
) -> tuple[RendezvousStoreInfo, Any]:
    """``(where the workers' store is, the server if this agent hosts it)`` for
    one round: a new TCPStore on the rank-0 agent, its address in the round's
    keys for the others (or torch's own way when the agent store is off)."""
    if not use_agent_store:
        return RendezvousStoreInfo.build(rank, store, local_addr=addr), None
    if rank == 0:
        server = TCPStore(addr, 0, is_master=True, wait_for_workers=False)
        store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr.encode())
        store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(server.port).encode())
        return RendezvousStoreInfo(addr, int(server.port)), server
    got_addr = bytes(store.get(RendezvousStoreInfo.MASTER_ADDR_KEY)).decode()
    got_port = int(bytes(store.get(RendezvousStoreInfo.MASTER_PORT_KEY)).decode())
    return RendezvousStoreInfo(got_addr, got_port), None
