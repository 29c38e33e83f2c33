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

from ._line import LineSink

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import TextIO

    from .._logs_specs import LogsDest

__all__ = ["DuplicateFilter", "check_filters", "open_duplicate_filters"]


class DuplicateFilter:
    """One ``filtered_std*.log`` file and the per-rank line sinks that feed it.

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
        fd = os.open(path, flags, 0o666)
        # Line-buffered text, like torch's: only matching lines reach it, so
        # the few small writes stay on the loop thread without hurting it.
        self.file: TextIO = open(fd, "w", errors="replace", buffering=1)  # noqa: SIM115

    def matches(self, line: str) -> bool:
        """Whether ``line`` contains any of the filter strings."""
        return any(needle in line for needle in self.needles)

    def sink(self, prefix: str) -> LineSink:
        """A sink for one rank's stream: matching lines, prefixed, into the file."""

        def on_line(line: str) -> None:
            if not self.file.closed and self.matches(line):
                self.file.write(f"{prefix}{line}\n")

        return LineSink(on_line, lambda: True)

    def close(self) -> None:
        """Flush and close the file (idempotent); later lines are dropped."""
        self.file.close()


def open_duplicate_filters(
    dest: LogsDest,
    stdout_filters: Sequence[str] | None,
    stderr_filters: Sequence[str] | None,
) -> dict[str, DuplicateFilter]:
    """Open the filtered log files a context needs: ``{"stdout"|"stderr": filter}``.

    A stream whose filter list is empty or ``None`` gets no file (torch's rule).
    """
    out: dict[str, DuplicateFilter] = {}
    try:
        if stdout_filters:
            out["stdout"] = DuplicateFilter(dest.filtered_stdout, stdout_filters)
        if stderr_filters:
            out["stderr"] = DuplicateFilter(dest.filtered_stderr, stderr_filters)
    except BaseException:
        for dup in out.values():
            dup.close()
        raise
    return out


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
