"""Who is alive, and when the rendezvous state changed: two small protocols over the store.

Both live in the rendezvous's own store (the c10d TCPStore, or etcd through
:class:`~._etcd_v3.EtcdV3Store`) under ``aiolaunch/{run_id}/``; no service
of their own.

- :class:`Beacon`: a thread of each agent counts ``beat/{node}`` up every
  ``interval`` seconds. :class:`Liveness` reads the beacons of the agents it
  cares about and declares one dead when its count did not move for
  ``timeout`` seconds *of the reader's own clock* (no clock is compared with
  another host's). torch's keep-alive (a write of the whole state every 5 s,
  a node dropped after 15 s) stays on for torch's sake; this one is cheap
  (one key) and fast. An agent that finishes or leaves on purpose writes
  ``done`` or ``gone``: gone counts as dead at once, done never does.
- :class:`Bell`: an agent that changed who is where rings it (``add`` on
  ``bell``, then ``bell/{n}``); the others' waits wake at once (a blocking
  ``wait`` on the next bell key, on a connection of its own, in a thread
  that notifies a condition), instead of torch's 1 s polling.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["DONE", "GONE", "Beacon", "Bell", "HostNames", "Liveness"]

log = logging.getLogger("aiolaunch.agent")

#: the beacon of an agent that finished (never dead) or left on purpose (dead now)
DONE = b"done"
GONE = b"gone"


def beat_key(node: object) -> str:
    return f"beat/{node}"


class Beacon:
    """This agent's liveness: ``beat/{node}`` counted up every ``interval`` seconds.

    :param store: the job's store (prefixed), or a call that makes one: a
        connection of its own for a TCPStore, whose client serialises its
        calls - a beat must not wait behind the agent's blocking ``get`` (a
        rank assignment waiting for a slow rank 0 would make it look dead).
    """

    def __init__(self, store: Any, node: object, interval: float) -> None:
        self._store = store
        self._key = beat_key(node)
        self._interval = interval
        self._stop = threading.Event()
        self._count = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Write the first beat now (so the node is known before it is listed), then keep on."""
        if self._thread is not None:
            return
        if callable(self._store):
            self._store = self._store()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="aiolaunch-beacon", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._count += 1
        self._store.set(self._key, str(self._count).encode())

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self._interval):
            try:
                self._beat()
                failures = 0
            except Exception as exc:  # the store went away: nothing to tell
                failures += 1
                if failures == 1:
                    log.info("liveness beacon: %s", exc)

    def stop(self, last: bytes | None = None) -> None:
        """Stop beating; write ``last`` (:data:`DONE` or :data:`GONE`) as the final value."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if last is not None:
            with contextlib.suppress(Exception):
                self._store.set(self._key, last)


class HostNames:
    """The host of each agent, as quarantine names it: published by each agent
    in ``hostid/{node}`` (:meth:`publish`), else its address; cached."""

    def __init__(self, store: Any, me: Any, identity: str) -> None:
        self._store = store
        self._me = me
        self._names: dict[Any, str] = {me: identity}

    def publish(self) -> None:
        self._store.set(f"hostid/{self._me!r}", self._names[self._me])

    def __call__(self, node: Any) -> str:
        name = self._names.get(node)
        if name is None:
            key = f"hostid/{node!r}"
            known = self._store.check([key])
            name = bytes(self._store.get(key)).decode() if known else str(node.addr)
            self._names[node] = name
        return name


class Liveness:
    """One agent's view of the others' beacons (thread-safe).

    A node without a beacon key (a torchrun agent) is never declared dead
    here: torch's keep-alive expiry covers it.
    """

    def __init__(self, store: Any, timeout: float) -> None:
        self._store = store
        self.timeout = timeout
        self._lock = threading.Lock()
        #: node -> (value, when it last changed, monotonic); None: no beacon
        self._seen: dict[Any, tuple[bytes, float] | None] = {}

    def observe(self, nodes: Iterable[Any]) -> set[Any]:
        """Read the beacons of ``nodes`` now; return those that are dead."""
        nodes = list(nodes)
        with self._lock:
            unknown = [n for n in nodes if n not in self._seen]
        for node in unknown:
            has = bool(self._store.check([beat_key(node)]))
            with self._lock:
                self._seen.setdefault(node, (b"", time.monotonic()) if has else None)
        with self._lock:
            known = [n for n in nodes if self._seen.get(n) is not None]
        values = self._store.multi_get([beat_key(n) for n in known]) if known else []
        now = time.monotonic()
        dead: set[Any] = set()
        with self._lock:
            for node, raw in zip(known, values, strict=True):
                value = bytes(raw)
                seen = self._seen[node]
                assert seen is not None
                if value != seen[0]:
                    self._seen[node] = seen = (value, now)
                if value == GONE or (value != DONE and now - seen[1] >= self.timeout):
                    dead.add(node)
        return dead

    def forget(self, nodes: Iterable[Any]) -> None:
        """Drop what is known of ``nodes`` (they left the state)."""
        with self._lock:
            for node in nodes:
                self._seen.pop(node, None)


class Bell:
    """Rings on every change of who is where; :meth:`wait` wakes at the next ring.

    :param store: the job's store, for ringing.
    :param listen: makes the store for the blocking wait, in the listener's
        thread (a connection of its own for a TCPStore, whose client
        serialises its calls), or ``None``: no listener thread; :meth:`wait`
        then only times out (a poll).
    """

    #: how long one blocking wait of the listener lasts before it waits again
    LISTEN_TIMEOUT = timedelta(hours=1)

    def __init__(self, store: Any, listen: Callable[[], Any] | None) -> None:
        self._store = store
        self._listen = listen
        self._cond = threading.Condition()
        self._count = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._listen is None or self._thread is not None:
            return
        self._count = int(self._store.add("bell", 0))
        self._thread = threading.Thread(target=self._run, name="aiolaunch-bell", daemon=True)
        self._thread.start()
        _open_bells.add(self)

    def _run(self) -> None:
        assert self._listen is not None
        try:
            listen = self._listen()
        except Exception as exc:
            log.warning("rendezvous bell: no listener (%s); changes are seen by polling", exc)
            return
        while not self._closed:
            with self._cond:
                n = self._count
            try:
                listen.wait([f"bell/{n + 1}"], self.LISTEN_TIMEOUT)
                count = int(listen.add("bell", 0))
            except Exception as exc:
                if self._closed:
                    return
                log.debug("rendezvous bell: %s", exc)
                time.sleep(0.5)  # allowed: the store is unreachable; retry calmly
                continue
            with self._cond:
                if count > self._count:
                    self._count = count
                    self._cond.notify_all()

    def ring(self) -> None:
        """Tell every agent the state changed (after a successful write)."""
        n = int(self._store.add("bell", 1))
        self._store.set(f"bell/{n}", b"")

    @property
    def count(self) -> int:
        with self._cond:
            return self._count

    def wait(self, seen: int, timeout: float, stop: Callable[[], bool] = lambda: False) -> int:
        """Wait until a ring after ``seen`` (a :attr:`count`), ``timeout`` or ``stop()``;
        return the count now."""
        with self._cond:
            self._cond.wait_for(lambda: self._count > seen or self._closed or stop(), timeout)
            return self._count

    def wake(self) -> None:
        """Wake every waiter (a stop was requested)."""
        with self._cond:
            self._cond.notify_all()

    def close(self, timeout: float = 2.0) -> None:
        """Stop listening: ring once more (closed first, so the listener does
        not wait again) and join the listener, at most ``timeout`` seconds.

        A listener still blocked in the store when the interpreter exits
        would abort the process (torch's C++ wait throws into a finalizing
        interpreter), so it is joined here, while the agent runs.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        _open_bells.discard(self)
        if thread is None:
            return
        try:
            self.ring()
        except Exception as exc:  # the store is gone: so is the listener's wait
            log.debug("rendezvous bell: %s", exc)
        thread.join(timeout)


# Bells nobody closed (an agent used without shutdown()): closed before the
# interpreter finalizes, while their listeners can still unwind.
_open_bells: weakref.WeakSet[Bell] = weakref.WeakSet()


@atexit.register
def _close_open_bells() -> None:
    for bell in list(_open_bells):
        bell.close(timeout=1.0)
