"""The straggler statistic, pure (no processes): balanced runs never name
anyone, a straggler is named fast and alone."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolaunch._hangs._straggler import (
    StragglerStat,
    Straggling,
    fisher_less,
    starting,
    waiting_in_collective,
)

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def test_collective_frames_are_recognised() -> None:
    in_all_reduce = [
        ("all_reduce", C10D, "2950"),
        ("wrapper", "/venv/.../torch/distributed/c10d_logger.py", "83"),
        ("train_step", "/x/train.py", "88"),
    ]
    assert waiting_in_collective(in_all_reduce)
    assert waiting_in_collective([("barrier", C10D, "4100"), ("main", "/x/t.py", "3")])
    # The same names outside torch.distributed are not collectives.
    assert not waiting_in_collective([("all_reduce", "/x/mine.py", "3")])
    assert not waiting_in_collective([("load_batch", "/x/data.py", "41")])
    assert not waiting_in_collective([])


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 40),
    data=st.data(),
)
def test_fisher_less_is_the_exact_hypergeometric_tail(total: int, data: st.DataObject) -> None:
    successes = data.draw(st.integers(0, total))
    draws = data.draw(st.integers(0, total))
    k = data.draw(st.integers(0, draws))
    exact = sum(
        Fraction(math.comb(successes, x) * math.comb(total - successes, draws - x))
        / math.comb(total, draws)
        for x in range(0, k + 1)
    )
    assert fisher_less(k, draws, successes, total) == pytest.approx(
        float(exact), rel=1e-9, abs=1e-15
    )


def _simulate(
    ranks: int,
    rounds: int,
    seed: int,
    *,
    compute: tuple[float, float],
    straggler: int | None = None,
    factor: float = 2.0,
    period: float = 0.5,
) -> list[tuple[int, Straggling]]:
    """Data-parallel steps: each rank computes for a random time, then waits
    in the collective until the slowest arrives. Every ``period`` (jittered
    ±25 %, as the sampler does) each rank is sampled: waiting or not."""
    rng = random.Random(seed)
    stat = StragglerStat()
    named: list[tuple[int, Straggling]] = []
    start = end = 0.0
    comp: list[float] = []
    t = 0.0
    for i in range(rounds):
        t += period * rng.uniform(0.75, 1.25)
        while t >= end:  # the next step
            start = end
            comp = [
                rng.uniform(*compute) * (factor if r == straggler else 1.0) for r in range(ranks)
            ]
            end = start + max(comp) + 0.003  # + the collective itself
        named += [(i, s) for s in stat.add({r: t - start >= comp[r] for r in range(ranks)})]
    return named


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.integers(2, 8),
    seed=st.integers(0, 2**32),
    compute=st.sampled_from([(0.05, 0.3), (0.3, 0.8), (1.0, 3.0), (2.0, 6.0), (5.0, 15.0)]),
)
def test_a_balanced_run_names_nobody(ranks: int, seed: int, compute: tuple[float, float]) -> None:
    # 600 rounds: 5 minutes sampled every 0.5 s; steps from 50 ms to 15 s,
    # so many samples fall in one step (the case the statistic guards).
    assert _simulate(ranks, 600, seed, compute=compute) == []


@settings(max_examples=30, deadline=None)
@given(ranks=st.integers(2, 16), seed=st.integers(0, 2**32), p=st.floats(0.05, 0.95))
def test_independent_equal_samples_name_nobody(ranks: int, seed: int, p: float) -> None:
    rng = random.Random(seed)
    stat = StragglerStat()
    for _ in range(400):
        assert stat.add({r: rng.random() < p for r in range(ranks)}) == []


@settings(max_examples=25, deadline=None)
@given(ranks=st.integers(2, 8), seed=st.integers(0, 2**32), data=st.data())
def test_a_straggler_is_named_fast_and_alone(ranks: int, seed: int, data: st.DataObject) -> None:
    odd = data.draw(st.integers(0, ranks - 1))
    named = _simulate(ranks, 400, seed, compute=(0.1, 0.3), straggler=odd)
    assert named, "the straggler was never named"
    assert {s.rank for _, s in named} == {odd}
    first, s = named[0]
    # Within two minutes sampled at 0.5 s. Two ranks give the statistic the
    # least evidence: over 3000 seeds the first naming came at a median of
    # ~27 s, p99 56 s, max 94 s (a 60 s bound failed 17 seeds in 3000).
    assert first < 240
    assert s.wait_share < s.peers_wait_share / 2


def test_one_event_per_spell_and_recovery_clears() -> None:
    stat = StragglerStat()
    rng = random.Random(1)
    events = []
    for i in range(600):
        slow = i < 200 or i >= 400  # rank 3 straggles, recovers, straggles again
        waits = {r: rng.random() < 0.5 for r in range(3)}
        waits[3] = (rng.random() < 0.02) if slow else (rng.random() < 0.5)
        events += [(i, s.rank) for s in stat.add(waits)]
        if 320 <= i < 400:
            assert 3 not in stat.named, i  # recovered: no longer named
    assert [r for _, r in events] == [3, 3]
    assert events[0][0] < 60 and 400 <= events[1][0] < 520


def test_forget_drops_a_rank() -> None:
    stat = StragglerStat()
    for _ in range(80):
        stat.add({0: True, 1: True, 2: False})
    assert 2 in stat.named
    stat.forget(2)
    assert stat.named == {}
    assert stat.add({0: True, 1: True}) == []


def test_starting_frames_are_recognised() -> None:
    init = [
        ("_create_c10d_store", "/venv/.../torch/distributed/rendezvous.py", "200"),
        ("init_process_group", C10D, "1500"),
        ("main", "/x/train.py", "20"),
    ]
    assert starting(init)
    assert starting([("_find_and_load", "<frozen importlib._bootstrap>", "1176")])
    assert not starting([("all_reduce", C10D, "2950"), ("main", "/x/train.py", "25")])
