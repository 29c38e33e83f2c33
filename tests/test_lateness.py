"""Stragglers by lateness, pure (no processes): simulated data-parallel training
whose ranks arrive at each step's bucket all-reduces as DDP makes them, pulled
once a second as the watchdog pulls the records (the last 64 entries)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolaunch._hangs._lateness import Late, LatenessStat


def simulate(
    ranks: int, seconds: float, seed: int, *, straggler: int | None = None, delay: float = 0.1,
    jitter: float = 0.1, step: float = 0.3, buckets: int = 3, pull: float = 1.0,
    keep: int = 64,
) -> tuple[LatenessStat, list[tuple[float, Late]]]:  # fmt: skip
    """Training for ``seconds``: every rank's step takes ``step`` ± ``jitter``
    (relative), ``straggler``'s ``delay`` more, spent inside its backward
    before the buckets are ready; each bucket's all-reduce is created on a
    rank when its gradients are (evenly through the backward's second half);
    the next step starts when the last rank's last bucket arrives."""
    rng = random.Random(seed)
    stat = LatenessStat()
    records: dict[int, list[tuple[int, float]]] = {r: [] for r in range(ranks)}
    named: list[tuple[float, Late]] = []
    t, seq, next_pull = 0.0, 0, pull
    while t < seconds:
        arrivals: dict[int, list[float]] = {}
        for r in range(ranks):
            work = step * rng.uniform(1 - jitter, 1 + jitter)
            extra = delay if r == straggler else 0.0
            arrivals[r] = [
                t + work * (0.5 + 0.5 * (j + 1) / buckets) + extra for j in range(buckets)
            ]
        for j in range(buckets):
            seq += 1
            for r in range(ranks):
                records[r].append((seq, arrivals[r][j]))
        end = max(a[-1] for a in arrivals.values())
        while next_pull <= end:
            seen: dict[tuple[str, str, int], dict[int, int]] = {}
            for r in range(ranks):
                records[r] = records[r][-keep:]
                for s, created in records[r]:
                    if created <= next_pull:
                        seen.setdefault(("gloo", "0", s), {})[r] = round(created * 1e9)
            expected = {k: set(range(ranks)) for k in seen}
            named += [(next_pull, n) for n in stat.add(seen, expected, next_pull)]
            next_pull += pull * rng.uniform(0.75, 1.25)
        t = end + 0.001
    return stat, named


@settings(max_examples=12, deadline=None)
@given(ranks=st.integers(2, 8), seed=st.integers(0, 2**32 - 1))
def test_ten_balanced_minutes_name_nobody(ranks: int, seed: int) -> None:
    _, named = simulate(ranks, 600, seed)
    assert named == []


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_a_rank_late_inside_its_backward_is_named_fast_and_alone(ranks: int) -> None:
    # Lateness is against the earliest rank: the spread of the others' step
    # times (here ±5 %) adds to the 0.1 s injected.
    for seed in range(5):
        stat, named = simulate(ranks, 90, seed, straggler=ranks - 1, delay=0.1, jitter=0.05)
        assert named, (ranks, seed)
        when, late = named[0]
        assert {n.rank for _, n in named} == {ranks - 1}
        assert when <= 60, (ranks, seed, when)
        assert 0.08 <= late.lateness_s <= 0.12, late
        assert late.last_share > 0.9 and late.peers_last_share < 0.1
        assert stat.lateness(ranks - 1) == pytest.approx(0.1, abs=0.02)
        assert stat.lateness(0) is not None and stat.lateness(0) < 0.03  # type: ignore[operator]


def test_small_consistent_lateness_under_the_floor_is_not_named() -> None:
    _, named = simulate(4, 120, 1, straggler=3, delay=0.005, jitter=0.0)
    assert named == []


def test_one_event_per_spell_and_recovery_clears() -> None:
    stat = LatenessStat()
    key = 0

    def pull(now: float, late: float, n: int = 10) -> list[Late]:
        nonlocal key
        seen, expected = {}, {}
        for _ in range(n):
            key += 1
            base = round(now * 1e9) + key
            seen[("gloo", "0", key)] = {0: base, 1: base + 1000, 2: base + round(late * 1e9)}
            expected[("gloo", "0", key)] = {0, 1, 2}
        return stat.add(seen, expected, now)

    events = [e for t in range(1, 8) for e in pull(float(t), 0.2)]
    assert [e.rank for e in events] == [2]
    assert 2 in stat.named
    for t in range(8, 80):  # back among its peers: cleared once the window forgot it
        assert pull(float(t), 0.0) == []
    assert stat.named == {}
    stat.forget(2)
    assert stat.lateness(2) is None


def test_a_collective_counts_once_every_member_reported() -> None:
    stat = LatenessStat(min_collectives=1, persist=1)
    key = ("gloo", "0", 1)
    assert stat.add({key: {0: 0, 1: 10**9}}, {key: {0, 1, 2}}, 1.0) == []
    assert stat.lateness(0) is None  # rank 2 not seen yet
    stat.add({key: {2: 5 * 10**8}}, {key: {0, 1, 2}}, 2.0)
    assert stat.lateness(1) == 1.0 and stat.lateness(2) == 0.5
    stat.add({key: {0: 0, 1: 10**9, 2: 10**9}}, {key: {0, 1, 2}}, 3.0)
    assert stat.lateness(2) == 0.5  # not counted twice
