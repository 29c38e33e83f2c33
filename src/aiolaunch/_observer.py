"""The interface of everything that watches a running group: :class:`GroupObserver`.

A group's observers - the hang forensics, the live view, the readiness
probes, the restart policies - each see the group through its state
(:class:`~aiolaunch._group.GroupState`) and act on it through its commands.
What they share with the group's lifetime is this one interface, as trio's
``Instrument`` is the run loop's: every hook is optional (the base class does
nothing), each is called at one documented moment, by one caller, and no
observer is reached by another through it.

The moments, in order:

1. :meth:`~GroupObserver.env` - while each worker is spawned: what its
   environment gets from this observer;
2. :meth:`~GroupObserver.worker_started` - each new incarnation of a rank,
   once it runs (also a restarted one);
3. :meth:`~GroupObserver.group_started` - once every rank was started
   (``start_processes`` is about to return);
4. :meth:`~GroupObserver.before_stop` - the group is decided because a rank
   failed on its own, and the others are still alive: the last look at
   them before anything is signalled;
5. :meth:`~GroupObserver.aclose` - the group's end began: stop watching
   (nothing is started or judged after it returns); idempotent;
6. :meth:`~GroupObserver.annotate` - the result is built: add to it what was
   seen;
7. :meth:`~GroupObserver.conclude` - the aftermath, after ``wait()`` handed
   the result over: write what outlives the group (a report), release
   everything held. Plain file I/O on state that no longer changes.

:class:`~aiolaunch._launch.RankLauncher` calls 1 and 2 for each
incarnation; :class:`~aiolaunch._ending.GroupEnding` calls 3 to 7, in the
order the observers were given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._results import RunProcsResult
    from ._workers._handle import WorkerHandle

__all__ = ["GroupObserver"]


class GroupObserver:
    """One observer of a running group; override the hooks it needs (see the module docstring)."""

    def env(self, rank: int) -> Mapping[str, str]:
        """What ``rank``'s environment gets from this observer (each incarnation's)."""
        return {}

    def worker_started(self, handle: WorkerHandle) -> None:
        """A new incarnation of ``handle.local_rank`` runs (its exit may be known already)."""

    def group_started(self) -> None:
        """Every rank was started."""

    async def before_stop(self) -> None:
        """A rank failed on its own; the others are alive and not yet signalled."""

    async def aclose(self) -> None:
        """The group's end began: stop watching and acting. Idempotent."""

    def annotate(self, result: RunProcsResult) -> None:
        """The outcome is known: add what this observer saw to ``result``."""

    def conclude(self, result: RunProcsResult) -> None:
        """The aftermath: write what outlives the group, release what is held. Idempotent."""
