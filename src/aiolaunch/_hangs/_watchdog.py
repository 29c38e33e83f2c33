"""The stall watchdog's settings: :class:`Watchdog`.

What it watches is read by :mod:`aiolaunch._hangs._activity` (the ``/proc``
sampler), judged by :mod:`aiolaunch._hangs._stall` (the pure stall rule), and
acted on by :mod:`aiolaunch._hangs._watcher` (the sampling loop).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "MAX_STALL_AFTER",
    "MIN_STALL_AFTER",
    "Watchdog",
    "matches_every_line",
    "stall_after_problem",
]

#: the shortest ``stall_after``: the watchdog reads ``/proc`` at most once a
#: second, so a shorter one would flag every rank at its first quiet second
MIN_STALL_AFTER = 1.0
#: the longest ``stall_after`` (30 days): a longer one never fires in a real job
MAX_STALL_AFTER = 30 * 86400.0

_ACTIONS = ("observe", "fail", "restart")


def matches_every_line(pattern: str) -> bool:
    """Whether ``pattern``, searched in each line, matches every line: it
    matches the empty string (``""``, ``".*"``, ``"x?"``).

    :raises re.error: not a regular expression.
    """
    return re.compile(pattern).search("") is not None


def stall_after_problem(seconds: float) -> str | None:
    """What is wrong with a ``stall_after`` of ``seconds`` (a number > 0), or ``None``."""
    if seconds < MIN_STALL_AFTER:
        return (
            f"is shorter than the watchdog's sampling period ({MIN_STALL_AFTER:g} s): every "
            "rank would be flagged at its first quiet second"
        )
    if seconds > MAX_STALL_AFTER:
        return "is longer than 30 days: the watchdog would never flag a stall"
    return None


@dataclass(frozen=True)
class Watchdog:
    """Detect workers that hang, and name stragglers, without changing the worker's code.

    Pass it as ``start_processes(..., watchdog=Watchdog(...))`` (or
    ``WorkerSpec(watchdog=...)``, CLI ``--stall-timeout``). A worker is
    *stalled* when for ``stall_after`` seconds it shows no activity:

    - no output (with ``progress``: no line matching it - other output,
      heartbeats included, is not progress; a rank that never prints one, as
      ranks other than 0 usually don't, goes by the group's progress lines);
    - and its stack did not move: a Python worker started by aiolaunch (a
      function worker, or a script run by the CLI) is sampled through the
      dump signal once a period while its main thread burns CPU without
      output, and a main thread at the same frames in every sample is
      *spinning* - a GPU rank in ``.item()`` or an NCCL wait, a Python wait
      loop - stalled whatever its CPU. A stack that moves is work (a silent
      compute phase is healthy). Without ``progress``, a main thread that
      waits while its helpers work (other threads, DataLoader workers, a
      child it waits on) is active too.
    - A worker that cannot be sampled (a binary, a program not started
      through the bootstrap, a Python worker finalizing) keeps the rule from
      before stacks were sampled: no CPU anywhere in it (every thread, its
      descendants) for ``stall_after``.

    CPU counts as *wanted* (on a CPU or waiting on the run queue), so a busy
    worker starved by a loaded host is not idle; a sampled worker whose main
    thread wanted most of a core but ran under 10 % of it is judged by that
    rule too (its stack had no chance to move). A worker in uninterruptible
    sleep (D state) is caught as idle, and its reason names the D state and
    the kernel function it waits in. Limits: a Python wait loop that
    alternates between functions looks like work (its stack moves), and one
    call into C that computes longer than ``stall_after`` without output
    looks like a spin.

    On a stall the context emits :class:`aiolaunch.WorkerStalled` once per
    stall (again only after the worker was active in between), dumps the
    stacks of *every* rank to ``{log_dir}/{rank}/stacks-<n>.txt`` before
    anything is stopped, writes ``{log_dir}/report.json``/``report.txt`` and
    logs a warning naming them; then, by ``action``:

    - ``"observe"``: nothing more; the group keeps running.
    - ``"fail"``: the group is stopped and :meth:`PContext.wait` returns a
      failure whose ``ProcessFailure.message`` names "stalled", the reason
      and the rank's place in the outlier verdict. One story: when the
      stalled ranks wait in one place and another rank is elsewhere (the odd
      one out of the verdict), that rank is the failure and the root cause,
      whether idle, spinning or printing; the others are "stopped by
      aiolaunch".
    - ``"restart"``: a stalled rank with a :class:`RestartPolicy` is killed and
      restarted by it; otherwise as ``"fail"`` (an agent then restarts the
      group within ``max_restarts``).

    With a watchdog, the first failure of a rank also dumps every other live
    rank's stacks (at most ~2 s) before they are stopped: the report and the
    ``ChildFailedError`` summary (``others``) show where each rank was.

    Where a Python worker imports torch (2.8 or later), it also serves its
    collective record - torch's Flight Recorder, on torch's own per-rank
    control socket, armed with no code in the script (docs/hangs.md,
    "Collective forensics"; ``AIOLAUNCH_NO_COLLECTIVES=1`` in a rank's
    environment opts it out). A stall, and the first failure, then read every
    rank's record (at most 2 s) and say who holds the others up and where:
    ``report.json``'s ``"collective"`` (``missing``, ``mismatch``,
    ``in_compute``, ``exited`` or ``none``, the process group, the op, its
    sequence number), the end of :class:`aiolaunch.WorkerStalled`'s
    ``reason``, the culprits as the failure. And the records tell waits from
    work: a rank waiting in a collective for ranks that work (a rank 0
    evaluating) is not stalled; a rank computing between collectives with
    nobody waiting for it for ``stall_after`` is not stalled whatever its
    frames; one the others waited for that long whose stack stopped is
    (``in_compute``). A torch older than 2.8 is said once; its ranks are
    judged by their stacks as above.

    ``stragglers`` (a stack-sample period in seconds, off by default): every
    rank's stack is sampled that often (jittered), each sample classified as
    waiting inside a ``torch.distributed`` collective or not, and a rank that
    waits far less than its peers over a window (they wait for it) is named:
    :class:`aiolaunch.WorkerStraggling`, a warning, ``"straggling"`` in
    ``status()`` and the report. The statistic (``aiolaunch._hangs._straggler``)
    asks for a large gap, a one-sided Fisher exact test at 1e-6 on effective
    samples, consistency across the window and persistence, so a balanced
    run never names anyone; a rank waiting 4 % of the time among peers at
    40 % is named after ~30-60 samples. DDP's gradient all-reduce runs in C++
    inside ``backward()``: there only explicit collectives are measured.
    Where the ranks serve their collective records, the records are pulled
    instead, every ``stragglers`` seconds: each rank's lateness at each
    collective against the earliest rank (``aiolaunch._hangs._lateness``,
    ``WorkerStraggling(source="collectives", lateness_s=...)``) - inside
    DDP's backward too.

    Linux: activity is read from ``/proc`` (elsewhere no worker is ever
    flagged). The sampling period is ``stall_after / 10`` within [1, 30] s.

    :param stall_after: seconds without activity, from 1 (the sampling
        period's floor) to 30 days (:data:`MAX_STALL_AFTER`).
    :param progress: a regular expression: only lines matching it count as
        output (streams the supervisor reads; a non-redirected stream is then
        piped through the supervisor).
    :param action: ``"observe"``, ``"fail"`` or ``"restart"``.
    :param stragglers: seconds between two straggler samples (>= 0.1), or
        ``None`` (off). CLI ``--straggler-sample``.
    :raises ValueError: a bad ``stall_after``, ``progress``, ``action`` or
        ``stragglers``.
    """

    stall_after: float = 600.0
    progress: str | None = None
    action: str = "fail"
    stragglers: float | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.stall_after, bool)
            or not isinstance(self.stall_after, int | float)
            or not self.stall_after > 0
            or self.stall_after == float("inf")
        ):
            raise ValueError(
                f"Watchdog(stall_after={self.stall_after!r}) must be a number of seconds > 0, "
                "e.g. stall_after=600"
            )
        why = stall_after_problem(self.stall_after)
        if why is not None:
            raise ValueError(
                f"Watchdog(stall_after={self.stall_after!r}) {why}; pass e.g. stall_after=600, "
                "or watchdog=None"
            )
        if self.stragglers is not None and (
            isinstance(self.stragglers, bool)
            or not isinstance(self.stragglers, int | float)
            or not 0.1 <= self.stragglers < float("inf")
        ):
            raise ValueError(
                f"Watchdog(stragglers={self.stragglers!r}) must be a stack-sample period in "
                "seconds >= 0.1, or None (off)"
            )
        if self.action not in _ACTIONS:
            raise ValueError(
                f"Watchdog(action={self.action!r}) must be one of {', '.join(map(repr, _ACTIONS))}"
            )
        if self.progress is not None:
            if not isinstance(self.progress, str):
                raise ValueError(
                    f"Watchdog(progress={self.progress!r}) must be a regular expression (a str)"
                )
            try:
                every = matches_every_line(self.progress)
            except re.error as exc:
                raise ValueError(
                    f"Watchdog(progress={self.progress!r}) is not a valid regular expression: {exc}"
                ) from None
            if every:
                raise ValueError(
                    f"Watchdog(progress={self.progress!r}) matches every line (it matches an "
                    "empty one), so any output would count as progress; pass a pattern of "
                    "your progress lines, e.g. progress=r'^step \\d+', or None for any output"
                )

    @property
    def period(self) -> float:
        """Seconds between two /proc samples: ``stall_after / 10`` within [1, 30]."""
        return min(max(1.0, self.stall_after / 10), 30.0)
