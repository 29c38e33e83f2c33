"""Duplicate filters: matching console lines of all ranks, copied into one file.

torch 2.9+'s ``duplicate_stdout_filters`` / ``duplicate_stderr_filters``: every
line of a *tee'd* stream that contains any of the filter strings (plain
substrings, not patterns) is also written, with the rank's console prefix, to
one file per stream shared by all ranks (``filtered_stdout.log`` /
``filtered_stderr.log``). Ranks that are not tee'd (or are hidden by
``local_ranks_filter``) do not feed it, as in torch. An empty list of filters
makes no file; a filter ``""`` matches every line.

Guarantees: lines of different ranks never mix within a line (each line is one
``write`` on the loop thread); every matching line a worker wrote is in the file
when ``wait()``/``close()`` returns; the file is closed then.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import TextIO

    from ._specs import LogsDest

__all__ = ["DuplicateFilter", "DuplicateFilters", "check_filters"]


class DuplicateFilter:
    """One ``filtered_std*.log`` file.

    :param path: the file (created, truncated, never through a symlink).
    :param needles: a line is copied when any of these substrings is in it.
    """

    def __init__(self, path: str, needles: Sequence[str]) -> None:
        if not path:
            raise ValueError(
                "duplicate filters need a file, but the logs specs gave no filtered "
                "log path (LogsDest.filtered_stdout / filtered_stderr)"
            )
        self.path = path
        self.needles = tuple(needles)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        # Line-buffered text, like torch's: only matching lines reach it, so
        # the few small writes stay on the loop thread without hurting it.
        # Opened by path (through our flags: no planted symlink is followed),
        # so that ``file.name`` is the path, as torch's.
        self.file: TextIO = open(  # noqa: SIM115
            path, "w", errors="replace", buffering=1, opener=lambda p, _: os.open(p, flags, 0o666)
        )

    def matches(self, line: str) -> bool:
        """Whether ``line`` contains any of the filter strings."""
        return any(needle in line for needle in self.needles)

    def close(self) -> None:
        """Flush and close the file (idempotent); later lines are dropped."""
        self.file.close()


class DuplicateFilters:
    """The duplicate filters of one group: a line listener of its tap.

    Wants the lines of tee'd streams whose kind has a filter, and copies the
    matching ones, with the rank's console prefix, into that kind's file.

    :param tees: ``{"stdout"|"stderr": ranks tee'd}``.
    :param prefix: the console prefix of a rank.
    """

    def __init__(
        self,
        dest: LogsDest,
        stdout_filters: Sequence[str] | None,
        stderr_filters: Sequence[str] | None,
        prefix: Callable[[int], str],
    ) -> None:
        self._prefix = prefix
        self._tees = {"stdout": set(dest.tee_stdouts), "stderr": set(dest.tee_stderrs)}
        self._filters: dict[str, DuplicateFilter] = {}
        try:
            if stdout_filters:
                self._filters["stdout"] = DuplicateFilter(dest.filtered_stdout, stdout_filters)
            if stderr_filters:
                self._filters["stderr"] = DuplicateFilter(dest.filtered_stderr, stderr_filters)
        except BaseException:
            self.close()
            raise

    def file(self, stream: str) -> TextIO | None:
        """The open file of ``stream``'s filter, or ``None`` (no filter)."""
        dup = self._filters.get(stream)
        return None if dup is None else dup.file

    def reads(self, rank: int, stream: str) -> bool:
        return False  # tee'd streams are read anyway

    def wants(self, rank: int, stream: str) -> bool:
        return stream in self._filters and rank in self._tees[stream]

    def line(self, rank: int, stream: str, text: str) -> None:
        dup = self._filters[stream]
        if not dup.file.closed and dup.matches(text):
            dup.file.write(f"{self._prefix(rank)}{text}\n")

    def close(self) -> None:
        """Flush and close every file (idempotent)."""
        for dup in self._filters.values():
            dup.close()


def check_filters(what: str, value: object) -> list[str] | None:
    """Validate a ``duplicate_*_filters`` argument: ``None`` or a list of str."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise TypeError(
            f"{what}={value!r} must be a list of str (substrings to match), e.g. ['loss', 'ERROR']"
        )
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        raise TypeError(f"{what} holds non-str item(s) {bad!r}; every filter must be a str")
    return list(value)
