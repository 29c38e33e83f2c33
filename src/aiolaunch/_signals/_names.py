"""Signal names: the one lookup every message, event and result uses.

Leaf module: imports nothing else from aiolaunch.
"""

from __future__ import annotations

import signal

__all__ = ["describe_signal", "exit_signal_name", "signal_name"]


def signal_name(signum: int) -> str | None:
    """``"SIGTERM"`` for 15; ``None`` for a number that names no signal here."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return None


def describe_signal(signum: int) -> str:
    """The signal's name for a message: ``"SIGTERM"``, or ``"signal 99"``."""
    return signal_name(signum) or f"signal {signum}"


def exit_signal_name(exitcode: int) -> str | None:
    """The name of the signal that ended a process with ``exitcode``
    (``-N`` for signal ``N``), or ``None`` (a normal exit, or an unknown signal)."""
    return signal_name(-exitcode) if exitcode < 0 else None
