"""The live status endpoint, server side: ``{log_dir}/control.sock``, the
per-user registry of running groups (the writer side) and the wire format.
The clients (``aiolaunch status|stacks``) are in ``_cli/_client.py``.

Protocol (:func:`encode` / :func:`decode`): one JSON object per line each
way. Requests ``{"cmd": "status"}`` and ``{"cmd": "stacks", "timeout": 5.0}``;
answers ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. One
request per connection is enough for the CLI, but a client may send several.

The socket is created with mode 0600 (bound inside a private 0700 folder,
then renamed into place: no window where another user could connect) and
removed when the group closes. Where ``{log_dir}/control.sock`` is longer than
AF_UNIX allows (108 bytes), the socket lives in a short private temporary
folder and ``control.sock`` is a symlink to it; clients follow the link.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

__all__ = [
    "MAX_LINE",
    "SOCKET_NAME",
    "ControlServer",
    "Takeover",
    "decode",
    "encode",
    "registry_dir",
]

SOCKET_NAME = "control.sock"
MAX_LINE = 1 << 20  # the longest request or answer line
_MAX_PATH = 107  # sun_path is 108 bytes with the trailing NUL


@dataclass(frozen=True)
class Takeover:
    """What a command yields last when it keeps the connection (``attach``): the
    server awaits ``run(reader, writer)``, which owns the connection until it
    returns, then closes it. ``run`` writes its own answers."""

    run: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def encode(message: dict[str, Any]) -> bytes:
    """One request or answer as it goes on the wire: a JSON line."""
    return json.dumps(message).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """The request or answer of one line; :class:`ValueError` if it is not a JSON object."""
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"expected a JSON object, got {type(message).__name__}")
    return message


class ControlServer:
    """Serves one group's control socket until :meth:`aclose`."""

    def __init__(
        self,
        link: str,
        real: str,
        tmpdir: str | None,
        server: asyncio.AbstractServer,
        idle: _Idle,
    ):
        self.path = link
        self._real = real
        self._tmpdir = tmpdir
        self._server = server
        self._idle = idle
        self._entry = _register(os.path.abspath(link))
        # Removed by the guardian if the supervisor dies before remove().
        from .._workers._guardian import clean_up_after

        left = [("F", link)] + ([("T", tmpdir)] if tmpdir else [])
        if self._entry is not None:
            left += [("F", self._entry), ("P", os.path.dirname(self._entry))]
        self._forget = [clean_up_after(kind, path) for kind, path in left]

    @classmethod
    async def start(
        cls, log_dir: str, handler: Callable[[object], AsyncIterator[dict[str, Any] | Takeover]]
    ) -> ControlServer:
        """Listen on ``{log_dir}/control.sock``; ``handler(request)`` gives the
        answers to one request (one, or several for a streaming command) and
        never raises for a bad one (``_commands.dispatch``)."""
        sock, link, real, tmpdir = _bind(log_dir)
        idle = _Idle()
        try:

            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                try:
                    while line := await idle.readline(reader, writer):
                        try:
                            req: object = decode(line)
                        except ValueError as exc:  # a bad request must not kill the server
                            req = {"cmd": None, "error": str(exc)}
                        async for answer in handler(req):
                            if isinstance(answer, Takeover):
                                await answer.run(reader, writer)
                                return
                            writer.write(encode(answer))
                            await writer.drain()
                except (ConnectionError, asyncio.IncompleteReadError, ValueError):
                    pass
                finally:
                    writer.close()

            # Not listening yet, and no await point: a cancellation cannot
            # land between the server taking the socket and us holding it.
            server = await asyncio.start_unix_server(
                serve, sock=sock, limit=MAX_LINE, start_serving=False
            )
        except BaseException:
            sock.close()
            _unbind(link, real, tmpdir)
            raise
        try:
            await server.start_serving()
        except BaseException:
            # The socket is registered with the loop now: only the server may
            # close it (it removes the reader first). Closed any other way, its
            # fd number - soon another file's - stays registered for the old
            # one, and a reader added for the new file never fires.
            server.close()
            _unbind(link, real, tmpdir)
            raise
        return cls(link, real, tmpdir, server, idle)

    async def aclose(self) -> None:
        """Stop listening; remove the socket (and its private folder). Idempotent."""
        self.close()
        self.remove()

    def close(self) -> None:
        """Stop listening (on the loop); end the connections that wait for a
        request (a ``top`` must see the group end). Answers under way finish:
        an ``events`` stream still sends the last events, up to
        ``group_stopped``, then its connection ends too. Idempotent."""
        self._server.close()
        self._idle.close()

    def remove(self) -> None:
        """Remove the socket, its private folder and its entry (plain file
        operations: safe in a worker thread once closed). Idempotent."""
        _unbind(self.path, self._real, self._tmpdir)
        self._tmpdir = None
        if self._entry is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._entry)
            # The per-user folder goes when this process exits (if no other
            # group is listed then), not with each group's last entry: that
            # was an rmdir and a mkdir per group, and some filesystems
            # discard a freed block synchronously (ext4 -o discard: ms).
            _remove_at_exit(os.path.dirname(self._entry))
            self._entry = None
        for forget in self._forget:
            forget()


