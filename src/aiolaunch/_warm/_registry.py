"""Which zygote serves a call: one per supervisor process and preload, while it is fresh.

One zygote per supervisor process and ``(preload, load-time environment)``
(:func:`zygote_for`), started on first use and kept for the supervisor's
lifetime - as the guardian and multiprocessing's forkserver are - so every
attempt of an agent and every ``start_processes`` call with the same preload
reuses it. It is replaced when it died (killed), or when it is stale: a file
its modules came from changed, or a variable they read at import is set
otherwise now (:meth:`~._image.Image.stale`) - a notebook user edits and
reruns. A replaced zygote is *retired*: kept, for the statuses of the
workers it forked, until the last of them exited; then closed.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from .._child._safety import load_time_items
from .._types import PerProcess
from .._workers import keep_for_life
from .._workers._proc import children
from ._preload import Preload, supported
from ._zygote import Zygote, ZygoteState

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["close_zygotes", "zygote_for", "zygote_helpers"]

log = logging.getLogger("aiolaunch.warm")

_ZYGOTES: PerProcess[dict[tuple[Preload, frozenset[tuple[str, str]]], Zygote]] = PerProcess(dict)


#: zygotes replaced while workers they forked still ran
_RETIRED: PerProcess[list[Zygote]] = PerProcess(list)


def zygote_for(
    preload: Preload, extra_env: Mapping[str, str] | None = None, *, spares: int = 0
) -> Zygote | None:
    """This process's zygote for ``preload`` and the environment ``os.environ | extra_env``.

    ``spares``: a new zygote forks that many children ahead, ready for the
    first group's workers (its size).

    Started now (without waiting for its imports) if there is none yet.
    One that died (killed) is replaced, but the workers of the call that
    finds it dead do not wait for the new one: they start the ordinary way,
    later ones fork from it once it is ready. A stale one is replaced too,
    and the call's workers wait for the new one: none runs the old code.
    ``None`` where zygotes are not supported (not Linux, no pidfds).
    """
    if not supported():
        return None
    env = {**os.environ, **(extra_env or {})}
    key = (preload, load_time_items(env))
    zygotes = _ZYGOTES.get()
    _sweep()
    z = zygotes.get(key)
    if z is None:
        z = zygotes[key] = Zygote(preload, env, spares=spares)
    elif z.state is ZygoteState.DEAD:
        _retire(z)  # its orphans still need it (their self-reported statuses)
        z = zygotes[key] = Zygote(preload, env, wait=False)
    elif z.state is ZygoteState.READY and (why := z.image.stale(env)) is not None:
        log.info("aiolaunch: preload %s: %s; a new zygote imports it", ",".join(preload.now), why)
        _retire(z)
        z = zygotes[key] = Zygote(preload, env, spares=spares)
    return z


def _retire(z: Zygote) -> None:
    """Close ``z`` once no worker it forked runs (now, or in a later :func:`_sweep`)."""
    if z.workers:
        _RETIRED.get().append(z)
    else:
        z.close()


def _sweep() -> None:
    """Close the retired zygotes whose workers all exited."""
    retired = _RETIRED.get()
    for z in [z for z in retired if not z.workers]:
        retired.remove(z)
        z.close()


def close_zygotes() -> None:
    """Stop every zygote of this process (the CLI, once its run is over)."""
    zygotes, retired = _ZYGOTES.peek(), _RETIRED.peek()
    for z in [*(zygotes or {}).values(), *(retired or [])]:
        z.close()
    if zygotes:
        zygotes.clear()
    if retired:
        retired.clear()


def zygote_helpers() -> tuple[set[int], set[int]]:
    """``(pids, fds)`` of this process's zygotes (retired ones too): long-lived by design."""
    pids: set[int] = set()
    fds: set[int] = set()
    for z in [*(_ZYGOTES.peek() or {}).values(), *(_RETIRED.peek() or [])]:
        if z.pidfd >= 0:
            pids.add(z.pid)
            # Its spares: the children that are no worker (the zygote may have
            # forked one the supervisor has not heard of yet).
            pids |= (set(children(z.pid)) or z.spares) - set(z.workers)
        fds |= z.fds()
    return pids, fds


keep_for_life(zygote_helpers)
