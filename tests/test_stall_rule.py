"""The stall rule, pure (no processes): hypothesis explores it in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from aiolaunch._stall_rule import RankSample, StallRule

STALL = 5.0


def _run(rule: StallRule, rank: int, samples: list[RankSample], period: float = 0.5) -> list[float]:
    """Feed ``samples`` one per ``period``; the times at which ``rank`` was stalled."""
    rule.start(rank, 0.0)
    out = []
    for i, s in enumerate(samples, 1):
        if rule.observe(rank, s, i * period) is not None:
            out.append(i * period)
    return out


def test_a_spinning_rank_is_stalled_whatever_its_cpu() -> None:
    rule = StallRule(STALL)
    spin = RankSample(main_busy=True, stack="spin (x.py:3)", cpu_percent=100.0)
    stalled = _run(rule, 0, [spin] * 40)
    assert stalled and stalled[0] == STALL  # from the start: it never moved
    verdict = rule.observe(0, spin, 30.0)
    assert verdict is not None and verdict.spinning
    assert "spinning: 100% CPU" in verdict.reason and "same frames" in verdict.reason


def test_a_moving_busy_rank_is_never_stalled() -> None:
    rule = StallRule(STALL)
    frames = ["a (x.py:1)", "b (x.py:2)", "c (x.py:3)"]
    samples = [RankSample(main_busy=True, stack=frames[i % 3]) for i in range(60)]
    assert _run(rule, 0, samples) == []


def test_a_main_thread_waiting_while_helpers_work_is_not_stalled() -> None:
    rule = StallRule(STALL)
    join = RankSample(helpers_busy=True, stack="join (threading.py:1)")
    assert _run(rule, 0, [join] * 60) == []
    # ...but a main thread spinning while helpers work is a spin.
    rule = StallRule(STALL)
    both = RankSample(main_busy=True, helpers_busy=True, stack="item (x.py:9)")
    assert _run(rule, 0, [both] * 60)


def test_idle_ranks_are_stalled_moving_or_not() -> None:
    # A sleep-poll loop moves between two lines with no CPU: still a hang.
    rule = StallRule(STALL)
    samples = [RankSample(stack=("poll", "sleep")[i % 2]) for i in range(20)]
    stalled = _run(rule, 0, samples)
    assert stalled and stalled[0] == STALL
    verdict = rule.observe(0, samples[0], 11.0)
    assert verdict is not None and "no output and no CPU" in verdict.reason


def test_output_is_activity() -> None:
    rule = StallRule(STALL)
    samples = [RankSample(main_busy=True, stack="spin", output=i % 8 == 0) for i in range(60)]
    assert _run(rule, 0, samples) == []


def test_unsampled_ranks_keep_the_cpu_rule() -> None:
    rule = StallRule(STALL)
    assert _run(rule, 0, [RankSample(main_busy=True)] * 60) == []
    assert _run(rule, 1, [RankSample(helpers_busy=True)] * 60) == []
    assert _run(rule, 2, [RankSample()] * 60)


def test_a_progress_regex_is_the_only_progress() -> None:
    rule = StallRule(STALL, progress="^step ")
    # Heartbeats, CPU and a moving stack: no matching line, so stalled.
    noisy = [
        RankSample(output=True, main_busy=True, helpers_busy=True, stack=str(i)) for i in range(40)
    ]
    rule.start(1, 0.0)
    rule.observe(1, RankSample(progress=True), 0.1)  # rank 1 prints steps: rank 0 is judged alone
    stalled = _run(rule, 0, noisy)
    assert stalled, "output, CPU and a moving stack are not progress with a regex"
    verdict = rule.observe(0, noisy[0], 20.1)
    assert verdict is not None and "no progress line from any rank" in verdict.reason


def test_ranks_that_never_print_progress_follow_the_group() -> None:
    rule = StallRule(STALL, progress="^step ")
    for rank in range(4):
        rule.start(rank, 0.0)
    t = 0.0
    for _ in range(60):  # 30 s: rank 0 prints a step every second, the others nothing
        t += 0.5
        for rank in range(4):
            s = RankSample(progress=rank == 0 and t % 1 == 0)
            assert rule.observe(rank, s, t) is None, (rank, t)
    # Rank 0 stops printing: after stall_after every rank is stalled, rank 0
    # by its own lines, the others by the group's.
    verdicts: dict[int, tuple[float, str]] = {}
    while len(verdicts) < 4 and t < 60:
        t += 0.5
        for rank in range(4):
            v = rule.observe(rank, RankSample(), t)
            if v is not None:
                verdicts.setdefault(rank, (t, v.reason))
    assert sorted(verdicts) == [0, 1, 2, 3]
    assert {when for when, _ in verdicts.values()} == {30.0 + STALL}
    assert verdicts[0][1].startswith("no progress line for")
    assert "judged by the group's progress" in verdicts[1][1]


def test_a_restarted_rank_starts_afresh() -> None:
    rule = StallRule(STALL)
    assert _run(rule, 0, [RankSample(stack="s")] * 20)
    rule.start(0, 100.0)
    assert rule.observe(0, RankSample(stack="s"), 100.5) is None
    rule.forget(0)
    assert rule.observe(0, RankSample(stack="s"), 200.0) is None  # unknown: a fresh start


# -- the rule against a reference model ------------------------------------------


@dataclass(frozen=True)
class _Step:
    dt: float
    sample: RankSample


_samples = st.builds(
    RankSample,
    output=st.booleans(),
    progress=st.booleans(),
    main_busy=st.booleans(),
    helpers_busy=st.booleans(),
    stack=st.one_of(st.none(), st.sampled_from(["a", "b"])),
)
_steps = st.lists(
    st.builds(_Step, dt=st.floats(0.05, 3.0), sample=_samples), min_size=1, max_size=80
)


def _reference(steps: list[_Step], progress: bool) -> list[bool]:
    """The rule as the docs state it, written out differently: the time of
    the last interval that showed activity, and stalled once that is
    ``stall_after`` old."""
    t = last = 0.0
    prev_stack: str | None = None
    printed = False
    group = 0.0
    out = []
    for step in steps:
        t += step.dt
        s = step.sample
        if progress:
            activity = s.progress
            printed |= s.progress
            group = t if s.progress else group
        elif s.stack is None:
            activity = s.output or s.main_busy or s.helpers_busy
        else:
            moved = prev_stack is not None and s.stack != prev_stack
            activity = s.output or (moved and (s.main_busy or s.helpers_busy))
            activity = activity or (not s.main_busy and s.helpers_busy)
        prev_stack = s.stack if s.stack is not None else prev_stack
        last = t if activity else last
        since = max(group, last) if progress and not printed else last
        out.append(t - since >= STALL)
    return out


@settings(max_examples=300, deadline=None)
@given(steps=_steps, progress=st.booleans())
def test_the_rule_matches_its_definition(steps: list[_Step], progress: bool) -> None:
    rule = StallRule(STALL, progress="^step" if progress else None)
    rule.start(0, 0.0)
    t = 0.0
    got = []
    for step in steps:
        t += step.dt
        got.append(rule.observe(0, step.sample, t) is not None)
    assert got == _reference(steps, progress)
