"""The stall rule as a pure function of samples and time: no process is started."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolaunch._stall import CPU_BUSY_FRACTION, Sample, StallDetector

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
