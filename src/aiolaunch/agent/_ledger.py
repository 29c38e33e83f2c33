"""The job's own records, shared by every agent: restarts, progress, host failures, quarantine.

torch's agents each count their restarts, so a host that joins late (a
spare) starts from 0 and a job can restart more often than
``--max-restarts`` says. Here the count is the job's: kept in the
rendezvous store (:class:`StoreLedger`, keys under ``aiolaunch/{run_id}/``),
the same for every agent and for an agent that starts later on a fresh host.
One machine keeps it in memory (:class:`LocalLedger`).

Per failed round ``r``:

- each agent that saw it fail adds an event (``round/{r}/ev/{i}``: kind
  ``failed`` - its workers failed - or ``dead`` - a peer stopped answering -,
  its node, host, wall time and why);
- the first one (``compare_set`` on ``round/{r}/failed``) counts the job's
  restart and the streak of rounds without progress (reset by a round that
  made progress: ``round/{r}/progress``), and publishes both in
  ``round/{r}/outcome`` for the others;
- when the next round forms, one agent charges the round to a host
  (:func:`~._quarantine.culprits`) in the ``hosts`` table (failures and
  quarantine records), guarded by ``round/{r}/charged``.

All methods block (store round trips): call them from a worker thread.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from ._quarantine import apply_charge, culprits, in_force

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._quarantine import QuarantinePolicy

__all__ = ["Ledger", "LocalLedger", "StoreLedger"]

log = logging.getLogger("aiolaunch.agent")

#: how long an agent waits for another's count or charge of a round
_OTHERS_WAIT = 30.0
#: the pace of that wait (no blocking ``get``/``wait`` on the agent's store
#: client: it serialises calls, and the one that writes may be another
#: thread of this very agent)
_LOOK = 0.005


class Ledger(Protocol):
    """What the agent asks of the job's records."""

    def restarts(self) -> int:
        """The job's restarts so far (``TORCHELASTIC_RESTART_COUNT`` of the next round)."""

    def record(
        self,
        round_: int,
        kind: str,
        node: str,
        host: str,
        why: str,
        when: float | None = None,
        **how: bool,
    ) -> tuple[int, int]:
        """Round ``round_`` failed (``kind``: ``"failed"`` or ``"dead"``) at wall time
        ``when`` (``None``: now); ``how``: ``signal`` (a worker was killed by one),
        ``peer`` (its error names a lost peer). Returns the job's ``(restarts,
        rounds in a row without progress)`` once it is counted."""

    def mark_progress(self, round_: int) -> None:
        """Round ``round_`` made progress."""

    def charge(self, round_: int) -> list[str]:
        """Charge failed round ``round_`` to its host (once per round; idempotent);
        return the hosts it quarantined."""

    def table(self) -> dict[str, Any]:
        """The ``hosts`` table: ``{"failures": {host: [t]}, "quarantine": {host: record}}``."""


class LocalLedger:
    """The records of one agent, in memory (one machine, or a torch handler
    without aiolaunch's rounds: each agent counts its own, as torch's do).
    Every attempt is a round of its own: each :meth:`record` counts."""

    def __init__(self) -> None:
        self._restarts = 0
        self._streak = 0
        self._progress = False

    def restarts(self) -> int:
        return self._restarts

    def record(
        self,
        round_: int,
        kind: str,
        node: str,
        host: str,
        why: str,
        when: float | None = None,
        **how: bool,
    ) -> tuple[int, int]:
        self._restarts += 1
        self._streak = 0 if self._progress else self._streak + 1
        self._progress = False
        return self._restarts, self._streak

    def mark_progress(self, round_: int) -> None:
        self._progress = True

    def charge(self, round_: int) -> list[str]:
        return []

    def table(self) -> dict[str, Any]:
        return {}


