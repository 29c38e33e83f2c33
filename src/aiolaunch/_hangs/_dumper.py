"""Numbered stack dumps of a group's live workers: ``{rank dir}/stacks-<n>.txt``.

One signal round at a time (a worker appends each dump to one file, which
the supervisor reads from an offset), every round bounded in time, and a
request for every rank joins a round for every rank that is already under
way instead of queueing behind it. So no request - a client asking with a
huge timeout, a rank that never answers - can hold the watchdog up for longer
than :data:`MAX_DUMP_TIMEOUT`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._stacks import dump_stacks

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from .._group import GroupState

__all__ = ["MAX_DUMP_TIMEOUT", "Dump", "StackDumper", "check_dump_timeout"]

logger = logging.getLogger("aiolaunch")

#: The longest a dump waits for a rank to answer, whatever was asked: a
#: healthy rank answers within milliseconds (the dump is written from its
#: signal handler); one silent this long is stopped or in D state.
MAX_DUMP_TIMEOUT = 30.0


def check_dump_timeout(what: str, timeout: object) -> float:
    """``timeout`` as a float if it is a finite number of seconds > 0.

    :raises ValueError: anything else (``True``, ``nan``, ``inf``, ``0``, ...),
        naming ``what`` and the fix.
    """
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(
            f"{what}={timeout!r} must be a finite number of seconds > 0 "
            f"(at most {MAX_DUMP_TIMEOUT:g} is used), e.g. 5"
        )
    return float(timeout)


@dataclass(frozen=True)
class Dump:
    """One round of stack dumps.

    :param number: the round's number ``n`` (``stacks-<n>.txt``).
    :param stacks: ``{rank: text}``: faulthandler's dump, or one line starting
        with ``<`` that says why there is none.
    :param files: ``{rank: path}`` of the files written.
    """

    number: int
    stacks: dict[int, str]
    files: dict[int, str]


class StackDumper:
    """The stack dumps of one group.

    :param state: the group (which ranks run, and their pids).
    :param stacks_dir: where the workers' dump handlers write.
    :param rank_dir: the folder of ``rank``'s files (its log folder).
    :param on_signalled: called with ``{rank: pid}`` of the ranks signalled,
        after a round (the sampler forgets the dump's own writes).
    """

    def __init__(
        self,
        state: GroupState,
        stacks_dir: str,
        rank_dir: Callable[[int], str],
        on_signalled: Callable[[Mapping[int, int]], None] | None = None,
    ) -> None:
        self._state = state
        self.stacks_dir = stacks_dir
        self._rank_dir = rank_dir
        self._on_signalled = on_signalled
        self._lock = asyncio.Lock()
        self._count = 0
        self._full: asyncio.Future[Dump] | None = None  # a round for every rank, queued or running

    @property
    def lock(self) -> asyncio.Lock:
        """Held for a round: periodic samples
        (:class:`~aiolaunch._hangs._stack_sampler.StackSampler`) of the same files take it too."""
        return self._lock

    @property
    def count(self) -> int:
        """How many rounds were dumped."""
        return self._count

    async def dump(self, ranks: Sequence[int] | None, timeout: float) -> Dump:
        """Dump ``ranks`` (every rank for ``None``), waiting at most ``timeout``
        seconds (capped at :data:`MAX_DUMP_TIMEOUT`) for each to answer.

        *Cancellation*: cancelling the caller leaves the round to finish (its
        files stay consistent); a round for every rank already queued or under
        way is joined, not repeated.
        """
        timeout = min(timeout, MAX_DUMP_TIMEOUT) if timeout > 0 else MAX_DUMP_TIMEOUT
        if ranks is None and self._full is not None and not self._full.done():
            return await asyncio.shield(self._full)
        task = asyncio.ensure_future(self._round(ranks, timeout))
        if ranks is None:
            self._full = task
        return await asyncio.shield(task)

    async def _round(self, ranks: Sequence[int] | None, timeout: float) -> Dump:
        async with self._lock:  # one signal round at a time: the files are read from offsets
            self._count += 1
            n = self._count
            wanted = range(self._state.nprocs) if ranks is None else sorted(ranks)
            pids: dict[int, int] = {}
            stacks: dict[int, str] = {}
            for rank in wanted:
                w = self._state.worker(rank)
                if w is None:
                    stacks[rank] = "<not started>"
                elif not w.alive:
                    stacks[rank] = f"<pid {w.pid} exited with {w.returncode}>"
                else:
                    pids[rank] = w.pid
            stacks.update(await dump_stacks(self.stacks_dir, pids, timeout))
            if self._on_signalled is not None:
                self._on_signalled(pids)
            stacks = dict(sorted(stacks.items()))
            return Dump(n, stacks, self._write(stacks, n))

    def _write(self, stacks: Mapping[int, str], n: int) -> dict[int, str]:
        # Small files into the page cache: not worth a thread hop.
        files: dict[int, str] = {}
        for rank, text in stacks.items():
            path = os.path.join(self._rank_dir(rank), f"stacks-{n}.txt")
            try:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                files[rank] = path
            except OSError as exc:
                logger.warning("aiolaunch: cannot write %s: %s", path, exc)
        return files
