"""The two kinds of group: how a rank's worker is spawned.

:class:`SubprocessContext` runs a binary (:class:`BinarySpawner`),
:class:`MultiprocessContext` a Python function (:class:`FunctionSpawner`);
everything else about the group is :class:`PContext`'s.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ._child._bootstrap import BOOTSTRAP
from ._compat import environ_data
from ._context import PContext

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._warm._zygote import Zygote
    from ._workers._handle import WorkerHandle

__all__ = ["BinarySpawner", "FunctionSpawner", "MultiprocessContext", "SubprocessContext"]


class SubprocessContext(PContext):
    """Binary workers (``entrypoint`` is a str): subprocesses watched by a pidfd.

    Each leads its own process group and inherits the parent's environment
    plus ``envs[rank]`` and ``TORCHELASTIC_ERROR_FILE``. If the supervisor
    dies, even by SIGKILL, the guardian (``_workers/_guardian.py``) SIGKILLs
    the worker's whole process group and every process that carries the
    guardian's token in its environment (descendants that called
    ``setsid()`` included). No ``PR_SET_PDEATHSIG``: it would reach the
    worker alone, and setting it needs code between fork and exec.

    With a ``zygote`` (``preload``), a Python command line is forked from it
    instead of exec'd (``_warm/_forks.py``).
    """

    def __init__(self, *, zygote: Zygote | None = None, **kwargs: Any) -> None:
        super().__init__(
            spawner=BinarySpawner(kwargs["entrypoint"], kwargs["args"], zygote), **kwargs
        )


class BinarySpawner:
    """Spawns a binary worker: the command line ``entrypoint args[rank]...``
    (forked from ``zygote`` instead where it is a Python command line)."""

    def __init__(
        self, entrypoint: str, args: dict[int, tuple[Any, ...]], zygote: Zygote | None
    ) -> None:
        self._entrypoint = entrypoint
        self._args = args
        self._zygote = zygote

    async def spawn(
        self, rank: int, env: dict[str, str], stdout: int | None, stderr: int | None
    ) -> WorkerHandle:
        """The worker of ``rank``: the supervisor's environment plus ``env``."""
        from ._workers._binary import spawn_binary

        env = {**_environ_snapshot(), **env}
        argv = [self._entrypoint, *(str(a) for a in self._args[rank])]
        if self._zygote is not None:
            from ._warm._forks import spawn_script

            forked = await spawn_script(self._zygote, rank, argv, env, stdout, stderr)
            if forked is not None:
                forked.records_exceptions = True  # the zygote runs it through the bootstrap
                return forked
        handle = await spawn_binary(rank, argv, env, stdout, stderr)
        handle.records_exceptions = runs_bootstrap(argv)
        return handle


def runs_bootstrap(argv: list[str]) -> bool:
    """Whether ``argv`` runs Python through aiolaunch's bootstrap (the CLI's
    command line), which records the program's uncaught exception."""
    rest = argv[1:]
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    return rest[:2] == ["-m", BOOTSTRAP]


_environ_cache: tuple[dict[Any, Any], dict[str, str]] | None = None


def _environ_snapshot() -> dict[str, str]:
    """``dict(os.environ)`` now - reused while the environment is unchanged.

    Copying ``os.environ`` decodes every name and value in Python (~0.1 ms
    per worker): at 256 binaries that was a measurable part of the launch.
    The cached copy is reused only while the raw environment still equals
    the one it was taken from (one C-level dict comparison), so a variable
    the application sets between two spawns is seen by the next worker.
    The result is shared: callers must not modify it.
    """
    global _environ_cache
    raw = environ_data()
    if raw is None:  # pragma: no cover - other interpreters
        return dict(os.environ)
    if _environ_cache is not None and _environ_cache[0] == raw:
        return _environ_cache[1]
    snapshot = dict(os.environ)
    _environ_cache = (dict(raw), snapshot)
    return snapshot


class MultiprocessContext(PContext):
    """Function workers (``entrypoint`` is callable): multiprocessing children.

    The function and its args travel by value where plain pickle cannot name
    them (``__main__``, notebook cells, lambdas, closures). ``envs[rank]`` is
    applied before they are unpickled. The return value is sent back as soon
    as the function returns and lands in ``result.return_values[rank]``.
    """

    def __init__(
        self,
        *,
        fn_bytes: bytes,
        args_bytes: dict[int, bytes],
        zygote: Zygote | None = None,
        **kwargs: Any,
    ) -> None:
        spawner = FunctionSpawner(
            name=kwargs["name"],
            start_method=kwargs["start_method"],
            fn_bytes=fn_bytes,
            args_bytes=args_bytes,
            error_files=kwargs["logs"].dest.error_files,
            zygote=zygote,
        )
        super().__init__(spawner=spawner, **kwargs)


class FunctionSpawner:
    """Spawns a function worker: ``multiprocessing`` with ``start_method``
    (forked from ``zygote`` instead where there is one); the function and each
    rank's args arrive pickled."""

    def __init__(
        self,
        *,
        name: str,
        start_method: str,
        fn_bytes: bytes,
        args_bytes: dict[int, bytes],
        error_files: Mapping[int, str],
        zygote: Zygote | None,
    ) -> None:
        self._name = name
        self._start_method = start_method
        self._fn_bytes = fn_bytes
        self._args_bytes = args_bytes
        self._error_files = dict(error_files)
        self._zygote = zygote

    async def spawn(
        self, rank: int, env: dict[str, str], stdout: int | None, stderr: int | None
    ) -> WorkerHandle:
        """The worker of ``rank``; ``env`` is applied before the function is unpickled."""
        from ._workers._function import spawn_function

        if self._zygote is not None:
            from ._warm._forks import fork_function

            forked = await fork_function(
                self._zygote,
                local_rank=rank,
                name=self._name,
                fn=self._fn_bytes,
                args=self._args_bytes[rank],
                env=env,
                stdout=stdout,
                stderr=stderr,
                error_file=self._error_files.get(rank, ""),
            )
            if forked is not None:
                return forked
        return await spawn_function(
            local_rank=rank,
            name=self._name,
            start_method=self._start_method,
            fn=self._fn_bytes,
            args=self._args_bytes[rank],
            env=env,
            stdout=stdout,
            stderr=stderr,
            error_file=self._error_files.get(rank, ""),
        )
