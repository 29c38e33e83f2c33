"""Lifecycle events as JSON objects: what ``aiolaunch events --json`` prints.

One event, one flat JSON object, one line::

    {"v": 1, "event": "exited", "group": "trainer", "rank": 1, "time": 1718000000.123,
     "monotonic": 5321.9, "pid": 4242, "exitcode": 3, "signal": null, "stopped": false}

- ``v``: the control protocol's version (every message on the control socket
  carries it); ``event``: the kind (table below); ``group``: the group's name;
  ``rank``: the local rank, ``null`` for the group's own events;
  ``time``: Unix seconds (the event's monotonic stamp moved to the wall clock
  when it is written); ``monotonic``: the event's own ``time`` field,
  comparable with ``time.monotonic()`` in processes on the same machine.
- Then every other field of the event class, under its own name: a field
  added to an event class shows up without a change here.

====================  ======================  ==============================================
event                 class                   fields
====================  ======================  ==============================================
``started``           WorkerStarted           pid, attempt
``ready``             WorkerReady             pid
``exited``            WorkerExited            pid, exitcode, signal, stopped
``restarting``        WorkerRestarting        attempt, delay
``stalled``           WorkerStalled           idle_s, reason
``straggling``        WorkerStraggling        wait_share, peers_wait_share, lateness_s, source
``group_stopped``     GroupStopped            failed (the last message of a stream)
``dropped``           EventsDropped           count (this consumer fell behind)
``line``              LogLine                 stream, text
====================  ======================  ==============================================

A class not in the table is named after itself: ``WorkerFoo`` -> ``foo``,
``GroupBar`` -> ``group_bar``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._events import Event

__all__ = ["event_kind", "event_to_json"]

_KINDS = {"GroupStopped": "group_stopped", "EventsDropped": "dropped", "LogLine": "line"}
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def event_kind(cls: type) -> str:
    """The ``event`` name of an event class (see the module's table)."""
    name = cls.__name__
    kind = _KINDS.get(name)
    if kind is None:
        kind = _CAMEL.sub("_", name).lower()
        kind = kind.removeprefix("worker_")
    return kind


def _plain(value: Any) -> Any:
    # JSON has no NaN or infinity: null instead (json.dumps would write the
    # non-standard NaN token, which strict parsers reject).
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def event_to_json(event: Event, *, version: int, group: str) -> dict[str, Any]:
    """The JSON object of ``event`` (see the module's docstring)."""
    wall = time.time() - (time.monotonic() - event.time)
    out: dict[str, Any] = {
        "v": version,
        "event": event_kind(type(event)),
        "group": group,
        "rank": event.rank,
        "time": round(wall, 6),
        "monotonic": event.time,
    }
    for field in dataclasses.fields(event):
        if field.name not in ("rank", "time"):
            out[field.name] = _plain(getattr(event, field.name))
    return out
