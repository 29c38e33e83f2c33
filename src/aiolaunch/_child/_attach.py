"""The rank's side of ``aiolaunch attach``: a pdb session on request, over a unix socket.

:func:`register` runs in every Python worker next to the stack-dump handler
(the function-worker bootstrap and ``python -m aiolaunch._child._bootstrap``) and
installs a Python-level handler for :data:`ATTACH_SIGNAL`; it imports only
``os`` and ``signal`` (pdb and socket are imported when a session starts).

A session, step by step (the supervisor's side is ``aiolaunch/_live/_attach.py``):

1. the supervisor listens on a fresh unix socket in a 0700 folder and writes
   its path to ``{stacks_dir}/attach-{pid}`` (the dumps' 0700 folder: only
   the job's user can reach either), then sends :data:`ATTACH_SIGNAL`;
2. the handler runs in the main thread at the next bytecode boundary (a
   ``time.sleep`` or a blocking read is interrupted for it), reads the path,
   connects, and starts pdb on the *interrupted* frame at once - a prompt
   even while the rank blocks, ``where`` shows where it is;
3. ``continue`` with no breakpoint left, ``quit`` and end-of-file all detach:
   tracing off, :data:`DETACHED` sent, the socket closed, the rank carries on
   where it was (a sleep resumes). ``next``/``step``/breakpoints keep the
   session, as in pdb. A session that closes without :data:`DETACHED` ended
   with the rank.

Nothing that goes wrong in a session (the client vanishing, a closed socket)
reaches the rank's own code: the channel swallows socket errors and reads
end-of-file instead. The rank's stdin and stdout are never touched.
"""

from __future__ import annotations

import os
import signal
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from types import FrameType
    from typing import Any

__all__ = ["ATTACH_SIGNAL", "DETACHED", "WAITING", "register"]

#: the signal that asks a worker to connect for a session (SIGRTMIN+6 on Linux)
ATTACH_SIGNAL: int = getattr(signal, "SIGRTMIN", 34) + 6
#: sent after each prompt: pdb waits for a line now
WAITING = b"\0"
#: sent last when the session detaches (the rank goes on): a session that
#: closes without it ended with the rank (killed, exited, the job stopped)
DETACHED = b"\4"

_directory: list[str] = []


def register(directory: str | None = None) -> bool:
    """Handle :data:`ATTACH_SIGNAL` in this process; ``False`` if it can't.

    ``directory`` defaults to ``$AIOLAUNCH_STACKS_DIR``; without either
    nothing happens. Must run in the main thread. Never raises.
    """
    directory = directory or os.environ.get("AIOLAUNCH_STACKS_DIR")
    if not directory:
        return False
    try:
        signal.signal(ATTACH_SIGNAL, _on_signal)
    except (ValueError, OSError, AttributeError):
        return False  # not the main thread, or no such signal here
    _directory[:] = [directory]
    return True


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if not _directory or frame is None:
        return
    try:
        with open(os.path.join(_directory[0], f"attach-{os.getpid()}")) as f:
            path = f.read().strip()
    except OSError:
        return  # no session waits for us (a late signal, or not ours)
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5.0)
        sock.connect(path)
        sock.settimeout(None)
    except OSError:
        sock.close()
        return
    try:
        _session(sock, frame)
    except Exception:  # a session must never break the rank
        sock.close()


class _Channel:
    """pdb's stdin and stdout: a socket that reads EOF instead of raising."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        self._in = b""
        self._out: list[str] = []
        self._eof = False

    def readline(self) -> str:
        self.flush(waiting=True)
        while b"\n" not in self._in:
            chunk = b""
            if self.sock is not None and not self._eof:
                try:
                    chunk = self.sock.recv(4096)
                except OSError:
                    chunk = b""
            if not chunk:
                # End of file: pdb detaches on it (do_EOF), and says so, with
                # DETACHED, to a client that only closed its sending side.
                self._eof = True
                line, self._in = self._in, b""
                return line.decode("utf-8", "replace")
            self._in += chunk
        line, _, self._in = self._in.partition(b"\n")
        return (line + b"\n").decode("utf-8", "replace")

    def write(self, text: str) -> int:
        self._out.append(text)
        return len(text)

    def flush(self, waiting: bool = False) -> None:
        data = "".join(self._out).encode("utf-8", "replace") + (WAITING if waiting else b"")
        self._out.clear()
        if data and self.sock is not None:
            try:
                self.sock.sendall(data)
            except OSError:
                self.close()

    def isatty(self) -> bool:
        return False

    def close(self, detached: bool = False) -> None:
        if self.sock is not None:
            if detached:
                self._out.append(DETACHED.decode())
            self.flush()
            sock, self.sock = self.sock, None
            sock.close()


def _session(sock: socket.socket, frame: FrameType) -> None:
    import pdb

    chan = _Channel(sock)

    class _Remote(pdb.Pdb):
        detached = False

        def set_continue(self) -> None:
            super().set_continue()
            if not self.breaks:  # pdb stops tracing: nothing more to show
                self.detached = True
                chan.close(detached=True)

        def do_quit(self, arg: str) -> bool:
            """q(uit) | exit: detach; the rank goes on (it is not stopped)."""
            self.clear_all_breaks()
            self.set_continue()
            return True

        do_q = do_exit = do_EOF = do_quit

        def _unavailable(self, arg: str) -> None:
            self.error("not available in an attached session (the rank's stdin is not here)")

        do_interact = do_run = do_restart = _unavailable

    io: Any = chan  # duck-typed: readline, write, flush
    p = _Remote(stdin=io, stdout=io, nosigint=True, readrc=False)
    # set_trace() does the frame set-up of this Python version (f_trace on every
    # frame, botframe ...) and turns tracing on; the first prompt is shown right
    # here instead, with tracing off - pdb's own code must not be traced.
    p.set_trace(frame)
    sys.settrace(None)
    p.interaction(frame, None)
    if not p.detached:  # next / step / continue to a breakpoint: trace from here
        sys.settrace(p.trace_dispatch)