class StoreLedger:
    """The records in the rendezvous store (see the module docstring).

    :param store: the job's store, prefixed (``aiolaunch/{run_id}/``).
    :param me: this agent's node, as a str.
    :param policy: the quarantine policy; ``None``: rounds are not charged.
    """

    def __init__(
        self,
        store: Any,
        me: str,
        policy: QuarantinePolicy | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._me = me
        self.policy = policy
        self._clock = clock
        self._charged: set[int] = set()

    def restarts(self) -> int:
        return int(self._store.add("restarts", 0))

    def record(
        self,
        round_: int,
        kind: str,
        node: str,
        host: str,
        why: str,
        when: float | None = None,
        **how: bool,
    ) -> tuple[int, int]:
        store = self._store
        t = self._clock() if when is None else when
        event = {"kind": kind, "node": node, "host": host, "t": t, "why": why, **how}
        i = int(store.add(f"round/{round_}/nev", 1)) - 1
        store.set(f"round/{round_}/ev/{i}", json.dumps(event).encode())
        outcome = f"round/{round_}/outcome"
        # unique per call: one agent may report a round twice (its workers
        # failed, and it found a peer dead), which counts once
        if self._claim(f"round/{round_}/failed"):
            restarts = int(store.add("restarts", 1))
            if store.check([f"round/{round_}/progress"]):
                streak = 0
                store.set("streak", b"0")
            else:
                streak = int(store.add("streak", 1))
            store.set(outcome, json.dumps([restarts, streak]).encode())
            return restarts, streak
        self._await(outcome, _OTHERS_WAIT)  # the first one's count
        got = json.loads(bytes(store.get(outcome)))
        return int(got[0]), int(got[1])

    def mark_progress(self, round_: int) -> None:
        self._store.set(f"round/{round_}/progress", b"1")

    def charge(self, round_: int) -> list[str]:
        if self.policy is None or round_ < 0 or round_ in self._charged:
            return []
        store = self._store
        newly: list[str] = []
        if not store.check([f"round/{round_}/failed"]):
            pass  # a membership change, not a failure: nobody to charge
        elif self._claim(f"round/{round_}/charged"):
            n = int(store.add(f"round/{round_}/nev", 0))
            events = [json.loads(bytes(store.get(f"round/{round_}/ev/{i}"))) for i in range(n)]
            hosts = culprits(events)
            why = next((str(e.get("why", "")) for e in events if e.get("host") in hosts), "")
            policy = self.policy
            now = self._clock()
            newly = self._update(lambda t: apply_charge(t, hosts, now, policy, why))
            store.set(f"round/{round_}/charged_done", b"1")
            if newly:
                log.warning("quarantined %s: %s", ", ".join(newly), why)
        elif not self._await(f"round/{round_}/charged_done", _OTHERS_WAIT / 6):
            log.info("round %d: the charge by another agent did not arrive; going on", round_)
        self._charged.add(round_)
        return newly

    def _await(self, key: str, timeout: float) -> bool:
        """Whether ``key`` was written within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._store.check([key]):
            if time.monotonic() > deadline:
                if key.endswith("/outcome"):
                    raise TimeoutError(f"the job's records: {key} was not written in time")
                return False
            time.sleep(_LOOK)  # allowed: see _LOOK
        return True

    def _claim(self, key: str) -> bool:
        """Whether this call is the first to claim ``key`` (a unique token per call)."""
        token = f"{self._me}#{os.urandom(6).hex()}"
        return bytes(self._store.compare_set(key, "", token)) == token.encode()

    def table(self) -> dict[str, Any]:
        raw = self._raw_table()
        return json.loads(raw) if raw else {}

    def set_members(self, round_: int, nodes: list[str]) -> None:
        """Who ran complete round ``round_`` (its rank 0 writes it)."""
        self._store.set(f"round/{round_}/members", json.dumps(nodes))

    def members(self, round_: int) -> set[str]:
        """Who ran complete round ``round_``, as far as written (else nobody)."""
        key = f"round/{round_}/members"
        if round_ < 0 or not self._store.check([key]):
            return set()
        return set(json.loads(bytes(self._store.get(key))))

    def quarantined(self) -> dict[str, dict[str, Any]]:
        """The records in force now (none read without a policy: the job has none)."""
        if self.policy is None:
            return {}
        return in_force(self.table(), self._clock())

    def _raw_table(self) -> bytes:
        return bytes(self._store.get("hosts")) if self._store.check(["hosts"]) else b""

    def _update(self, change: Callable[[dict[str, Any]], list[str]]) -> list[str]:
        """Compare-and-swap the ``hosts`` table until ``change`` lands; its result."""
        while True:
            raw = self._raw_table()
            table = json.loads(raw) if raw else {}
            out = change(table)
            new = json.dumps(table, sort_keys=True).encode()
            if new == raw or bytes(self._store.compare_set("hosts", raw, new)) == new:
                return out
