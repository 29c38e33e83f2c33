"""The lifeline: a pipe whose write end only the supervisor process holds.

One per supervisor process (made on first use, anew in a forked child). Every
function worker inherits the read end; its EOF tells the worker that the
supervisor is gone, even after SIGKILL, and the worker then kills its whole
process group. Never closed here: the supervisor holds it for its lifetime.
"""

from __future__ import annotations

import os

from .._types import PerProcess

__all__ = ["current_lifeline_fds", "lifeline_fds"]

_LIFELINE: PerProcess[tuple[int, int]] = PerProcess(os.pipe)


def lifeline_fds() -> tuple[int, int]:
    """``(read end, write end)`` of this process's lifeline, made on first use."""
    return _LIFELINE.get()


def current_lifeline_fds() -> tuple[int, int] | None:
    """The lifeline's fds if this process made it; makes nothing."""
    return _LIFELINE.peek()
