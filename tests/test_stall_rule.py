"""The stall rule as a pure function of samples and time: no process is started."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolaunch._hangs._stall import CPU_BUSY_FRACTION, Sample, StallDetector

# (seconds since the previous sample, busy: a full core since then, wrote: output at the sample)
Step = tuple[float, bool, bool]
steps = st.lists(
    st.tuples(st.floats(0.05, 5.0), st.booleans(), st.booleans()), min_size=1, max_size=80
)


def _run(det: StallDetector, plan: list[Step], *, progress: bool = False) -> list[int]:
    """Feed ``plan`` to ``det`` for rank 0; the indices of the samples that stalled."""
    now, cpu, out = 100.0, 0.0, None
    det.observe(0, Sample(pid=7, cpu_s=cpu), now)  # the baseline
    found = []
    for i, (dt, busy, wrote) in enumerate(plan):
        now += dt
        cpu += dt if busy else 0.0
        if wrote:
            out = now
        sample = Sample(7, cpu, last_progress=out) if progress else Sample(7, cpu, last_output=out)
        if det.observe(0, sample, now) is not None:
            found.append(i)
    return found


def _expected(plan: list[Step], stall_after: float) -> list[int]:
    """The rule in words: a stall each time a stretch without CPU or output
    first reaches ``stall_after``."""
    now = last_active = 100.0
    flagged = False
    found = []
    for i, (dt, busy, wrote) in enumerate(plan):
        now += dt
        if busy or wrote:
            last_active = now
        if now - last_active < stall_after:
            flagged = False
        elif not flagged:
            flagged = True
            found.append(i)
    return found


@settings(max_examples=300, deadline=None)
@given(plan=steps, stall_after=st.floats(0.5, 30.0))
def test_a_stall_is_each_idle_stretch_reaching_stall_after(
    plan: list[Step], stall_after: float
) -> None:
    assert _run(StallDetector(stall_after), plan) == _expected(plan, stall_after)


@settings(max_examples=200, deadline=None)
@given(plan=steps, stall_after=st.floats(0.5, 30.0))
def test_with_a_progress_regex_only_progress_lines_count_as_output(
    plan: list[Step], stall_after: float
) -> None:
    # (These ranks are not sampled: their CPU counts, as without a regex.)
    det = StallDetector(stall_after, progress=True)
    assert _run(det, plan, progress=True) == _expected(plan, stall_after)
    # ... and plain output does not: the same plan with output only as writes
    det = StallDetector(stall_after, progress=True)
    no_progress = [(dt, busy, False) for dt, busy, _ in plan]
    assert _run(det, plan) == _expected(no_progress, stall_after)


@settings(max_examples=200, deadline=None)
@given(dts=st.lists(st.floats(0.05, 5.0), min_size=1, max_size=50), stall_after=st.floats(0.5, 10))
def test_a_busy_rank_never_stalls(dts: list[float], stall_after: float) -> None:
    assert _run(StallDetector(stall_after), [(dt, True, False) for dt in dts]) == []


def test_cpu_below_the_busy_fraction_is_idle() -> None:
    det = StallDetector(5.0)
    det.observe(0, Sample(1, cpu_s=0.0), 0.0)
    cpu = 0.0
    for t in range(1, 5):
        cpu += CPU_BUSY_FRACTION * 0.9  # just under a tenth of a core per second
        assert det.observe(0, Sample(1, cpu_s=cpu), float(t)) is None
    stall = det.observe(0, Sample(1, cpu_s=cpu + 0.09), 5.0)
    assert stall is not None and stall.idle_s == pytest.approx(5.0)
    assert stall.reason == "no output and no CPU for 5.0s (stall_after=5s)"


def test_the_first_sample_of_a_process_is_only_a_baseline() -> None:
    det = StallDetector(1.0)
    assert det.observe(3, Sample(10, cpu_s=0.0), 0.0) is None
    assert det.observe(3, Sample(10, cpu_s=0.0), 5.0) is not None
    # a restarted rank (new pid) starts over, whatever its predecessor did
    assert det.observe(3, Sample(11, cpu_s=0.0), 6.0) is None
    assert not det.flagged(3)
    assert det.observe(3, Sample(11, cpu_s=0.0), 6.5) is None
    assert det.observe(3, Sample(11, cpu_s=0.0), 7.0) is not None


def test_output_older_than_the_last_sample_is_not_activity() -> None:
    det = StallDetector(2.0)
    det.observe(0, Sample(1, 0.0, last_output=50.0), 100.0)
    assert det.observe(0, Sample(1, 0.0, last_output=50.0), 101.0) is None
    assert det.observe(0, Sample(1, 0.0, last_output=50.0), 102.0) is not None


def test_output_between_samples_counts_from_when_it_happened() -> None:
    det = StallDetector(2.0)
    det.observe(0, Sample(1, 0.0), 0.0)
    assert det.observe(0, Sample(1, 0.0, last_output=0.5), 1.0) is None
    # idle since 0.5, not since the sample at 1.0
    assert det.idle(0, 2.5) == pytest.approx(2.0)
    assert det.observe(0, Sample(1, 0.0, last_output=0.5), 2.5) is not None


def test_d_state_is_named_with_its_kernel_function() -> None:
    det = StallDetector(1.0)
    det.observe(0, Sample(1, 0.0), 0.0)
    stall = det.observe(0, Sample(1, 0.0, state="D", wchan="nfs_wait_bit"), 1.5)
    assert stall is not None
    assert stall.reason.startswith("in uninterruptible sleep (D state) in nfs_wait_bit")


def test_flagged_until_active_and_forgotten_when_gone() -> None:
    det = StallDetector(1.0)
    det.observe(0, Sample(1, 0.0), 0.0)
    assert det.observe(0, Sample(1, 0.0), 1.0) is not None
    assert det.flagged(0)
    assert det.observe(0, Sample(1, 0.0), 2.0) is None  # reported once
    assert det.observe(0, Sample(1, 2.0), 3.0) is None  # busy: no longer flagged
    assert not det.flagged(0)
    det.flag(0)
    assert det.flagged(0)
    det.forget(0)
    assert not det.flagged(0) and det.idle(0, 9.0) is None


def test_stall_message_puts_the_summary_last() -> None:
    det = StallDetector(1.0)
    det.observe(2, Sample(9, 0.0), 0.0)
    stall = det.observe(2, Sample(9, 0.0), 1.0)
    assert stall is not None and (stall.rank, stall.pid) == (2, 9)
    assert stall.message() == "stalled: no output and no CPU for 1.0s (stall_after=1s)"


# -- stacks, helpers and the group's progress (issue #22) -------------------------------


@dataclass(frozen=True)
class Tick:
    """What happened to one rank between two samples (one second apart unless ``dt``)."""

    output: bool = False
    progress: bool = False
    main_busy: bool = False
    helpers_busy: bool = False
    stack: str | None = None
    dt: float = 1.0


def _feed(det: StallDetector, rank: int, ticks: list[Tick], t0: float = 0.0) -> list[float]:
    """Turn ``ticks`` into cumulative samples of ``rank``; the times it stalled."""
    now, main, helpers = t0, 0.0, 0.0
    out: float | None = None
    prog: float | None = None
    det.observe(rank, Sample(1, 0.0, main_s=0.0, helpers_s=0.0, stack=None), now)
    stalls = []
    for tick in ticks:
        now += tick.dt
        main += tick.dt if tick.main_busy else 0.0
        helpers += tick.dt if tick.helpers_busy else 0.0
        out = now if tick.output else out
        prog = now if tick.progress else prog
        sample = Sample(
            1, main + helpers, out, prog, main_s=main, helpers_s=helpers, stack=tick.stack
        )
        if det.observe(rank, sample, now) is not None:
            stalls.append(now)
    return stalls


STALL = 5.0


def test_a_spinning_rank_is_stalled_whatever_its_cpu() -> None:
    det = StallDetector(STALL)
    stalls = _feed(det, 0, [Tick(main_busy=True, stack="spin (x.py:3)")] * 20)
    assert stalls == [STALL]  # once, from the start: it never moved
    stall_reason = _reason(StallDetector(STALL), [Tick(main_busy=True, stack="spin")] * 6)
    assert "spinning: 100% CPU with the main thread at the same frames" in stall_reason
    assert det.spinning(0)


def _reason(det: StallDetector, ticks: list[Tick]) -> str:
    now, main = 0.0, 0.0
    det.observe(0, Sample(1, 0.0, main_s=0.0, helpers_s=0.0), now)
    for tick in ticks:
        now += tick.dt
        main += tick.dt if tick.main_busy else 0.0
        stall = det.observe(0, Sample(1, main, main_s=main, helpers_s=0.0, stack=tick.stack), now)
        if stall is not None:
            return stall.reason
    raise AssertionError("no stall")


def test_a_moving_busy_rank_is_never_stalled() -> None:
    frames = ["a (x.py:1)", "b (x.py:2)", "c (x.py:3)"]
    ticks = [Tick(main_busy=True, stack=frames[i % 3]) for i in range(60)]
    assert _feed(StallDetector(STALL), 0, ticks) == []


def test_a_main_thread_waiting_while_helpers_work_is_not_stalled() -> None:
    join = [Tick(helpers_busy=True, stack="join (threading.py:1)")] * 60
    assert _feed(StallDetector(STALL), 0, join) == []
    # ...but a main thread spinning while helpers work is a spin.
    both = [Tick(main_busy=True, helpers_busy=True, stack="item (x.py:9)")] * 60
    assert _feed(StallDetector(STALL), 0, both) == [STALL]


def test_idle_ranks_are_stalled_moving_or_not() -> None:
    # A sleep-poll loop moves between two lines without CPU: still a hang.
    ticks = [Tick(stack=("poll", "sleep")[i % 2]) for i in range(20)]
    assert _feed(StallDetector(STALL), 0, ticks) == [STALL]
    assert _reason(StallDetector(STALL), ticks).startswith("no output and no CPU for 5.0s")


def test_output_is_activity_for_a_spinning_rank() -> None:
    ticks = [Tick(main_busy=True, stack="spin", output=i % 4 == 0) for i in range(60)]
    assert _feed(StallDetector(STALL), 0, ticks) == []


def test_unsampled_ranks_keep_the_cpu_rule_over_the_whole_worker() -> None:
    assert _feed(StallDetector(STALL), 0, [Tick(main_busy=True)] * 60) == []
    assert _feed(StallDetector(STALL), 1, [Tick(helpers_busy=True)] * 60) == []
    assert _feed(StallDetector(STALL), 2, [Tick()] * 60) == [STALL]


def test_heartbeats_are_not_progress_for_a_spinning_rank() -> None:
    # A GPU rank spinning in .item() while a thread prints heartbeats.
    spin = [Tick(output=True, main_busy=True, stack="item (train.py:9)")] * 20
    assert _feed(StallDetector(STALL, progress=True), 0, spin) == [STALL]
    assert _feed(StallDetector(STALL), 0, spin) == []  # without a regex output is output
    # A moving stack with CPU is work, regex or not (a silent compute phase).
    moving = [Tick(main_busy=True, stack=str(i % 3)) for i in range(20)]
    assert _feed(StallDetector(STALL, progress=True), 0, moving) == []
    # With a regex, helpers at work while the main thread waits do not count.
    waits = [Tick(helpers_busy=True, stack="join")] * 20
    assert _feed(StallDetector(STALL, progress=True), 0, waits) == [STALL]


def test_ranks_that_never_print_progress_follow_the_group() -> None:
    det = StallDetector(STALL, progress=True)
    t = 0.0
    for rank in range(4):
        det.observe(rank, Sample(rank + 1, 0.0), t)
    last: float | None = None
    for _ in range(60):  # 30 s: rank 0 prints a step every second, the others nothing
        t += 0.5
        if t % 1 == 0:
            last = t
        for rank in range(4):
            sample = Sample(rank + 1, 0.0, last_progress=last if rank == 0 else None)
            assert det.observe(rank, sample, t) is None, (rank, t)
    # Rank 0 stops printing: after stall_after every rank is stalled, rank 0
    # by its own lines, the others by the group's.
    verdicts: dict[int, tuple[float, str]] = {}
    while len(verdicts) < 4 and t < 60:
        t += 0.5
        for rank in range(4):
            sample = Sample(rank + 1, 0.0, last_progress=last if rank == 0 else None)
            stall = det.observe(rank, sample, t)
            if stall is not None:
                verdicts.setdefault(rank, (t, stall.reason))
    assert sorted(verdicts) == [0, 1, 2, 3]
    assert {when for when, _ in verdicts.values()} == {30.0 + STALL}
    assert verdicts[0][1].startswith("no progress line and no CPU for 5.0s")
    assert "judged by the group's" in verdicts[1][1]


def test_progress_printed_before_the_first_sample_counts_for_the_rank() -> None:
    # Rank 1 printed its steps before the watchdog's first sample, then
    # stopped; rank 0 goes on printing. Rank 1 is a rank that prints
    # progress: judged by its own lines, it is stalled stall_after later.
    det = StallDetector(STALL, progress=True)
    det.observe(0, Sample(1, 0.0, last_progress=0.5), 1.0)
    det.observe(1, Sample(2, 0.0, last_progress=0.2), 1.0)
    t, stalled = 1.0, None
    while stalled is None and t < 30:
        t += 0.5
        assert det.observe(0, Sample(1, 0.0, last_progress=t), t) is None
        stalled = det.observe(1, Sample(2, 0.0, last_progress=0.2), t)
    assert stalled is not None and t == 1.0 + STALL
    assert stalled.reason.startswith("no progress line and no CPU for 5.0s"), stalled.reason


def test_a_rank_starved_of_cpu_still_wants_it() -> None:
    # main_s counts time waiting on the run queue: a loaded host's busy rank
    # gets 3 % of a core but wants all of it (schedstat), so it is busy.
    det = StallDetector(STALL)
    det.observe(0, Sample(1, 0.0, main_s=0.0, helpers_s=0.0), 0.0)
    for t in range(1, 30):
        sample = Sample(1, 0.03 * t, main_s=float(t), helpers_s=0.0)
        assert det.observe(0, sample, float(t)) is None


def test_a_starved_rank_at_the_same_frames_is_not_spinning() -> None:
    # A worker importing on a loaded host: runnable all the time (main_s),
    # but on a CPU 2 % of it: two stack samples at the same frames say
    # nothing about a spin (the agent's restart test flaked at load ~10).
    det = StallDetector(STALL)
    det.observe(0, Sample(1, 0.0, main_s=0.0, helpers_s=0.0, main_run_s=0.0), 0.0)
    for t in range(1, 30):
        sample = Sample(
            1,
            0.02 * t,
            main_s=float(t),
            helpers_s=0.0,
            main_run_s=0.02 * t,
            stack="_create_fn (dataclasses.py:433)",
        )
        assert det.observe(0, sample, float(t)) is None
    # A spinner that gets 20 % of a core on the same host is still a spin.
    det = StallDetector(STALL)
    det.observe(0, Sample(1, 0.0, main_s=0.0, helpers_s=0.0, main_run_s=0.0), 0.0)
    stalls = []
    for t in range(1, 30):
        sample = Sample(
            1, 0.2 * t, main_s=float(t), helpers_s=0.0, main_run_s=0.2 * t, stack="spin (x.py:3)"
        )
        if det.observe(0, sample, float(t)) is not None:
            stalls.append(t)
    assert stalls == [STALL]
    # Without main_run_s, the process's CPU bounds what the main thread ran.
    det = StallDetector(STALL)
    det.observe(0, Sample(1, 0.0, main_s=0.0, helpers_s=0.0), 0.0)
    for t in range(1, 30):
        sample = Sample(1, 0.02 * t, main_s=float(t), helpers_s=0.0, stack="import (x.py:1)")
        assert det.observe(0, sample, float(t)) is None


_ticks = st.lists(
    st.builds(
        Tick,
        output=st.booleans(),
        progress=st.booleans(),
        main_busy=st.booleans(),
        helpers_busy=st.booleans(),
        stack=st.one_of(st.none(), st.sampled_from(["a", "b"])),
        dt=st.floats(0.05, 3.0),
    ),
    min_size=1,
    max_size=80,
)


def _reference(ticks: list[Tick], progress: bool) -> list[bool]:
    """The rule as the docs state it, written out per interval: the time of
    the last interval that showed activity, stalled once that is
    ``stall_after`` old (reported once per stall)."""
    t = last = 0.0
    group: float | None = None  # the group's last progress line
    prev: str | None = None
    printed = flagged = False
    out = []
    for tick in ticks:
        t += tick.dt
        line = tick.progress if progress else tick.output
        if progress and tick.progress:
            group, printed = t, True
        if tick.stack is None:
            activity = line or tick.main_busy or tick.helpers_busy
        else:
            moved = prev is not None and tick.stack != prev
            activity = line or (moved and (tick.main_busy or tick.helpers_busy))
            if not progress:
                activity = activity or (not tick.main_busy and tick.helpers_busy)
        prev = tick.stack if tick.stack is not None else prev
        last = t if activity else last
        since = max(group, last) if group is not None and not printed else last
        stalled = t - since >= STALL
        out.append(stalled and not flagged)
        flagged = stalled
    return out


@settings(max_examples=300, deadline=None)
@given(ticks=_ticks, progress=st.booleans())
def test_the_rule_matches_its_definition(ticks: list[Tick], progress: bool) -> None:
    det = StallDetector(STALL, progress=progress)
    stalls = set(_feed(det, 0, ticks))
    t, got = 0.0, []
    for tick in ticks:
        t += tick.dt
        got.append(t in stalls)
    assert got == _reference(ticks, progress)


def test_only_busy_quiet_ranks_are_worth_a_stack_sample() -> None:
    det = StallDetector(STALL)
    det.observe(0, Sample(1, 0.0, main_s=0.0, helpers_s=0.0), 0.0)
    busy = Sample(1, 1.0, main_s=1.0, helpers_s=0.0, state="R")
    assert det.wants_stack(0, busy, 1.0)  # CPU without output, running: may spin
    assert not det.wants_stack(0, Sample(1, 1.0, main_s=1.0, state="S"), 1.0)  # asleep now
    assert not det.wants_stack(0, Sample(1, 0.0, main_s=0.0, helpers_s=0.0), 1.0)  # idle
    assert not det.wants_stack(0, Sample(1, 1.0, 0.5, main_s=1.0, helpers_s=0.0), 1.0)  # wrote
    assert not det.wants_stack(1, busy, 1.0)  # unknown rank
    assert not det.wants_stack(0, Sample(2, 1.0, main_s=1.0), 1.0)  # a new process
    # With a regex, plain output does not spare the sample; a progress line does.
    det = StallDetector(STALL, progress=True)
    det.observe(0, Sample(1, 0.0, main_s=0.0), 0.0)
    assert det.wants_stack(0, Sample(1, 1.0, 0.5, main_s=1.0), 1.0)
    assert not det.wants_stack(0, Sample(1, 1.0, None, 0.5, main_s=1.0), 1.0)
