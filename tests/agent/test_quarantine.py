"""Quarantine and the job's records: the pure rules, and the ledger over a real store.

The ledger runs over a real ``torch.distributed.TCPStore`` (several
``StoreLedger`` objects on one store are several agents of one job), and
over a real etcd where it is installed; the rules need nothing.
"""

from __future__ import annotations

import importlib.util
import threading
from datetime import timedelta
from typing import Any

import pytest

from aiolaunch.agent._ledger import LocalLedger, StoreLedger
from aiolaunch.agent._quarantine import (
    QuarantinePolicy,
    apply_charge,
    culprits,
    in_force,
    lost_a_peer,
    summary,
)


def test_a_dead_host_is_charged_before_the_first_to_fail() -> None:
    events = [
        {"kind": "failed", "host": "a", "t": 10.0},
        {"kind": "dead", "host": "b", "t": 12.0},
    ]
    assert culprits(events) == ["b"]


def test_without_a_death_the_earliest_failure_is_charged() -> None:
    """Its peers' workers fail after it, in the collective that lost it."""
    events = [
        {"kind": "failed", "host": "a", "t": 10.02},
        {"kind": "failed", "host": "b", "t": 10.00},
        {"kind": "failed", "host": "c", "t": 10.03},
    ]
    assert culprits(events) == ["b"]
    assert culprits([]) == []


def test_a_crash_is_charged_before_failures_that_name_a_lost_peer() -> None:
    """A crashed worker's process can be seen after its peers' (they fail on
    the lost connection at once): what the failures say comes first."""
    events = [
        {"kind": "failed", "host": "a", "t": 10.00, "peer": True},
        {"kind": "failed", "host": "b", "t": 10.05, "signal": True},
        {"kind": "failed", "host": "c", "t": 10.01, "peer": False},
    ]
    assert culprits(events) == ["b"]
    assert culprits([e for e in events if e["host"] != "b"]) == ["c"]
    assert lost_a_peer("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Read error ...")
    assert lost_a_peer("torch.distributed.DistBackendError: NCCL error ... ncclRemoteError")
    assert not lost_a_peer("ValueError: loss is nan")


def test_n_failures_within_the_window_quarantine_for_the_ttl() -> None:
    policy = QuarantinePolicy(after=2, window=100.0, ttl=50.0)
    table: dict[str, Any] = {}
    assert apply_charge(table, ["b"], 1000.0, policy, "rank 1 exit code 1") == []
    assert table["failures"] == {"b": [1000.0]}
    # outside the window the first one no longer counts
    assert apply_charge(table, ["b"], 1200.0, policy, "again") == []
    assert apply_charge(table, ["b"], 1250.0, policy, "rank 1 exit code 1") == ["b"]
    record = in_force(table, 1260.0)["b"]
    assert record["until"] == 1300.0 and record["failures"] == 2
    assert "--quarantine-after 2" in record["reason"] and "rank 1 exit code 1" in record["reason"]
    assert "b" not in table["failures"]  # its history starts afresh
    assert in_force(table, 1300.0) == {}  # the TTL is over
    assert summary(table, 1260.0) == "quarantined: b (40 s left)"
    assert summary(table, 1400.0) == "no host quarantined"


def test_a_quarantined_host_is_not_charged_again() -> None:
    policy = QuarantinePolicy(after=1, window=10.0, ttl=100.0)
    table: dict[str, Any] = {}
    assert apply_charge(table, ["b"], 0.0, policy, "x") == ["b"]
    assert apply_charge(table, ["b"], 5.0, policy, "y") == []
    assert table["quarantine"]["b"]["since"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"after": 0}, "quarantine_after=0 must be an int >= 1"),
        ({"after": True}, "quarantine_after=True"),
        ({"after": 2, "window": -1}, "quarantine_window=-1 must be a number of seconds"),
        ({"after": 2, "ttl": float("inf")}, "quarantine_ttl=inf"),
    ],
)
def test_bad_policies_name_the_argument(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QuarantinePolicy(**kwargs)


def test_one_agents_records_count_every_attempt() -> None:
    ledger = LocalLedger()
    assert ledger.record(0, "failed", "n", "h", "x") == (1, 1)
    ledger.mark_progress(0)
    assert ledger.record(0, "failed", "n", "h", "x") == (2, 0)  # progress resets the streak
    assert ledger.record(0, "failed", "n", "h", "x") == (3, 1)
    assert ledger.restarts() == 3


@pytest.fixture(scope="module", autouse=True)
def _libuv_signal_pipe() -> None:
    """libuv's process-wide signal pipe, made by the first TCPStore server of a
    process and kept for good: made here, before any test's leak check."""
    if importlib.util.find_spec("torch") is not None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))


def new_store() -> Any:
    """A job's store: a real TCPStore (server and client in this process).

    Made in the test, not by a fixture: torch's store has no ``close()``, its
    sockets go with the object, and pytest keeps a fixture's value past the
    leak check; a test's locals are gone by then.
    """
    pytest.importorskip("torch")
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20))
    return PrefixStore("aiolaunch/test/", server)


def test_a_failed_round_counts_once_for_every_agent() -> None:
    """Three agents report round 0 at once (one of them twice: its workers
    failed, and it found a peer dead): one restart, the same for all."""
    store = new_store()
    agents = [StoreLedger(store, f"n{i}", None) for i in range(3)]
    got: list[tuple[int, int]] = []
    lock = threading.Lock()

    def report(i: int) -> None:
        out = agents[i].record(0, "failed", f"n{i}", f"h{i}", "boom")
        with lock:
            got.append(out)

    threads = [threading.Thread(target=report, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got.append(agents[0].record(0, "dead", "n9", "h9", "gone"))
    assert got == [(1, 1)] * 4
    assert [a.restarts() for a in agents] == [1, 1, 1]
    agents[1].mark_progress(1)  # any host's progress counts for the round
    assert agents[2].record(1, "failed", "n2", "h2", "boom") == (2, 0)
    assert agents[0].record(2, "failed", "n0", "h0", "boom") == (3, 1)


def test_the_charge_quarantines_the_culprit_and_every_agent_sees_it() -> None:
    store = new_store()
    policy = QuarantinePolicy(after=2, window=600.0, ttl=600.0)
    clock = [1000.0]
    a = StoreLedger(store, "a", policy, clock=lambda: clock[0])
    b = StoreLedger(store, "b", policy, clock=lambda: clock[0])
    for round_ in (0, 1):
        b.record(round_, "failed", "b#1", "hb", "rank 1 exit code 1")
        clock[0] += 0.01
        a.record(round_, "failed", "a#1", "ha", "rank 0: peer closed the connection")
        clock[0] += 1
        # both try to charge: one does, the other waits for it
        charged = [a.charge(round_), b.charge(round_)]
        assert charged in ([[], []], [["hb"], []], [[], ["hb"]])
    fresh = StoreLedger(store, "fresh-agent-on-hb", policy, clock=lambda: clock[0])
    assert set(fresh.quarantined()) == {"hb"}
    assert "rank 1 exit code 1" in fresh.quarantined()["hb"]["reason"]
    assert fresh.table()["failures"] == {"ha": []} or "ha" not in fresh.table()["failures"]
    clock[0] += 700
    assert fresh.quarantined() == {}


def test_a_round_without_a_failure_is_charged_to_nobody() -> None:
    store = new_store()
    policy = QuarantinePolicy(after=1)
    ledger = StoreLedger(store, "a", policy)
    assert ledger.charge(0) == []  # a membership change: no event, no claim
    assert ledger.table() == {}
