"""Starting a rank's incarnation: :class:`RankLauncher`, and the :class:`Spawner` of each kind.

One launcher per group. For each incarnation of a rank (its first start, and
each restart) it opens the rank's streams around the spawn (closed again if
the spawn fails), asks the group's :class:`Spawner` for the process, tells
the group's state, the event bus and the observers that it runs, and wires
its exit: the restart policies decide whether a next incarnation follows
(started again through this launcher), else the rank is gone.

The two kinds of group differ only in their spawner
(:mod:`aiolaunch._kinds`): a binary, or a Python function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ._events import worker_exited, worker_started

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from ._events import EventBus
    from ._group import GroupState
    from ._logs import LogWiring
    from ._observer import GroupObserver
    from ._restart import Restarts
    from ._workers._handle import WorkerHandle

__all__ = ["RankLauncher", "Spawner"]


class Spawner(Protocol):
    """How a group's workers come to be: one process for one rank."""

    async def spawn(
        self, rank: int, env: dict[str, str], stdout: int | None, stderr: int | None
    ) -> WorkerHandle:
        """Start ``rank``'s worker with ``env`` added to its environment and
        ``stdout``/``stderr`` as its fds 1/2 (``None``: inherited)."""


class RankLauncher:
    """Starts each incarnation of a group's ranks (see the module docstring).

    :param envs: the user's environment of each rank.
    :param observers: asked for their part of each worker's environment
        (after the user's), and told of each incarnation that runs.
    :param restarts: told of every exit; restarts through this launcher.
    :param group_env: the group's own part of each worker's environment, last
        (the context token and the stop-deadline file: ``GroupEnding.env``).
    """

    def __init__(
        self,
        state: GroupState,
        spawner: Spawner,
        *,
        logs: LogWiring,
        bus: EventBus,
        envs: Mapping[int, Mapping[str, str]],
        observers: Sequence[GroupObserver],
        restarts: Restarts,
        group_env: Callable[[], Mapping[str, str]],
    ) -> None:
        self._state = state
        self._spawner = spawner
        self._logs = logs
        self._bus = bus
        self._envs = envs
        self._observers = observers
        self._restarts = restarts
        self._group_env = group_env

    def env(self, rank: int) -> dict[str, str]:
        """What ``rank``'s next incarnation gets on top of the supervisor's
        environment. Later layers win: the user's, the observers', the group's."""
        env = dict(self._envs[rank])
        for observer in self._observers:
            env.update(observer.env(rank))
        env.update(self._group_env())
        return env

    async def start(self, rank: int) -> None:
        """Start ``rank``'s next incarnation; its streams are read from the
        block's end on, and closed if the spawn fails."""
        async with self._logs.open(rank) as streams:
            handle = await self._spawner.spawn(rank, self.env(rank), streams.stdout, streams.stderr)
            handle.error_file = self._logs.dest.error_files.get(rank, "")
            self._state.started(handle)
            self._bus.emit(worker_started(handle))
            for observer in self._observers:
                observer.worker_started(handle)
            handle.on_exit = self._on_exit
            if not handle.alive:  # it exited while we were still wiring it up
                self._on_exit(handle)

    async def drain(self, rank: int) -> None:
        """Finish the streams of ``rank``'s exited incarnation."""
        await self._logs.drain_rank(rank)

    def _on_exit(self, handle: WorkerHandle) -> None:
        self._bus.emit(worker_exited(handle))
        if not self._restarts.after_exit(handle, self):  # its last incarnation
            self._state.gone(handle.local_rank)
