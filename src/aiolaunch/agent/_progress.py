"""Did an attempt make progress? (``--max-no-progress-restarts``)

Progress is a worker line matching ``--progress-regex``:
:class:`ProgressProbe` is a readiness probe (``start_processes(ready=...)``,
public API) that reads every stream of every rank and reports its first
matching line - the supervisor stops feeding it after that, so progress costs
nothing once seen.

A completed collective is not counted: DDP's construction alone completes
five (four broadcasts and an all_gather), so an attempt that fails at its
first step would count as progress, and a crash loop there would never stop.

:class:`ProgressTracker` is one agent's: per attempt, whether progress was
seen, and the first sighting is written to the job's records (so a round
counts as having made progress when any host saw it).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .._ready import ReadinessProbe

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

__all__ = ["ProgressProbe", "ProgressTracker"]


class ProgressProbe(ReadinessProbe):
    """ "Ready" at a rank's first line matching ``pattern``; tells ``seen(rank)``."""

    def __init__(self, pattern: str, seen: Callable[[int], None]) -> None:
        self.pattern = pattern
        self._regex = re.compile(pattern)
        self._seen = seen

    def reads(self, stream: str) -> bool:
        return True

    async def wait_ready(self, rank: int, lines: AsyncIterator[str] | None = None) -> None:
        if lines is None:
            raise TypeError("ProgressProbe.wait_ready() needs the worker's lines")
        async for line in lines:
            if self._regex.search(line) is not None:
                self._seen(rank)
                return

    def __repr__(self) -> str:
        return f"ProgressProbe({self.pattern!r})"


class ProgressTracker:
    """Progress of the current attempt (see the module docstring).

    :param regex: ``--progress-regex``, or ``None``.
    :param report: called once per attempt, at its first progress (it
        writes the job's record; it must not block the loop).
    """

    def __init__(self, regex: str | None, report: Callable[[], None]) -> None:
        self.regex = regex
        self._report = report
        self.made_progress = False

    def attempt_started(self) -> None:
        """A new attempt: no progress yet."""
        self.made_progress = False

    def probe(self) -> ProgressProbe | None:
        """The readiness probe of every rank of an attempt, or ``None`` without a regex."""
        if self.regex is None:
            return None
        return ProgressProbe(self.regex, self.line_seen)

    def line_seen(self, rank: int) -> None:
        """``rank`` printed a progress line."""
        if not self.made_progress:
            self.made_progress = True
            self._report()
