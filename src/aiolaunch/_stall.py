"""The stall rule: when is a rank stuck? A pure function of samples and time.

:class:`StallDetector` turns what the sampler read of each rank
(:class:`Sample`: CPU time, when output or a progress line was last seen,
process state) into a :class:`Stall` the first time a rank has been idle for
``stall_after`` seconds, and into nothing otherwise. It does no I/O and reads
no clock (``now`` is an argument), so the rule is unit-tested without a
process (tests/test_stall_rule.py).

Activity, between two samples of the same process:

- output: ``last_output`` advanced (every ``write()``, read from
  ``/proc/<pid>/io`` or seen by the log pipeline) - or, with a progress regex,
  ``last_progress`` advanced instead (only lines matching it count);
- CPU: CPU time advanced by at least :data:`CPU_BUSY_FRACTION` of one core.

A rank with neither for ``stall_after`` seconds is stalled; it is reported
once, and again only after it was active in between. The first sample of a
process (a new rank, or a restarted one) only sets the baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CPU_BUSY_FRACTION", "Sample", "Stall", "StallDetector"]

#: CPU time below this fraction of one core between samples is "not advancing"
CPU_BUSY_FRACTION = 0.10


@dataclass(frozen=True)
class Sample:
    """One reading of a rank's process, as the sampler took it.

    :param pid: the process sampled (a new pid starts a new baseline).
    :param cpu_s: its CPU time so far, in seconds.
    :param last_output: monotonic time it was last seen writing, or ``None``.
    :param last_progress: monotonic time of its last line matching the
        progress regex, or ``None``.
    :param state: the ``/proc`` state letter (``"R"``, ``"S"``, ``"D"``, ...),
        ``"?"`` when unknown.
    :param wchan: the kernel function it sleeps in (read for ``"D"`` only).
    """

    pid: int
    cpu_s: float
    last_output: float | None = None
    last_progress: float | None = None
    state: str = "?"
    wchan: str = ""


@dataclass(frozen=True)
class Stall:
    """A rank the watchdog flagged: why, how long, and where it is.

    ``verdict_line`` (the rank's line of the stack verdict) and
    ``stacks_file`` are filled in once the stacks were dumped
    (``dataclasses.replace``).
    """

    rank: int
    pid: int
    idle_s: float
    reason: str
    verdict_line: str = ""
    stacks_file: str = ""

    def message(self) -> str:
        """The text that becomes the rank's ``ProcessFailure.message``."""
        # The summary goes last, as an exception's line ends a traceback (the
        # agent's one-line log of the root cause shows the last line).
        head = f"stacks: {self.stacks_file}\n" if self.stacks_file else ""
        where = f"; {self.verdict_line}" if self.verdict_line else ""
        return f"{head}stalled: {self.reason}{where}"


@dataclass
class _Memory:
    """What the rule remembers of one rank's process between samples."""

    pid: int
    t: float
    cpu_s: float
    output: float | None
    last_active: float
    flagged: bool = False


class StallDetector:
    """The stall rule over successive samples of every rank (no I/O, no clock).

    :param stall_after: seconds without activity that make a stall, > 0.
    :param progress: ``True`` when a progress regex is set: ``last_progress``
        is the output that counts, ``last_output`` is ignored.
    """

    def __init__(self, stall_after: float, *, progress: bool = False) -> None:
        self.stall_after = stall_after
        self.progress = progress
        self._ranks: dict[int, _Memory] = {}

    def observe(self, rank: int, sample: Sample, now: float) -> Stall | None:
        """Take ``sample`` of ``rank`` at ``now`` (monotonic seconds).

        :returns: a :class:`Stall` when ``rank`` has just crossed
            ``stall_after`` without activity (once per stall), else ``None``.
        """
        output = sample.last_progress if self.progress else sample.last_output
        m = self._ranks.get(rank)
        if m is None or m.pid != sample.pid:  # first sight, or a new incarnation
            self._ranks[rank] = _Memory(sample.pid, now, sample.cpu_s, output, now)
            return None
        dt = now - m.t
        busy = dt > 0 and sample.cpu_s - m.cpu_s >= CPU_BUSY_FRACTION * dt
        if output is not None and (m.output is None or output > m.output):
            m.last_active = max(m.last_active, min(output, now))
        if busy:
            m.last_active = now
        m.t, m.cpu_s, m.output = now, sample.cpu_s, output
        idle = now - m.last_active
        if idle < self.stall_after:
            m.flagged = False  # active again: the next stall is a new one
            return None
        if m.flagged:
            return None
        m.flagged = True
        return Stall(rank, sample.pid, round(idle, 3), self._reason(sample, idle))

    def _reason(self, sample: Sample, idle: float) -> str:
        limit = f"stall_after={self.stall_after:g}s"
        if sample.state == "D":
            where = f" in {sample.wchan}" if sample.wchan else ""
            return f"in uninterruptible sleep (D state){where}, no CPU for {idle:.1f}s ({limit})"
        what = "no progress line" if self.progress else "no output"
        return f"{what} and no CPU for {idle:.1f}s ({limit})"

    def idle(self, rank: int, now: float) -> float | None:
        """Seconds ``rank`` has been without activity at ``now``; ``None`` if not tracked."""
        m = self._ranks.get(rank)
        return None if m is None else now - m.last_active

    def flagged(self, rank: int) -> bool:
        """Whether ``rank`` is stalled now (flagged and not active since)."""
        m = self._ranks.get(rank)
        return m is not None and m.flagged

    def flag(self, rank: int) -> None:
        """Count ``rank`` as stalled until it is active again (a stall decided
        elsewhere, e.g. the odd one out of ranks stalled together)."""
        m = self._ranks.get(rank)
        if m is not None:
            m.flagged = True

    def forget(self, rank: int) -> None:
        """``rank``'s process is gone or restarting: drop what is known of it."""
        self._ranks.pop(rank, None)
