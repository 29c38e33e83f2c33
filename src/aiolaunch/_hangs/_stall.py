"""The stall rule: when is a rank stuck? A pure function of samples and time.

:class:`StallDetector` turns what the sampler read of each rank
(:class:`Sample`: CPU times, when output or a progress line was last seen,
the stack signature, process state) into a :class:`Stall` the first time a
rank has been without activity for ``stall_after`` seconds, and into nothing
otherwise. It does no I/O and reads no clock (``now`` is an argument), so the
rule is unit-tested without a process (tests/test_stall_rule.py).

Activity, between two samples of the same process:

- output: without a progress regex, any write (or what the log pipeline
  saw); with one, only a line matching it - and a rank that never printed
  one (the usual rank-0-only logging) takes any rank's line as its own.
- for a rank whose stack is sampled (a Python worker started through
  aiolaunch's bootstrap): its main thread's stack moved (another signature
  than at the previous sample) while it used CPU; or - without a regex - its
  main thread waited (under :data:`CPU_BUSY_FRACTION` of a core) while its
  helpers worked: other threads, descendants such as DataLoader workers or a
  child it waits on. A main thread burning CPU at the same frames in every
  sample is *spinning* (a GPU rank in ``.item()`` or an NCCL wait, a Python
  wait loop): no activity, whatever its CPU, and its heartbeats are no
  progress line either.
- for a rank that cannot be sampled (a binary, a program not started
  through the bootstrap, a Python worker finalizing, one whose dump did not
  come): CPU anywhere in the worker (main thread, other threads,
  descendants): the rule before stacks were sampled.

CPU counts as *wanted*: time on a CPU plus time runnable on the run queue,
so a busy rank starved by a loaded host is not idle. A sampled rank whose
main thread wanted the CPU most of an interval but ran under
:data:`CPU_BUSY_FRACTION` of it (a rank starting up on a loaded host) is
active too: its stack had no chance to move, so "the same frames" is no
evidence of a spin. A rank without activity
for ``stall_after`` seconds is stalled; it is reported once, and again only
after it was active in between. The first sample of a process (a new rank,
or a restarted one) only sets the baseline.

Limits (documented in :class:`aiolaunch.Watchdog`): a Python wait loop that
alternates between functions looks like work (its stack moves); one call into
C that computes longer than ``stall_after`` without output looks like a spin.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CPU_BUSY_FRACTION", "STARVED_FRACTION", "Sample", "Stall", "StallDetector"]

#: CPU time below this fraction of one core between samples is "not advancing"
CPU_BUSY_FRACTION = 0.10
#: a main thread that wanted at least this fraction of one core (on a CPU or
#: runnable) but ran under CPU_BUSY_FRACTION of it is starved, not spinning
STARVED_FRACTION = 0.5


@dataclass(frozen=True)
class Sample:
    """One reading of a rank's process, as the sampler took it.

    :param pid: the process sampled (a new pid starts a new baseline).
    :param cpu_s: its CPU time so far (every thread, and the children it
        reaped), in seconds.
    :param last_output: monotonic time it was last seen writing, or ``None``.
    :param last_progress: monotonic time of its last line matching the
        progress regex, or ``None``.
    :param state: the ``/proc`` state letter (``"R"``, ``"S"``, ``"D"``, ...),
        ``"?"`` when unknown.
    :param wchan: the kernel function it sleeps in (read for ``"D"`` only).
    :param main_s: CPU its main thread wanted so far (on a CPU, or runnable
        waiting for one), or ``None`` when unknown: then ``cpu_s`` is all.
    :param helpers_s: CPU its helpers wanted so far (other threads,
        descendants), or ``None`` when unknown.
    :param stack: the signature of its main thread's stack (and asyncio
        tasks) now (:func:`aiolaunch._hangs._dump_text.signature`), or ``None`` when
        it was not sampled.
    :param main_run_s: CPU its main thread got so far (on a CPU only), or
        ``None`` when unknown: then ``cpu_s`` bounds it.
    """

    pid: int
    cpu_s: float
    last_output: float | None = None
    last_progress: float | None = None
    state: str = "?"
    wchan: str = ""
    main_s: float | None = None
    helpers_s: float | None = None
    stack: str | None = None
    main_run_s: float | None = None


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
    last: Sample
    last_active: float
    stack: str | None = None
    flagged: bool = False
    printed: bool = False  # a progress line was seen (progress regex)
    # since the last activity: samples, stack samples at the same frames,
    # those with the main thread busy, and the CPU % over them
    quiet: int = 0
    still: int = 0
    busy: int = 0
    cpu_percent: float = 0.0
    #: the main thread (the worker, where not known) used the CPU in the last interval
    main_busy: bool = False


def _delta(now: float | None, before: float | None) -> float | None:
    return None if now is None or before is None else now - before


class StallDetector:
    """The stall rule over successive samples of every rank (no I/O, no clock).

    :param stall_after: seconds without activity that make a stall, > 0.
    :param progress: ``True`` when a progress regex is set: progress lines
        (``last_progress``) are the only output, ``last_output`` is ignored,
        and helpers' CPU does not count.
    """

    def __init__(self, stall_after: float, *, progress: bool = False) -> None:
        self.stall_after = stall_after
        self.progress = progress
        self._ranks: dict[int, _Memory] = {}
        #: the last progress line of any rank; ``None`` until the first
        self._group_progress: float | None = None

    def observe(self, rank: int, sample: Sample, now: float) -> Stall | None:
        """Take ``sample`` of ``rank`` at ``now`` (monotonic seconds).

        :returns: a :class:`Stall` when ``rank`` has just crossed
            ``stall_after`` without activity (once per stall), else ``None``.
        """
        m = self._ranks.get(rank)
        if m is None or m.pid != sample.pid:  # first sight, or a new incarnation
            m = self._ranks[rank] = _Memory(sample.pid, now, sample, now, sample.stack)
            # Lines printed before the first sample count: the rank prints
            # progress (it is judged by its own lines, not the group's).
            m.printed = self._line(sample.last_progress, None, now) is not None
            return None
        # Output counts from when it happened.
        if self.progress:
            line = self._line(sample.last_progress, m.last.last_progress, now)
            if line is not None:
                m.printed = True
                m.last_active = max(m.last_active, line)
        else:
            out = sample.last_output
            if out is not None and (m.last.last_output is None or out > m.last.last_output):
                m.last_active = max(m.last_active, min(out, now))
        if self._active(m, sample, now):
            m.last_active = now
            m.quiet = m.still = m.busy = 0
            m.cpu_percent = 0.0
        m.t, m.last = now, sample
        if sample.stack is not None:
            m.stack = sample.stack
        idle = self._idle(m, now)
        if idle < self.stall_after:
            m.flagged = False  # active again: the next stall is a new one
            return None
        if m.flagged:
            return None
        m.flagged = True
        return Stall(rank, sample.pid, round(idle, 3), self._reason(m, sample, idle))

    def _line(self, line: float | None, before: float | None, now: float) -> float | None:
        """A new progress line (its time), noted as the group's progress."""
        if line is None or (before is not None and line <= before):
            return None
        line = min(line, now)
        if self._group_progress is None or line > self._group_progress:
            self._group_progress = line
        return line

    def _active(self, m: _Memory, sample: Sample, now: float) -> bool:
        """Whether the interval since ``m``'s last sample showed activity
        besides output; counts what the reason needs."""
        dt = now - m.t
        floor = CPU_BUSY_FRACTION * dt
        main = _delta(sample.main_s, m.last.main_s)
        if main is None:
            main_busy, helpers_busy = dt > 0 and sample.cpu_s - m.last.cpu_s >= floor, False
        else:
            main_busy = dt > 0 and main >= floor
            helpers = _delta(sample.helpers_s, m.last.helpers_s)
            helpers_busy = dt > 0 and helpers is not None and helpers >= floor
        m.main_busy = main_busy
        if sample.stack is None or self._starved(m, sample, main, dt):
            # Not sampled, or starved (its stack could not move): CPU
            # anywhere in the worker.
            active = main_busy or helpers_busy
        else:
            moved = m.stack is not None and sample.stack != m.stack
            active = moved and (main_busy or helpers_busy)
            if not self.progress:  # helpers at work while the main thread waits
                active = active or (not main_busy and helpers_busy)
            if not active and not moved:
                m.still += 1
                m.busy += main_busy
        if not active:
            m.quiet += 1
            if dt > 0:
                m.cpu_percent += 100.0 * max(0.0, sample.cpu_s - m.last.cpu_s) / dt
        return active

    @staticmethod
    def _starved(m: _Memory, sample: Sample, main: float | None, dt: float) -> bool:
        """Whether the main thread wanted most of a core since ``m``'s last
        sample but ran under :data:`CPU_BUSY_FRACTION` of it."""
        if main is None or dt <= 0 or main < STARVED_FRACTION * dt:
            return False
        ran = _delta(sample.main_run_s, m.last.main_run_s)
        if ran is None:
            ran = sample.cpu_s - m.last.cpu_s
        return ran < CPU_BUSY_FRACTION * dt

    def _idle(self, m: _Memory, now: float) -> float:
        if self.progress and not m.printed and self._group_progress is not None:
            return now - max(m.last_active, self._group_progress)
        return now - m.last_active

    def _reason(self, m: _Memory, sample: Sample, idle: float) -> str:
        limit = f"stall_after={self.stall_after:g}s"
        if sample.state == "D":
            where = f" in {sample.wchan}" if sample.wchan else ""
            return f"in uninterruptible sleep (D state){where}, no CPU for {idle:.1f}s ({limit})"
        if not self.progress:
            what = "no output"
        elif m.printed or self._group_progress is None:
            what = "no progress line"
        else:
            what = "no progress line from any rank (this rank prints none: judged by the group's)"
        if m.still and m.busy * 2 >= m.quiet:
            cpu = m.cpu_percent / max(m.quiet, 1)
            return (
                f"{what} for {idle:.1f}s, spinning: {cpu:.0f}% CPU with the main thread "
                f"at the same frames in {m.still + 1} samples ({limit})"
            )
        if m.busy:
            return (
                f"{what} for {idle:.1f}s, the main thread at the same frames in "
                f"{m.still + 1} samples ({limit})"
            )
        return f"{what} and no CPU for {idle:.1f}s ({limit})"

    def wants_stack(self, rank: int, sample: Sample, now: float) -> bool:
        """Whether ``rank``'s stack is worth sampling with ``sample`` (before
        :meth:`observe` takes it): only a main thread that used CPU without
        output since the previous sample, and runs now (``R``), can be
        spinning. A sleeping rank (in a collective, a rendezvous: C code that
        may not like signals - torch's store client logs an interrupted
        connect) or one that prints is left alone: the CPU rule judges it the
        same."""
        m = self._ranks.get(rank)
        if m is None or m.pid != sample.pid or now <= m.t or sample.state not in ("R", "?"):
            return False
        out = sample.last_progress if self.progress else sample.last_output
        before = m.last.last_progress if self.progress else m.last.last_output
        if out is not None and (before is None or out > before):
            return False
        main = _delta(sample.main_s, m.last.main_s)
        used = main if main is not None else sample.cpu_s - m.last.cpu_s
        return used >= CPU_BUSY_FRACTION * (now - m.t)

    def idle(self, rank: int, now: float) -> float | None:
        """Seconds ``rank`` has been without activity at ``now``; ``None`` if not tracked."""
        m = self._ranks.get(rank)
        return None if m is None else self._idle(m, now)

    def spinning(self, rank: int) -> bool:
        """Whether ``rank``'s main thread burns CPU at the same frames since
        its last activity."""
        m = self._ranks.get(rank)
        return m is not None and m.still > 0 and m.busy * 2 >= m.quiet

    def flagged(self, rank: int) -> bool:
        """Whether ``rank`` is stalled now (flagged and not active since)."""
        m = self._ranks.get(rank)
        return m is not None and m.flagged

    def busy(self, rank: int) -> bool:
        """Whether ``rank``'s main thread used the CPU in the last interval sampled
        (at least :data:`CPU_BUSY_FRACTION` of a core): working or spinning."""
        m = self._ranks.get(rank)
        return m is not None and m.main_busy

    def excuse(self, rank: int, now: float) -> None:
        """Count ``rank`` as active at ``now``: a stall judged to be none (a rank
        computing between collectives with nobody waiting for it, a rank
        waiting in a collective for a rank that works). It is judged again
        ``stall_after`` later."""
        m = self._ranks.get(rank)
        if m is not None:
            m.last_active = now
            m.flagged = False
            m.quiet = m.still = m.busy = 0
            m.cpu_percent = 0.0

    def flag(self, rank: int) -> None:
        """Count ``rank`` as stalled until it is active again (a stall decided
        elsewhere, e.g. the odd one out of ranks stalled together)."""
        m = self._ranks.get(rank)
        if m is not None:
            m.flagged = True

    def forget(self, rank: int) -> None:
        """``rank``'s process is gone or restarting: drop what is known of it."""
        self._ranks.pop(rank, None)
