"""Pulling the ranks' collective records: every rank at once, within one deadline.

Worker side: :mod:`aiolaunch._child._record_server` (torch's control socket
``{stacks dir}/fr-<pid>.sock``, described by ``fr-<pid>.json``). Here, for
each live rank at the same time: the description (its process start time
must be the pid's: a recycled pid is not asked), then one HTTP request per
dump on the socket - ``fr_trace_json`` (gloo and other CPU backends), and
``dump_nccl_trace_json`` where torch was built with NCCL - each on its own
connection (``Connection: close``: read to the end). torch's server answers
from a thread of its own, without the GIL.

Nothing is waited on beyond the deadline: a rank that does not answer in
time (stopped, in D state, a listening socket left behind by a forked child
of a dead rank: a connect succeeds and nothing answers) is ``"silent"``; a
rank without a record says why (``"off"``: an old torch; ``"none"``: it did
not import torch, or it is not a Python worker started by aiolaunch).

A rank that exited through Python's own exit left its record as it was then
(``fr-<pid>.last``: :func:`last_words`); it answers for it once it is gone, or
while it is going (its server is shut at exit).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._child._record_server import LAST_SUFFIX, OFF_SUFFIX, info_path
from .._workers._proc import fd_path
from ._stacks import start_time

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["PULL_TIMEOUT", "Pulled", "last_words", "pull_records", "read_info"]

#: The deadline of one pull of every rank: a healthy rank answers in milliseconds.
PULL_TIMEOUT = 2.0
#: The longest path a unix socket takes (``sun_path`` less its NUL).
_MAX_SOCKET_PATH = 107
#: The most a dump may be (torch's record at 2000 entries: ~1 MB).
_MAX_BODY = 64 << 20


@dataclass(frozen=True)
class Pulled:
    """One rank's answer.

    :param status: ``"ok"`` (``dumps`` holds its record), ``"off"`` (torch
        keeps none there: ``note`` says why), ``"none"`` (no record served:
        not a torch rank, or not yet), ``"silent"`` (no answer in time) or
        ``"failed"`` (an error answer or a broken connection: ``note``).
    :param info: its ``fr-<pid>.json`` (rank, world size, torch...), if any.
    :param dumps: the JSON dumps (gloo's, then NCCL's).
    :param seconds: how long the pull of this rank took.
    """

    rank: int
    pid: int
    status: str
    info: dict[str, Any] = field(default_factory=dict)
    dumps: tuple[bytes, ...] = ()
    note: str = ""
    seconds: float = 0.0


def last_words(directory: str, pid: int) -> tuple[tuple[bytes, ...], float] | None:
    """The dumps ``pid`` left as it exited, and when it wrote them (the wall
    clock: when it began to exit); ``None`` if it left none."""
    try:
        with open(info_path(directory, pid, LAST_SUFFIX), "rb") as f:
            raw = f.read(_MAX_BODY)
            when = os.fstat(f.fileno()).st_mtime
    except OSError:
        return None
    return tuple(d for d in raw.split(b"\0") if d), when


def read_info(directory: str, pid: int, *, alive: bool = True) -> tuple[str, dict[str, Any], str]:
    """``(status, info, note)`` from ``pid``'s description files (a live
    ``pid`` must be the process that wrote them: its start time)."""
    try:
        with open(info_path(directory, pid), encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        try:
            with open(info_path(directory, pid, OFF_SUFFIX), encoding="utf-8") as f:
                return "off", {}, f.read().strip()
        except OSError:
            return "none", {}, "no collective record (it has not imported torch)"
    except (OSError, ValueError) as exc:
        return "failed", {}, f"unreadable record description: {exc}"
    if not isinstance(info, dict):
        return "failed", {}, "unreadable record description"
    started = str(info.get("started") or "")
    if alive and started and started != start_time(pid):
        return "none", {}, "no collective record (its pid belongs to another process now)"
    return "ok", info, ""


async def _request(directory: str, name: str, handler: str) -> bytes:
    """The body of ``POST /handler/<handler>`` on ``directory/name``.

    On the loop's socket calls, not its streams: at 64 ranks a pull is 64
    connections at once, and a stream's transport and protocol cost more
    than the request.

    :raises OSError: no connection, or an answer other than 200.
    """
    loop = asyncio.get_running_loop()
    path = os.path.join(directory, name)
    dir_fd = -1
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
            dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
            path = os.path.join(fd_path(dir_fd), name)
        try:
            await loop.sock_connect(sock, path)
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
        await loop.sock_sendall(
            sock,
            f"POST /handler/{handler} HTTP/1.1\r\nHost: rank\r\n"
            "Content-Length: 0\r\nConnection: close\r\n\r\n".encode(),
        )
        chunks: list[bytes] = []
        size = 0
        while True:  # to the end: the server closes after its answer
            chunk = await loop.sock_recv(sock, 1 << 18)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > _MAX_BODY:
                raise OSError(f"{handler}: an answer over {_MAX_BODY} bytes")
    finally:
        sock.close()
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split(b" ")
    if len(status) < 2 or status[1] != b"200":
        line = head.split(b"\r\n", 1)[0].decode(errors="replace")
        raise OSError(f"{handler}: {line or 'no answer'} {body[:200].decode(errors='replace')}")
    return body


async def _pull(directory: str, rank: int, pid: int, known: dict[str, Any] | None) -> Pulled:
    t0 = time.monotonic()
    if known is None:
        status, info, note = read_info(directory, pid)
        if status != "ok":
            return Pulled(rank, pid, status, note=note)
    else:
        info = known
    name = str(info.get("socket") or "")
    nccl = None
    if info.get("nccl"):  # its own request: NCCL's answer never costs gloo's
        nccl = asyncio.ensure_future(_request(directory, name, "dump_nccl_trace_json"))
    try:
        dumps = [await _request(directory, name, "fr_trace_json")]
    except OSError as exc:
        if nccl is not None:
            nccl.cancel()
            await asyncio.gather(nccl, return_exceptions=True)
        return Pulled(rank, pid, "failed", info, note=str(exc) or type(exc).__name__)
    note = ""
    if nccl is not None:
        try:
            dumps.append(await nccl)
        except OSError as exc:  # a build with NCCL, a job without: gloo's stands
            note = f"no NCCL record: {exc}"
    return Pulled(rank, pid, "ok", info, tuple(dumps), note, time.monotonic() - t0)


async def pull_records(
    directory: str,
    pids: Mapping[int, int],
    timeout: float = PULL_TIMEOUT,
    known: Mapping[int, dict[str, Any]] | None = None,
) -> dict[int, Pulled]:
    """Every rank's record at once: ``{local rank: Pulled}`` for each of ``pids``
    (``{local rank: pid}``), within ``timeout`` seconds in all.

    :param known: ``{pid: description}`` read before (by an earlier pull of
        the same process): not read again.

    *Cancellation*: the requests in flight are cancelled with the caller.
    """
    known = known or {}
    tasks = {
        rank: asyncio.ensure_future(_pull(directory, rank, pid, known.get(pid)))
        for rank, pid in pids.items()
    }
    if tasks:
        await asyncio.wait(tasks.values(), timeout=timeout)
    out: dict[int, Pulled] = {}
    for rank, task in tasks.items():
        if task.done() and not task.cancelled():
            out[rank] = task.result()
        else:
            task.cancel()
            out[rank] = Pulled(rank, pids[rank], "silent", note=f"no answer within {timeout:g}s")
    pending = [t for t in tasks.values() if not t.done()]
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    return out
