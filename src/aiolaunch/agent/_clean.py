"""A restart that starts clean: nothing of the last attempt is left on this host.

``ctx.close()`` already stops every worker and its descendants (their
process groups, their trees in ``/proc``, and whatever carries the group's
token). Before a new round starts workers here, :func:`make_clean` checks
it independently, bounded, and says what it found:

- every process whose environment carries the attempt's marker
  (:data:`ATTEMPT_ENV`, set by the agent for each attempt and inherited by
  every descendant, a double-forked daemon too) and every worker pid of the
  attempt is gone - not even exiting (a process that exits still holds its
  files, a GPU context among them, until it is a zombie); what is left is
  SIGKILLed and waited for;
- the resources the user listed (``--restart-resources``: paths or globs
  such as ``/dev/nvidia*``, held through an open file or a mapping, and
  ``port:N``, which must bind again) are held by no process of the attempt.

The wait is bounded (the shutdown timeout); past it the restart goes on
and the report names what was still there.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._workers._proc import environ, fd_target, mapped_files, open_fds, proc_pids, read_stat
from .._workers._processes import open_exit_fd

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Sequence

__all__ = ["ATTEMPT_ENV", "CleanReport", "make_clean", "parse_resources"]

#: the worker environment variable that marks every process of one attempt
ATTEMPT_ENV = "AIOLAUNCH_ATTEMPT"
#: seconds between looks at resources that have no event (ports, open files)
_LOOK = 0.01


@dataclass
class CleanReport:
    """What making the host clean took and found."""

    waited_s: float = 0.0
    killed: list[int] = field(default_factory=list)
    #: resource -> pids of the attempt still holding it when the bound ran out
    held: dict[str, list[int]] = field(default_factory=dict)
    busy_ports: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.held and not self.busy_ports

    def describe(self) -> str:
        parts = [f"clean after {1e3 * self.waited_s:.1f} ms"]
        if self.killed:
            parts.append(f"killed {len(self.killed)} leftover process(es) {sorted(self.killed)}")
        for res, pids in sorted(self.held.items()):
            parts.append(f"{res} still held by pid(s) {pids}")
        if self.busy_ports:
            parts.append(f"port(s) {self.busy_ports} do not bind yet")
        return "; ".join(parts)


def parse_resources(spec: Iterable[str]) -> tuple[list[str], list[int]]:
    """``(path patterns, ports)`` of ``--restart-resources`` entries.

    :raises ValueError: a relative path or a bad port, naming the fix.
    """
    paths: list[str] = []
    ports: list[int] = []
    for item in spec:
        item = item.strip()
        if not item:
            continue
        if item.startswith("port:"):
            try:
                port = int(item[5:])
            except ValueError:
                port = -1
            if not 0 < port < 65536:
                raise ValueError(
                    f"--restart-resources: {item!r} is not a port; write port:N, e.g. port:29500"
                )
            ports.append(port)
        elif not os.path.isabs(item):
            raise ValueError(
                f"--restart-resources: {item!r} must be an absolute path or glob "
                "(e.g. /dev/nvidia*), or port:N"
            )
        else:
            paths.append(item)
    return paths, ports


def marked(token: str, since: int) -> set[int]:
    """Live processes whose environment carries ``ATTEMPT_ENV=token``."""
    needle = f"\0{ATTEMPT_ENV}={token}\0".encode()
    me = os.getpid()
    found = set()
    for pid in proc_pids(since):
        if pid == me:
            continue
        data = environ(pid)
        if data is not None and needle in b"\0" + data + b"\0":
            found.add(pid)
    return found


def _alive(pids: Iterable[int]) -> set[int]:
    out = set()
    for pid in pids:
        stat = read_stat(pid)
        if stat is not None and stat.alive:  # a zombie has let go of everything
            out.add(pid)
    return out


def _holds(pid: int, paths: Collection[str]) -> bool:
    if any(fd_target(fd, pid) in paths for fd in open_fds(pid) or ()):
        return True
    return not mapped_files(pid).isdisjoint(paths)


def _binds(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


async def _exited(pids: Collection[int], timeout: float) -> None:
    """Wait (up to ``timeout``) until ``pids`` exited: their exit fds, no polling."""
    loop = asyncio.get_running_loop()
    fds = [fd for fd in (open_exit_fd(p) for p in pids) if fd is not None]
    if not fds:
        return
    waits = []
    try:
        for fd in fds:
            done: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _settle, done)
            waits.append(done)
        await asyncio.wait(waits, timeout=timeout)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def make_clean(
    token: str, worker_pids: Iterable[int], resources: Sequence[str], bound: float
) -> CleanReport:
    """Make sure nothing of the attempt ``token`` is left (see the module docstring)."""
    started = time.monotonic()
    workers = set(worker_pids)
    since = min(workers, default=0)
    paths, ports = parse_resources(resources)
    report = CleanReport()
    deadline = started + bound
    while True:
        left = _alive(workers) | marked(token, since)
        for pid in left - set(report.killed):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            report.killed.append(pid)
        if left:
            await _exited(left, max(0.0, deadline - time.monotonic()))
            left = _alive(left)
        files = {p for pattern in paths for p in glob.glob(pattern)}
        held = {f: sorted(p for p in left if _holds(p, {f})) for f in files} if left else {}
        report.held = {f: p for f, p in held.items() if p}
        report.busy_ports = [p for p in ports if not _binds(p)]
        if (not left and report.clean) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(_LOOK)  # allowed: a port or a file has no event that says "free"
    report.waited_s = time.monotonic() - started
    return report
