"""Processes and fds started once per interpreter and kept: never reported as leaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["allow_long_lived_helper", "long_lived"]


def _multiprocessing_helpers() -> tuple[set[int], set[int]]:
    from .._compat import multiprocessing_helpers

    return multiprocessing_helpers()


def _aiolaunch_helpers() -> tuple[set[int], set[int]]:
    from .._workers import long_lived_helpers

    return long_lived_helpers()


_HELPERS: list[Callable[[], tuple[set[int], set[int]]]] = [
    _multiprocessing_helpers,
    _aiolaunch_helpers,
]


def allow_long_lived_helper(helper: Callable[[], tuple[set[int], set[int]]]) -> None:
    """Never report ``helper()``'s ``(pids, fds)``: things started once per interpreter."""
    _HELPERS.append(helper)


def long_lived() -> tuple[set[int], set[int]]:
    """``(pids, fds)`` of every registered helper, now."""
    pids: set[int] = set()
    fds: set[int] = set()
    for helper in _HELPERS:
        more_pids, more_fds = helper()
        pids |= more_pids
        fds |= more_fds
    return pids, fds
