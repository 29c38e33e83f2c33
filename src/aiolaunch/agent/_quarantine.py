"""Quarantine of bad hosts: which host a failed round is charged to, and when a host is out.

Pure rules over plain values (the tables live in the rendezvous store, see
:mod:`._ledger`):

- A failed round is charged to one host: a host that *died* in it (its
  agent stopped answering) if any; else the host of the failure that looks
  least like a consequence - a worker killed by a signal (a crash, the OOM
  killer) before one that exited with an error, and an error that does not
  name a lost peer (:func:`lost_a_peer`: torch's and gloo's/NCCL's messages
  when the other side of a collective went away) before one that does -
  and among equals the one its agent saw first (its peers' workers fail
  after it, in the collective that lost it). A worker that exits slowly
  (a long interpreter teardown) can be seen after its peers: that order is
  only a tie-break. Hosts are compared by the wall clocks of their agents
  (NTP-close clocks are assumed).
- A host charged ``after`` times within ``window`` seconds is quarantined
  for ``ttl`` seconds: its agent leaves the job and no agent on that host is
  admitted until the record expires; its failure history starts afresh.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HostExcluded",
    "QuarantinePolicy",
    "apply_charge",
    "culprits",
    "in_force",
    "lost_a_peer",
    "summary",
]


class HostExcluded(RuntimeError):
    """This host may not take part in the job: it is quarantined, or its health
    check failed until the job ended. The job goes on (or ended) without it.

    :param reason: why, in one line (the termination message).
    :param kind: ``"quarantine"`` or ``"health-check"``.
    """

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


@dataclass(frozen=True)
class QuarantinePolicy:
    """``--quarantine-after N``, ``--quarantine-window SECONDS``, ``--quarantine-ttl SECONDS``.

    :raises ValueError: a bad value, naming the argument and the fix.
    """

    after: int
    window: float = 3600.0
    ttl: float = 3600.0

    def __post_init__(self) -> None:
        if isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 1:
            raise ValueError(
                f"quarantine_after={self.after!r} must be an int >= 1 (failures of one host), "
                "e.g. 2"
            )
        for name in ("window", "ttl"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(
                    f"quarantine_{name}={value!r} must be a number of seconds > 0, e.g. 3600"
                )


_LOST_PEER = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|DistBackendError|DistNetworkError"
    r"|Socket Timeout|connectFullMesh|NCCL communicator was aborted|ncclRemoteError"
    r"|ProcessGroupNCCL.*(?:timeout|Timeout|abort)|Read error|recvBytes|failed to recv",
)


def lost_a_peer(text: str) -> bool:
    """Whether a worker's error says another process of the collective went
    away (the failure is a consequence, not a cause)."""
    return _LOST_PEER.search(text) is not None


def culprits(events: list[dict[str, Any]]) -> list[str]:
    """The host(s) a failed round is charged to, from its events
    (``{"kind": "failed"|"dead", "host", "t": wall time, "signal": bool,
    "peer": bool}``; see the module docstring)."""
    dead = sorted({str(e["host"]) for e in events if e.get("kind") == "dead"})
    if dead:
        return dead
    failed = [e for e in events if e.get("kind") == "failed"]
    if not failed:
        return []

    def order(e: dict[str, Any]) -> tuple[bool, bool, float]:
        return (not e.get("signal", False), bool(e.get("peer", False)), float(e["t"]))

    return [str(min(failed, key=order)["host"])]


def apply_charge(
    table: dict[str, Any], hosts: list[str], now: float, policy: QuarantinePolicy, why: str
) -> list[str]:
    """Charge ``hosts`` one failure each in ``table`` (``{"failures": {host: [t]},
    "quarantine": {host: record}}``, changed in place); return the hosts that
    this quarantines."""
    failures: dict[str, list[float]] = table.setdefault("failures", {})
    records: dict[str, dict[str, Any]] = table.setdefault("quarantine", {})
    newly = []
    for host in hosts:
        if host in in_force(table, now):
            continue
        recent = [t for t in failures.get(host, []) if now - t <= policy.window] + [now]
        if len(recent) >= policy.after:
            failures.pop(host, None)
            records[host] = {
                "since": now,
                "until": now + policy.ttl,
                "failures": len(recent),
                "reason": (
                    f"{len(recent)} failures within {policy.window:g} s "
                    f"(--quarantine-after {policy.after}); last: {why}"
                ),
            }
            newly.append(host)
        else:
            failures[host] = recent
    return newly


def in_force(table: dict[str, Any], now: float) -> dict[str, dict[str, Any]]:
    """The quarantine records of ``table`` that have not expired at ``now``."""
    records: dict[str, dict[str, Any]] = table.get("quarantine", {})
    return {h: r for h, r in records.items() if float(r.get("until", 0)) > now}


def summary(table: dict[str, Any], now: float) -> str:
    """One line for people: the hosts out now, and until when (seconds left)."""
    records = in_force(table, now)
    if not records:
        return "no host quarantined"
    parts = [f"{h} ({float(r['until']) - now:.0f} s left)" for h, r in sorted(records.items())]
    return "quarantined: " + ", ".join(parts)
