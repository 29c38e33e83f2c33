"""Step rate: lines matching ``--progress-regex`` per second, over a sliding window.

Kept per rank by the supervisor (fed by the progress-line reader) and shown by
``aiolaunch top`` (``STEP/s``), ``status --json`` (``step_rate``) and the
metrics (``aiolaunch_worker_steps_per_second``; ``..._progress_lines_total``
is the raw counter, for Prometheus' own ``rate()``).

Memory is bounded whatever the line rate: counts are kept per whole second
(at most ``window + 1`` buckets), never per line.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["StepRate"]

# A span shorter than this counts as this long: a rate asked right at the
# start (an event microseconds after ``since``) stays finite - n / 1e-311 is
# inf, which JSON (``status --json``) cannot carry.
_MIN_SPAN_S = 1e-3


class StepRate:
    """Counts events; :meth:`rate` is the count over the last ``window`` seconds
    per second (over the time since ``since`` while that is shorter)."""

    def __init__(self, since: float, window: float = 60.0) -> None:
        if not window > 0:
            raise ValueError(f"window={window!r} must be > 0 seconds")
        self.since = since
        self.window = window
        #: events counted so far
        self.total = 0
        self._buckets: deque[list[int]] = deque()  # [second, count], oldest first

    def add(self, now: float, n: int = 1) -> None:
        """Count ``n`` events at ``now`` (monotonic seconds; never earlier than a previous call)."""
        self.total += n
        second = math.floor(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([second, n])
        self._trim(now)

    def _trim(self, now: float) -> None:
        oldest = math.floor(now - self.window)
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()

    def rate(self, now: float) -> float:
        """Events per second over ``(now - window, now]``; 0.0 before any time
        passed; over at least :data:`_MIN_SPAN_S` (always finite)."""
        self._trim(now)
        span = min(self.window, now - self.since)
        if span <= 0:
            return 0.0
        if span < self.window:  # nothing was counted before ``since``
            return sum(n for _, n in self._buckets) / max(span, _MIN_SPAN_S)
        # Buckets are whole seconds: the oldest one kept may reach up to one
        # second before the window; count only the part inside it.
        start = now - span
        count = 0.0
        for second, n in self._buckets:
            if second + 1 <= start:
                continue
            count += n if second >= start else n * (second + 1 - start)
        return count / max(span, _MIN_SPAN_S)