_folders_at_exit: set[str] = set()


def _remove_at_exit(folder: str) -> None:
    if not _folders_at_exit:
        atexit.register(_remove_folders)
    _folders_at_exit.add(folder)


def _remove_folders() -> None:
    for folder in _folders_at_exit:
        with contextlib.suppress(OSError):  # fails harmlessly while others are listed
            os.rmdir(folder)


class _Idle:
    """The connections waiting for their next request, and whether to take more."""

    def __init__(self) -> None:
        self._writers: set[asyncio.StreamWriter] = set()
        self._closed = False

    async def readline(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        """The next request line; ``b""`` once the server is closed."""
        if self._closed:
            return b""
        self._writers.add(writer)
        try:
            return await reader.readline()
        finally:
            self._writers.discard(writer)

    def close(self) -> None:
        self._closed = True
        for writer in self._writers:
            writer.close()  # its readline() sees the end of the stream


def _fits(path: str) -> bool:
    return len(os.fsencode(os.path.abspath(path))) <= _MAX_PATH


def _bind(log_dir: str) -> tuple[socket.socket, str, str, str | None]:
    link = os.path.join(log_dir, SOCKET_NAME)
    # The socket is bound in a private folder first, then renamed into place:
    # ".XXXXXXXX/s" is shorter than "control.sock", so wherever the final
    # name fits, the temporary one does too (regression: a ".ctl-" prefix
    # made it 3 bytes longer, and log dirs whose control.sock was 105-107
    # bytes long got no socket at all).
    # Where it does not fit, the socket lives in a short private folder of the
    # temp dir and control.sock is a symlink to it.
    long_path = not _fits(link)
    private = tempfile.mkdtemp(prefix=".", dir=None if long_path else log_dir)
    tmp = os.path.join(private, "s")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(tmp)  # inside a 0700 folder: nobody else can reach it yet
        os.chmod(tmp, 0o600)
        if long_path:
            os.symlink(tmp, link)
            return sock, link, tmp, private
        os.replace(tmp, link)  # the bound socket keeps working under its new name
        os.rmdir(private)
    except BaseException:
        sock.close()
        shutil.rmtree(private, ignore_errors=True)
        raise
    return sock, link, link, None


def _unbind(link: str, real: str, tmpdir: str | None) -> None:
    for path in {link, real}:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


# -- the per-user list of running groups ----------------------------------------
# `aiolaunch status` with no LOG_DIR finds the job through it: torchrun users
# rarely pass --log-dir. Entries are symlinks {pid}-{n} -> the control socket,
# in a folder only this user can write; a supervisor killed by SIGKILL leaves a
# stale entry, which clients remove. A job registers in the first of
# registry_dirs(); clients read them all, because a job started from cron or
# nohup (no $XDG_RUNTIME_DIR, or another $TMPDIR) registers elsewhere than a
# login shell would.


def registry_dirs() -> list[str]:
    """The writer's registry folder, then the other place a job of this user may be.

    With ``$XDG_RUNTIME_DIR``: ``$XDG_RUNTIME_DIR/aiolaunch``, then
    ``{temp}/aiolaunch-<uid>`` (where a job started from cron or ``nohup``,
    without it, registers). Without: ``{temp}/aiolaunch-<uid>``, then
    ``/run/user/<uid>/aiolaunch`` (a login shell's ``$XDG_RUNTIME_DIR``).
    """
    uid = os.getuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    temp = os.path.join(tempfile.gettempdir(), f"aiolaunch-{uid}")
    if runtime:
        places = [os.path.join(runtime, "aiolaunch"), temp]
    else:
        places = [temp, f"/run/user/{uid}/aiolaunch"]
    return list(dict.fromkeys(os.path.abspath(p) for p in places))


def unsafe_registry(path: str) -> str | None:
    """``None`` if ``path`` is a private folder of this user (or absent), else why not."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid}), not to you (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}, not 700)"
    return None


def registry_dir(create: bool = False) -> str | None:
    """Where this process registers its groups (the first of :func:`registry_dirs`);
    ``None`` if it is unsafe - another user could have planted it in /tmp."""
    path = registry_dirs()[0]
    try:
        if create:
            os.makedirs(path, mode=0o700, exist_ok=True)
        os.lstat(path)
    except OSError:
        return None
    return None if unsafe_registry(path) else path


_registered = itertools.count()


def _register(sock: str) -> str | None:
    entry = f"{os.getpid()}-{next(_registered)}"
    for _ in range(3):  # another group may remove the empty folder in between
        folder = registry_dir(create=True)
        if folder is None:
            why = unsafe_registry(registry_dirs()[0])
            if why is not None:
                logging.getLogger("aiolaunch").warning(
                    "aiolaunch: %s: `aiolaunch status` without LOG_DIR will not find this "
                    "group; remove that folder (another user may have planted it)",
                    why,
                )
            return None
        try:
            os.symlink(sock, os.path.join(folder, entry))
        except FileNotFoundError:
            continue
        except OSError:
            return None
        return os.path.join(folder, entry)
    return None
