"""The stall rule: is a rank stalled, given what the sampler saw? Pure: no
processes, no clock (the caller passes ``now``), unit-tested with hypothesis.

The sampler hands one :class:`RankSample` per rank and period: what happened
since that rank's previous sample. An interval *shows activity* when

- with ``progress`` (a regex): a line matched it. Nothing else counts, CPU
  least of all. A rank that never printed a matching line (the usual
  rank-0-only logging) is judged by the group's progress instead: it stalls
  when no rank printed one for ``stall_after``.
- without ``progress``, for a rank whose stack is sampled: it wrote output;
  or its main thread's stack moved (an other signature than at the previous
  sample) while it used CPU; or its main thread waited (under 10 % of a
  core) while its helpers worked (other threads, descendants: DataLoader
  workers, a child it waits on). A main thread that burns CPU at the same
  frames in every sample is *spinning* - a GPU rank in ``.item()`` or an
  NCCL wait, a Python wait loop - and shows no activity, whatever its CPU.
- without ``progress``, for a rank that cannot be sampled (a binary, a
  program not started through the bootstrap) or whose dump did not come: it
  wrote output, or any of its threads or descendants used CPU (the old rule,
  over the whole worker).

A rank is stalled once no interval showed activity for ``stall_after``.

Limits, documented in :class:`aiolaunch.Watchdog`: a Python wait loop that
alternates between two functions looks like work (its stack moves); a single
call into C that computes longer than ``stall_after`` with no output looks
like a spin.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankSample", "StallRule", "Stalled"]


@dataclass(frozen=True)
class RankSample:
    """What the sampler saw of one rank since its previous sample."""

    #: it (or a descendant) wrote, or the log pipeline saw its output
    output: bool = False
    #: a line matching the progress regex
    progress: bool = False
    #: its main thread used at least 10 % of a core
    main_busy: bool = False
    #: its other threads or its descendants used at least 10 % of a core
    helpers_busy: bool = False
    #: the stack signature now (:func:`aiolaunch._dump_text.signature`);
    #: ``None`` when it cannot be sampled or the dump did not come
    stack: str | None = None
    #: CPU of the whole worker, % of one core (for the reason)
    cpu_percent: float = 0.0


@dataclass(frozen=True)
class Stalled:
    """The rule's verdict on a rank: how long without activity, and why."""

    idle_s: float
    reason: str
    #: it burned CPU at the same frames (else it was idle)
    spinning: bool = False


@dataclass
class _Rank:
    last_active: float
    stack: str | None = None
    #: intervals since the last activity: counted, with a still stack
    #: sampled, with the main thread busy; and their CPU
    quiet: int = 0
    still: int = 0
    busy: int = 0
    cpu: float = 0.0
    printed: bool = False


class StallRule:
    """Per-rank state of the stall rule for one group (see the module docstring)."""

    def __init__(self, stall_after: float, progress: str | None = None) -> None:
        self.stall_after = stall_after
        self.progress = progress
        self._ranks: dict[int, _Rank] = {}
        self._group_progress: float | None = None

    def start(self, rank: int, now: float) -> None:
        """A rank (re)started at ``now``: its evidence starts afresh."""
        self._ranks[rank] = _Rank(last_active=now)
        if self._group_progress is None:
            self._group_progress = now

    def forget(self, rank: int) -> None:
        """A rank exited: no verdict on it until it starts again."""
        self._ranks.pop(rank, None)

    def observe(self, rank: int, sample: RankSample, now: float) -> Stalled | None:
        """Take one sample of ``rank``; the verdict if it is stalled now."""
        st = self._ranks.get(rank)
        if st is None:
            self.start(rank, now)
            st = self._ranks[rank]
        moved = sample.stack is not None and st.stack is not None and sample.stack != st.stack
        if sample.stack is not None:
            st.stack = sample.stack
        if self.progress is not None:
            if sample.progress:
                st.printed = True
                self._group_progress = now
            active = sample.progress
        elif sample.stack is not None:
            main_waits = not sample.main_busy
            active = (
                sample.output
                or (moved and (sample.main_busy or sample.helpers_busy))
                or (main_waits and sample.helpers_busy)
            )
        else:
            active = sample.output or sample.main_busy or sample.helpers_busy
        if active:
            st.last_active = now
            st.quiet = st.still = st.busy = 0
            st.cpu = 0.0
            return None
        st.quiet += 1
        st.cpu += sample.cpu_percent
        if sample.stack is not None and not moved:
            st.still += 1
            st.busy += sample.main_busy
        return self._verdict(st, now)

    def _verdict(self, st: _Rank, now: float) -> Stalled | None:
        after = f"stall_after={self.stall_after:g}s"
        if self.progress is not None and not st.printed:
            since = self._group_progress if self._group_progress is not None else now
            idle = now - max(since, st.last_active)
            if idle < self.stall_after:
                return None
            return Stalled(
                round(idle, 3),
                f"no progress line from any rank for {idle:.1f}s (this rank prints none: "
                f"judged by the group's progress; {after})",
            )
        idle = now - st.last_active
        if idle < self.stall_after:
            return None
        if self.progress is not None:
            return Stalled(round(idle, 3), f"no progress line for {idle:.1f}s ({after})")
        if st.still and st.busy * 2 >= st.quiet:
            cpu = st.cpu / max(st.quiet, 1)
            return Stalled(
                round(idle, 3),
                f"no output for {idle:.1f}s, spinning: {cpu:.0f}% CPU with the main thread "
                f"at the same frames in {st.still} samples ({after})",
                spinning=True,
            )
        if st.busy:
            return Stalled(
                round(idle, 3),
                f"no output for {idle:.1f}s, the main thread at the same frames in "
                f"{st.still} samples ({after})",
            )
        return Stalled(round(idle, 3), f"no output and no CPU for {idle:.1f}s ({after})")
