"""Several agents moved by RoundDriver over one shared state, in threads.

The store is an in-memory one with the calls the protocols use (set, get,
add, check, multi_get, compare_set, a blocking wait); the rendezvous state
sits behind a compare-and-swap backend with torch's semantics. No torch, no
network: what is tested is the protocol - liveness beacons, the bell, the
rules - with real threads and real time.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from aiolaunch.agent._rendezvous._driver import RoundDriver, RoundTimeout
from aiolaunch.agent._rendezvous._liveness import Beacon, Bell, Liveness
from aiolaunch.agent._rendezvous._rules import Action, Facts, restart_reason

INTERVAL = 0.05
TIMEOUT = 0.4


@dataclass
class State:
    round: int = 0
    complete: bool = False
    deadline: datetime | None = None
    closed: bool = False
    participants: dict[Any, int] = field(default_factory=dict)
    wait_list: set[Any] = field(default_factory=set)
    redundancy_list: set[Any] = field(default_factory=set)
    last_heartbeats: dict[Any, datetime] = field(default_factory=dict)


class MemStore:
    """The store calls the protocols make, thread-safe, ``get``/``wait`` blocking."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    @staticmethod
    def _bytes(value: Any) -> bytes:
        return bytes(value) if isinstance(value, bytes | bytearray) else str(value).encode()

    def set(self, key: str, value: Any) -> None:
        with self._cond:
            self._data[key] = self._bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, 10):
                raise TimeoutError(key)
            return self._data[key]

    def add(self, key: str, n: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + n
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        with self._cond:
            now = self._data.get(key)
            if (now is None and not self._bytes(expected)) or now == self._bytes(expected):
                self._data[key] = self._bytes(desired)
                self._cond.notify_all()
                return self._data[key]
            return now if now is not None else self._bytes(expected)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: all(k in self._data for k in keys), timeout.total_seconds()
            ):
                raise TimeoutError(keys)


class Backend:
    """torch's RendezvousBackend: the state's bytes and a fencing token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: bytes | None = None
        self._token = 0

    def get(self) -> tuple[bytes | None, int]:
        with self._lock:
            return self._state, self._token

    def cas(self, state: bytes, token: int) -> tuple[bytes | None, int, bool]:
        with self._lock:
            if token == self._token:
                self._state, self._token = state, self._token + 1
                return self._state, self._token, True
            return self._state, self._token, False


class Holder:
    """torch's _BackendRendezvousStateHolder, without its keep-alive expiry."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.state = State()
        self._token = 0
        self._dirty = False

    def sync(self) -> bool | None:
        if self._dirty:
            bits, self._token, ok = self._backend.cas(pickle.dumps(self.state), self._token)
            written: bool | None = ok
        else:
            bits, self._token = self._backend.get()
            written = None
        self.state = pickle.loads(bits) if bits is not None else State()
        self._dirty = False
        return written

    def mark_dirty(self) -> None:
        self._dirty = True


def host(node: Any) -> str:
    return str(node).split("/")[0]


class Agent:
    def __init__(
        self, name: str, store: MemStore, backend: Backend, settings: Any, tick: float
    ) -> None:
        self.name = name
        self.dead_seen: list[tuple[int, bool, list[Any]]] = []
        self.beacon = Beacon(store, name, INTERVAL)
        self.bell = Bell(store, lambda: store)
        self.holder = Holder(backend)
        self.driver = RoundDriver(
            self.holder,
            threading.Lock(),
            settings,
            name,
            bell=self.bell,
            liveness=Liveness(store, TIMEOUT),
            host=host,
            quarantined=set,
            charge=lambda r: None,
            on_dead=lambda *a: self.dead_seen.append(a),
            last_call=timedelta(seconds=30),
            tick=tick,
        )
        self.beacon.start()
        self.bell.start()
        self.outcome: Action | None = None
        self.error: RoundTimeout | None = None
        self._thread: threading.Thread | None = None

    def join(self) -> None:
        def run() -> None:
            try:
                self.outcome = self.driver.join(time.monotonic() + 30)
            except RoundTimeout as exc:
                # a spare still waiting when its test ended times out later,
                # in this daemon thread: kept, not raised into another test
                self.error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def joined(self, timeout: float = 10) -> Action | None:
        assert self._thread is not None
        self._thread.join(timeout)
        return self.outcome

    def state(self) -> Any:
        return self.holder.state

    def die(self) -> None:
        """As a SIGKILL: the beacon stops, nothing else is said."""
        self.beacon.stop()
        self.bell.close()

    def close(self) -> None:
        self.beacon.stop()
        self.bell.close()


@pytest.fixture
def job() -> Any:
    store, backend = MemStore(), Backend()
    settings = SimpleNamespace(min_nodes=2, max_nodes=2, keep_alive_interval=timedelta(seconds=5))
    agents: list[Agent] = []

    def make(name: str, tick: float = INTERVAL) -> Agent:
        agents.append(Agent(name, store, backend, settings, tick))
        return agents[-1]

    yield SimpleNamespace(make=make, settings=settings)
    for a in agents:
        a.close()


def test_a_lost_host_is_replaced_by_a_spare_in_one_round(job: Any) -> None:
    a, b = job.make("a/1"), job.make("b/1")
    a.join()
    b.join()
    assert a.joined() == b.joined() == Action.FINISH
    assert a.state().complete and set(a.state().participants) == {"a/1", "b/1"}
    c, d = job.make("c/1"), job.make("d/1")
    c.join()
    d.join()
    time.sleep(0.5)  # the spares wait: the running round is not to re-form for them
    assert c.outcome is None and d.outcome is None
    facts = Facts(me="a/1", host=host)
    assert restart_reason(a.state(), job.settings, facts, 0, ["a/1", "b/1"]) is None
    b.die()
    began = time.monotonic()
    assert a.driver.leave_round(0) == Action.FINISH  # it dissolved round 0
    a.join()
    assert a.joined() == Action.FINISH
    took = time.monotonic() - began
    state = a.state()
    assert state.round == 1 and state.complete
    assert "a/1" in state.participants and "b/1" not in state.participants
    spare = "c/1" if "c/1" in state.participants else "d/1"
    other = {"c/1": "d/1", "d/1": "c/1"}[spare]
    assert set(state.participants) == {"a/1", spare}
    assert state.redundancy_list == {other}  # still a spare: no second round for it
    assert took < TIMEOUT + 2.0, took  # the beacon's timeout, not torch's 15 s
    assert any("b/1" in nodes for _, _, nodes in a.dead_seen + c.dead_seen + d.dead_seen)
    facts = Facts(me="a/1", host=host)
    assert restart_reason(state, job.settings, facts, 1, ["a/1", spare]) is None


def test_the_bell_wakes_a_waiting_agent_at_once(job: Any) -> None:
    """The second agent's join closes the round; the first, waiting with a
    10 s tick, learns it from the bell, not from its next look."""
    a = job.make("a/1", tick=10.0)
    a.join()
    time.sleep(0.3)
    b = job.make("b/1")
    began = time.monotonic()
    b.join()
    assert b.joined() == Action.FINISH
    assert a.joined(5) == Action.FINISH
    assert time.monotonic() - began < 2.0
