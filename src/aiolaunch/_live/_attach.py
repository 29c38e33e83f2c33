"""The supervisor's side of ``aiolaunch attach``: open a session with a rank, relay it.

Why this way (Python 3.10-3.13 have no ``sys.remote_exec``): a pdb prompt
needs code running *in* the rank, and the only way in without ptrace is a
handler the rank installed itself - ``_child/_attach.py``, registered by
the bootstraps next to the stack-dump handler. The transport is private to
the job's user at every step:

- the CLI reaches the supervisor through ``control.sock`` (0600), whose
  ``attach`` command calls :func:`open_session` and then :func:`relay`;
- the supervisor listens on a fresh unix socket in a 0700 folder (the dumps'
  folder, or a private temporary one when that path is too long for
  AF_UNIX), writes its path to ``{stacks_dir}/attach-{pid}``, and signals
  the rank (only a worker whose marker, start time and ``SigCgt`` show our
  handler: an unhandled real-time signal would kill it);
- the rank connects; the supervisor takes only a peer whose
  ``SO_PEERCRED`` pid is that worker's, then removes the socket and the path
  file: nothing is left to connect to.

The relay is bytes both ways until either side closes; closing one side
closes the other, and a rank whose client went away reads end-of-file and
detaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import struct
import tempfile
import time
from typing import TYPE_CHECKING

from .._child._attach import ATTACH_SIGNAL

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ATTACH_SIGNAL", "AttachError", "Session", "open_session", "peer_uid", "relay"]

_MAX_PATH = 107


class AttachError(Exception):
    """The rank cannot be attached to now; the message says why (and what to do)."""


def check_attachable(stacks_dir: str, pid: int) -> None:
    """:raises AttachError: ``pid`` is not a live aiolaunch Python worker with the
    attach handler (:func:`~aiolaunch._hangs._stacks.registered` says why)."""
    from .._hangs._stacks import registered

    why = registered(stacks_dir, pid, ATTACH_SIGNAL, "the attach signal (SIGRTMIN+6)")
    if why is not None:
        raise AttachError(f"pid {pid}: {why}")


class Session:
    """An open session: the rank's end of it, as asyncio streams."""

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.pid = pid
        self.reader = reader
        self.writer = writer


def _peer(sock: socket.socket | None) -> tuple[int, int] | None:
    """``(pid, uid)`` of the process at the other end of a unix socket (Linux)."""
    if sock is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    pid, uid, _ = struct.unpack("3i", raw)
    return pid, uid


def peer_uid(writer: asyncio.StreamWriter) -> int | None:
    """The uid of the client of a control connection (``None``: unknown here)."""
    peer = _peer(writer.get_extra_info("socket"))
    return None if peer is None else peer[1]


def _listen(stacks_dir: str, pid: int) -> tuple[socket.socket, Callable[[], None]]:
    """A listening socket for ``pid``'s handler, its path in the path file; and its cleanup."""
    path_file = os.path.join(stacks_dir, f"attach-{pid}")
    own = os.path.join(stacks_dir, f"attach-{pid}.sock")
    private = None
    if len(os.fsencode(own)) > _MAX_PATH:
        private = tempfile.mkdtemp(prefix="aiolaunch-attach-")
        own = os.path.join(private, "s")

    def cleanup() -> None:
        for path in (path_file, path_file + ".tmp", own):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(own)
        listener.bind(own)
        os.chmod(own, 0o600)
        listener.listen(4)
        listener.setblocking(False)
        # Small files into the page cache: not worth a thread hop.
        with open(path_file + ".tmp", "w") as f:
            f.write(own)
        os.replace(path_file + ".tmp", path_file)  # the handler never reads half a path
    except BaseException:
        listener.close()
        cleanup()
        raise
    return listener, cleanup


async def open_session(stacks_dir: str, pid: int, timeout: float) -> Session:
    """Signal ``pid`` and wait up to ``timeout`` seconds for its handler to connect.

    :raises AttachError: it is not attachable, or did not answer in time.
    """
    check_attachable(stacks_dir, pid)
    listener, cleanup = _listen(stacks_dir, pid)
    loop = asyncio.get_running_loop()
    try:
        try:
            os.kill(pid, ATTACH_SIGNAL)
        except ProcessLookupError:
            raise AttachError(f"pid {pid} has exited") from None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                conn, _ = await asyncio.wait_for(loop.sock_accept(listener), max(left, 0.001))
            except (asyncio.TimeoutError, TimeoutError):
                raise AttachError(
                    f"pid {pid} did not answer within {timeout:g}s: its main thread is not "
                    "running Python code now (a long C call, or stopped); try again later, "
                    "or use a longer --timeout"
                ) from None
            peer = _peer(conn)
            if peer is not None and peer[0] == pid:
                break
            conn.close()  # not our worker: ignore it
    finally:
        listener.close()
        cleanup()
    try:
        reader, writer = await asyncio.open_unix_connection(sock=conn)
    except BaseException:
        conn.close()
        raise
    return Session(pid, reader, writer)


async def relay(
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    rank: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    linger: float = 5.0,
) -> None:
    """Copy bytes both ways until the rank's side closes; then close both.

    The client closing its side (Ctrl-D, or gone) is passed on as end-of-file:
    the rank's pdb detaches, and its last words reach the client if it still
    reads, for at most ``linger`` seconds (a rank running after ``next`` reads
    the end-of-file only at its next stop).
    """

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()

    up = asyncio.ensure_future(pump(client[0], rank[1]))
    down = asyncio.ensure_future(pump(rank[0], client[1]))
    try:
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        if not down.done():
            with contextlib.suppress(ConnectionError, OSError):
                rank[1].write_eof()
            await asyncio.wait([down], timeout=linger)
    finally:
        for t in (up, down):
            t.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
        for _, w in (client, rank):
            w.close()
        for _, w in (client, rank):
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()
