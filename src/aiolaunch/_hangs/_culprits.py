"""One story per stall: which ranks fail, and when the story is not told yet.

Ranks that stalled together usually wait for one another. When some of them
are the odd ones out of the stack verdict, those are the failure; when none
is - they all wait in one place - the verdict's odd ones out are, whatever
they do (idle, spinning, or printing "waiting"): the failure, the root cause
and the report's root cause name the same rank, and the rest were stopped by
aiolaunch. Without odd ones out, every stalled rank fails.

Where the ranks' collective records gave a verdict with culprits
(:mod:`aiolaunch._hangs._collective`), the culprits are the failure instead
(:func:`collective_culprits`), stalled or not; where none of them lives here
(exited, or on another host), the stalled ranks are.

Ranks reach a hang at different times: a verdict without an odd one out while
some live rank neither stalled nor spins may be early (that rank may be on
its way to where the others are); the watcher then waits for the next sample,
at most ``stall_after``. Pure functions of the stalls, the verdict and the
stall rule's state (:class:`~aiolaunch._hangs._stall.StallDetector`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ._stacks import rank_ranges
from ._stall import Stall

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from ._stacks import StackReport
    from ._stall import StallDetector

__all__ = ["collective_culprits", "odd_ones", "ranks_text", "too_early"]


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 2`` or ``ranks 0-1,3``."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


def too_early(
    stalls: list[Stall],
    verdict: StackReport,
    live: Iterable[int],
    detector: StallDetector,
    *,
    age: float,
    stall_after: float,
) -> bool:
    """Whether to wait for the story: no odd one out yet, some ``live`` rank
    (not paused) neither stalled nor spins, and the first stall of this
    episode is younger (``age``) than ``stall_after``."""
    if verdict.outliers or age >= stall_after:
        return False
    stalled = {s.rank for s in stalls}
    return any(
        r not in stalled and not detector.flagged(r) and not detector.spinning(r) for r in live
    )


def odd_ones(
    stalls: list[Stall],
    verdict: StackReport,
    pids: Mapping[int, int],
    files: Mapping[int, str],
    detector: StallDetector,
    *,
    period: float,
    now: float,
) -> list[Stall]:
    """The ranks that fail: the stalled odd ones out; else a new :class:`Stall`
    for each live odd one out (``pids``: live ranks) saying what it does; else
    every stalled rank. New stalls are the caller's to record."""
    chosen = [s for s in stalls if s.rank in verdict.outliers]
    if chosen:
        return chosen
    peers = ranks_text(s.rank for s in stalls)
    out: list[Stall] = []
    for rank in verdict.outliers:
        idle = detector.idle(rank, now)
        if rank not in pids or idle is None:
            continue
        if detector.spinning(rank):
            doing = f"spinning at the same frames for {idle:.1f}s"
        elif idle >= period:
            doing = f"no output and no CPU for {idle:.1f}s"
        else:
            doing = "active, elsewhere"
        reason = f"the odd one out: {doing} while {peers} stalled"
        s = Stall(rank, pids[rank], round(idle, 3), reason, verdict.line_for(rank) or "")
        out.append(dataclasses.replace(s, stacks_file=files.get(rank, "")))
    return out or stalls


def collective_culprits(
    stalls: list[Stall],
    culprits: Iterable[int],
    why: str,
    local: Mapping[int, int],
    pids: Mapping[int, int],
    verdict: StackReport,
    files: Mapping[int, str],
    detector: StallDetector,
    *,
    now: float,
) -> list[Stall]:
    """The ranks that fail by the collectives' verdict: its ``culprits``
    (global ranks) that live here (``local``: global -> local rank; ``pids``:
    live local ranks) - a stalled one with its stall, another with a new
    :class:`Stall` whose reason is ``why`` - or, where none does, every
    stalled rank."""
    by_rank = {s.rank: s for s in stalls}
    out: list[Stall] = []
    for g in culprits:
        rank = local.get(g)
        if rank is None or rank not in pids:
            continue
        s = by_rank.get(rank)
        if s is None:
            idle = detector.idle(rank, now) or 0.0
            s = Stall(rank, pids[rank], round(idle, 3), why, verdict.line_for(rank) or "")
            s = dataclasses.replace(s, stacks_file=files.get(rank, ""))
        out.append(s)
    return out or stalls
