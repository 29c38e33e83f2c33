"""The zygote's messages, one dataclass each, and the one codec both ends use.

Requests, supervisor -> zygote (its control socket): :class:`Fork` (with
the worker's fds) and :class:`Later`. A :class:`Fork` also travels on from
the zygote to a spare child, on the spare's own socket, fds with it.

Replies, zygote -> supervisor, in the order the zygote sends them:

- :class:`Ready` (the NOW imports are done) or :class:`Failed` (one raised:
  the zygote exits), once, first;
- :class:`Loaded`, one per LATER module imported;
- :class:`Forked` or :class:`Refused`, one per :class:`Fork`, in the order
  of the requests;
- :class:`Spare` (a child forked ahead of the requests) and :class:`Exited`
  (a child's raw wait status: the zygote is the parent and reaps it), at
  any time.

A frame is a 4-byte big-endian length and the pickle of one message; fds
travel as SCM_RIGHTS with the frame's first byte. Both ends are the same
aiolaunch (the zygote imports this module from the supervisor's package),
so a pickle names the classes here on both sides. Blocking ends (the
zygote, a spare) use :func:`send` and :func:`receive`; the supervisor's
end, on its event loop, :func:`encode` and a :class:`Decoder`.

Standard library only, like everything in this folder.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._provenance import Provenance

__all__ = [
    "MAX_FDS",
    "Decoder",
    "Exited",
    "Failed",
    "Fork",
    "Forked",
    "FunctionJob",
    "Job",
    "Later",
    "Loaded",
    "Message",
    "Ready",
    "Refused",
    "Reply",
    "Request",
    "ScriptJob",
    "Spare",
    "StoreJob",
    "encode",
    "receive",
    "send",
]

_HEADER = struct.Struct("!I")
#: most fds one request carries (stdin, stdout, stderr, and the job's own)
MAX_FDS = 8


# -- what a forked child is to run --------------------------------------------------
@dataclass(frozen=True)
class ScriptJob:
    """A Python command line, run as ``python [-u] [-m bootstrap] ARGV`` runs it."""

    #: ``[script, *args]`` or ``["-m", module, *args]``
    argv: list[str]
    #: ``-u`` (or ``PYTHONUNBUFFERED``): stdout and stderr unbuffered
    unbuffered: bool
    #: run through aiolaunch's bootstrap (stack dumps and attach registered)
    bootstrap: bool
    #: the whole command line, as ``sys.orig_argv`` shows it
    orig_argv: list[str]


@dataclass(frozen=True)
class FunctionJob:
    """A function worker (what multiprocessing would start), pickled by cloudpickle."""

    rank: int
    fn: bytes
    args: bytes
    error_file: str
    #: the supervisor's ``sys.argv`` and ``sys.path``, as a spawned child gets them
    sys_argv: list[str]
    sys_path: list[str]
    #: the supervisor's command line (``sys.orig_argv``): what ``ps`` shows, as
    #: for a child of multiprocessing's ``fork``
    orig_argv: list[str]
    supervisor_pid: int
    #: ``multiprocessing.current_process().name``
    process_name: str


@dataclass(frozen=True)
class StoreJob:
    """A TCPStore host on the listening socket the request carries (fd ``listen``)."""

    host: str
    port: int
    timeout: float


Job: TypeAlias = ScriptJob | FunctionJob | StoreJob


# -- requests -------------------------------------------------------------------------
@dataclass(frozen=True)
class Fork:
    """Fork a child and make it run ``job``; the fds named ``fds`` travel with it."""

    job: Job
    #: names of the fds sent with the frame, in order (``stdin``, ``stdout``,
    #: ``stderr``, and ``result``, ``listen`` or ``stop`` of the job)
    fds: tuple[str, ...]
    #: the worker's whole environment (``os.environ`` and the C ``environ``)
    env: dict[str, str]
    cwd: str
    #: signals the supervisor ignores (``exec`` would keep them ignored)
    ignored: tuple[int, ...]


@dataclass(frozen=True)
class Later:
    """Import the LATER modules now (the supervisor's workers all started)."""


# -- replies --------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The NOW modules are imported; ``hazard``: why forking is unsafe already, if it is."""

    pid: int
    hazard: str | None
    #: ``torch.distributed`` was imported (the zygote can host a TCPStore)
    torch_distributed: bool
    #: the files the imports came from, the variables they read
    provenance: Provenance


@dataclass(frozen=True)
class Failed:
    """A NOW module raised at import (its traceback in ``error``); the zygote exits."""

    module: str
    error: str


@dataclass(frozen=True)
class Loaded:
    """A LATER module imported, or failed to (``error``: its traceback)."""

    module: str
    error: str | None
    #: what this import added to the zygote's :class:`Ready` provenance
    provenance: Provenance


@dataclass(frozen=True)
class Forked:
    """The answer to a :class:`Fork`: the child's pid."""

    pid: int


@dataclass(frozen=True)
class Refused:
    """The answer to a :class:`Fork` the zygote would not make: it is no longer safe."""

    reason: str


@dataclass(frozen=True)
class Spare:
    """A child forked ahead of the requests (waiting for one on its own socket)."""

    pid: int


@dataclass(frozen=True)
class Exited:
    """A child of the zygote exited: its raw wait status (``os.waitpid``'s)."""

    pid: int
    status: int


Request: TypeAlias = Fork | Later
Reply: TypeAlias = Ready | Failed | Loaded | Forked | Refused | Spare | Exited
Message: TypeAlias = Request | Reply


# -- the codec ------------------------------------------------------------------------
def encode(msg: Message) -> memoryview:
    """One whole frame: the length, then the pickle."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return memoryview(_HEADER.pack(len(data)) + data)


class Decoder:
    """Frames from a byte stream that arrives in pieces (the supervisor's non-blocking end)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        """The messages completed by ``data``, in order; a partial frame waits for more."""
        self._buf += data
        out: list[Message] = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            end = _HEADER.size + size
            if len(self._buf) < end:
                break
            out.append(pickle.loads(self._buf[_HEADER.size : end]))
            del self._buf[:end]
        return out


def send(sock: socket.socket, msg: Message, fds: Iterable[int] = ()) -> None:
    """Send one frame on a blocking socket; ``fds`` travel with its first byte."""
    frame = encode(msg)
    fds = list(fds)
    sent = socket.send_fds(sock, [frame], fds) if fds else sock.send(frame)
    while sent < len(frame):
        sent += sock.send(frame[sent:])


def receive(sock: socket.socket) -> tuple[Message, list[int]] | None:
    """Receive one frame from a blocking socket: ``(message, fds)``, or ``None`` at EOF."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    if not head:
        return None
    while len(head) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(head))
        if not more:
            return None
        head += more
    (size,) = _HEADER.unpack(head)
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            return None
        got += n
    msg: Message = pickle.loads(buf)
    return msg, fds
