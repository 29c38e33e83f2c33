"""Sections of the live view that belong to the job, not to one group of workers.

A group's ``status`` answer, its ``/metrics`` and its ``report.json`` are
about its own ranks. What an agent knows of the whole job - its hosts, the
round, spares, quarantined hosts - is a *section* the agent registers while
it runs (:func:`register_section`): ``status`` and the report carry each
section under its name, ``/metrics`` appends its samples, and ``top`` and
``aiolaunch status`` show its ``"summary"`` line. Providers must not block
(they run on the event loop, answering a request): they return what was
last read.

It is part of the core, not of a wing: the live view (``status``,
``/metrics``) and hang forensics (the report) both read it, the agent writes
it, and neither wing may reach into the other.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["register_section", "section_metrics", "sections"]

log = logging.getLogger("aiolaunch")


_sections: dict[str, tuple[Any, Any]] = {}  # name -> (snapshot, metrics)


def register_section(
    name: str,
    snapshot: Callable[[], dict[str, Any] | None],
    metrics: Callable[[dict[str, Any]], list[str]] | None = None,
) -> Callable[[], None]:
    """Show ``snapshot()`` as section ``name`` (and ``metrics(section)`` in
    ``/metrics``) until the returned call unregisters it."""
    entry = (snapshot, metrics)
    _sections[name] = entry

    def unregister() -> None:
        if _sections.get(name) is entry:
            del _sections[name]

    return unregister


def sections() -> dict[str, dict[str, Any]]:
    """Every registered section now (one that fails is left out, and logged)."""
    out: dict[str, dict[str, Any]] = {}
    for name, (snapshot, _) in list(_sections.items()):
        try:
            value = snapshot()
        except Exception:
            log.exception("live view section %r failed", name)
            continue
        if value is not None:
            out[name] = value
    return out


def section_metrics(snapshot: dict[str, Any]) -> list[str]:
    """The samples of the sections in a status ``snapshot``."""
    out: list[str] = []
    for name, (_, metrics) in list(_sections.items()):
        value = snapshot.get(name)
        if metrics is None or not isinstance(value, dict):
            continue
        try:
            out.extend(metrics(value))
        except Exception:
            log.exception("metrics of live view section %r failed", name)
    return out
