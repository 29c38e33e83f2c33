"""How sure one run is of a ratio: a bootstrap interval for the ratio of two medians.

A row whose target is "at least torch's" compares two medians measured in the
same interleaved run. Where only the kernel runs while the clock runs (a
worker writing its own file, children exec'ing), both medians estimate the
same thing and their ratio lands on either side of 1.0 from run to run. The
interval says whether the run *can tell* the two apart: a target whose bound
lies inside the interval was neither met nor missed by this run ("within
noise"), while a bound above the whole interval was missed.

The interval is a percentile bootstrap: each variant's trials are resampled
with replacement (independently: a trial of one variant is not paired with
one of the other), the ratio of the resamples' medians is taken, and the
central ``confidence`` share of those ratios is returned. The generator is
seeded, so a run's ``results.json`` renders the same table every time.

Stdlib only (run.py imports it; tests import it without a benchmark run).
"""

from __future__ import annotations

import math
import random
from statistics import median
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["goodness", "ratio_interval"]


def goodness(op: str, metric: str) -> tuple[bool, bool]:
    """How a target compares aiolaunch's value ``a`` with another variant's ``b``.

    Returns ``(ours_over_theirs, inverse_bound)``: the ratio that is > 1 when
    aiolaunch is better is ``a / b`` when ``ours_over_theirs`` (a rate that
    must be >= k x theirs) and ``b / a`` otherwise (a time that must be "k x
    faster", or anything that must be <= k x theirs); ``inverse_bound``: that
    ratio's bound is ``1 / k`` rather than ``k`` (the ``<=`` targets:
    ``a <= k b`` is ``b / a >= 1 / k``).
    """
    if op == "<=":
        return False, True
    return (not metric.endswith("_ms")), False


def ratio_interval(
    ours: Sequence[float],
    theirs: Sequence[float],
    *,
    ours_over_theirs: bool,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """The bootstrap interval of ``median(ours) / median(theirs)`` (or its
    inverse when not ``ours_over_theirs``), as ``(low, high)``.

    ``None`` when either side has fewer than 3 samples (no interval worth
    printing) or a median that is not > 0.
    """
    if len(ours) < 3 or len(theirs) < 3:
        return None
    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be between 0 and 1, got {confidence!r}")
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        a = median(rng.choices(ours, k=len(ours)))
        b = median(rng.choices(theirs, k=len(theirs)))
        if a <= 0 or b <= 0:
            return None
        ratios.append(a / b if ours_over_theirs else b / a)
    ratios.sort()
    tail = (1.0 - confidence) / 2
    lo = ratios[max(0, math.floor(tail * resamples))]
    hi = ratios[min(resamples - 1, math.ceil((1.0 - tail) * resamples) - 1)]
    return lo, hi
