"""Readiness probes: when is a started worker ready to serve?

Give them to ``start_processes(..., ready=probe)`` (every rank) or
``ready={rank: probe}``, then ``await ctx.wait_ready(timeout=...)``.

- :class:`ReadyLine` - a line matching a regular expression appears on the
  worker's stdout or stderr (event-driven: checked as lines arrive).
- :class:`ReadyPort` - a TCP port accepts connections.
- :class:`ReadyFile` - a file exists.

Port and file probes have nothing to wait on, so they try every ``interval``
seconds (20 ms by default) - the one place aiolaunch polls, by necessity.
A port or path may be a callable of the local rank: ``ReadyPort(lambda r: 8000 + r)``.
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._validate import check_port

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ReadinessProbe", "ReadyFile", "ReadyLine", "ReadyPort"]


class ReadinessProbe:
    """Base class of the readiness probes."""

    async def wait_ready(self, rank: int) -> None:  # pragma: no cover - overridden
        """Return once ``rank`` is ready (cancelled when the worker exits)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ReadyLine(ReadinessProbe):
    """Ready when a line of the worker's output matches ``pattern`` (``re.search``).

    :param stream: ``"stdout"``, ``"stderr"`` or ``"any"``.
    """

    pattern: str
    stream: str = "any"

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise TypeError(
                f"ReadyLine(pattern={self.pattern!r}) must be a str regular expression, "
                f"e.g. ReadyLine(r'listening on port \\d+')"
            )
        if self.stream not in ("stdout", "stderr", "any"):
            raise ValueError(
                f"ReadyLine(stream={self.stream!r}) must be 'stdout', 'stderr' or 'any'"
            )
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"ReadyLine(pattern={self.pattern!r}) is not a regex: {exc}") from exc

    def matcher(self) -> Callable[[str], bool]:
        regex = re.compile(self.pattern)
        return lambda line: regex.search(line) is not None

    async def wait_ready(self, rank: int) -> None:  # pragma: no cover - fed by the log pipeline
        await asyncio.Event().wait()


@dataclass(frozen=True)
class ReadyPort(ReadinessProbe):
    """Ready when ``host:port`` accepts a TCP connection."""

    port: int | Callable[[int], int]
    host: str = "127.0.0.1"
    interval: float = 0.02

    def __post_init__(self) -> None:
        if not callable(self.port):
            check_port("ReadyPort(port)", self.port)
        if not isinstance(self.host, str) or not self.host:
            raise TypeError(f"ReadyPort(host={self.host!r}) must be a non-empty str")
        _check_interval("ReadyPort", self.interval)

    async def wait_ready(self, rank: int) -> None:
        port = self.port(rank) if callable(self.port) else self.port
        while True:
            try:
                _, writer = await asyncio.open_connection(self.host, port)
            except OSError:
                await asyncio.sleep(self.interval)  # allowed: nothing to wait on but time
                continue
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass
            return


@dataclass(frozen=True)
class ReadyFile(ReadinessProbe):
    """Ready when ``path`` exists."""

    path: str | os.PathLike[str] | Callable[[int], str | os.PathLike[str]]
    interval: float = 0.02

    def __post_init__(self) -> None:
        if not (callable(self.path) or isinstance(self.path, str | os.PathLike)) or (
            isinstance(self.path, str) and not self.path
        ):
            raise TypeError(
                f"ReadyFile(path={self.path!r}) must be a file path (str or os.PathLike) or a "
                "callable of the local rank returning one, e.g. ReadyFile('/tmp/ready')"
            )
        _check_interval("ReadyFile", self.interval)

    async def wait_ready(self, rank: int) -> None:
        path = self.path(rank) if callable(self.path) else self.path
        while not os.path.exists(path):  # noqa: ASYNC240 - one stat() call, no I/O wait
            await asyncio.sleep(self.interval)  # allowed: nothing to wait on but time


def _check_interval(cls: str, interval: object) -> None:
    if (
        isinstance(interval, bool)
        or not isinstance(interval, int | float)
        or not 0 < interval < float("inf")
    ):
        raise ValueError(
            f"{cls}(interval={interval!r}) must be a number of seconds > 0 between tries, e.g. 0.02"
        )
