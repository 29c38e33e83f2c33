"""One client connection to a group's control socket, kept open (``top``, ``events``, ``attach``).

``aiolaunch status`` sends one request and leaves; ``top`` asks for the status
once a second on one connection (a connect per poll would cost the
supervisor an accept and a task each time), ``events`` reads a stream of
answers, and ``attach`` turns the connection into a byte pipe to a rank's
debugger after the first answer. All three share this blocking client.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

__all__ = ["ControlConnection", "ProtocolError"]

_MAX_LINE = 1 << 24


class ProtocolError(OSError):
    """The other end sent something that is not a JSON line, or closed mid-answer."""


class ControlConnection:
    """A connection to ``{log_dir}/control.sock`` (found as ``aiolaunch status`` finds it).

    :param log_dir: the job's log dir, or ``None``: this user's one running job.
    """

    def __init__(self, log_dir: str | None) -> None:
        self.log_dir = log_dir
        self.path: str | None = None
        self.sock: socket.socket | None = None
        self._buf = b""

    def connect(self) -> None:
        """Find the socket and connect (again, if connected before).

        :raises FileNotFoundError: no running job (the message says which).
        :raises ValueError: no ``log_dir`` and several jobs are running.
        :raises PermissionError: the socket belongs to another user.
        """
        from ._client import find_socket

        self.close()
        path = find_socket(self.log_dir)
        target = os.readlink(path) if os.path.islink(path) else path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(target)
        except PermissionError as exc:
            sock.close()
            raise PermissionError(
                exc.errno,
                f"{path}: permission denied: only the user who started the job can use its "
                "control socket",
            ) from None
        except BaseException:
            sock.close()
            raise
        self.path, self.sock, self._buf = path, sock, b""

    @property
    def connected(self) -> bool:
        """Whether a connection is open (it may still turn out closed on the next request)."""
        return self.sock is not None

    def close(self) -> None:
        """Close the connection. Idempotent."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self) -> ControlConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, req: dict[str, Any]) -> None:
        """Send one request (a JSON line)."""
        if self.sock is None:
            self.connect()
        assert self.sock is not None
        self.sock.sendall(json.dumps(req).encode() + b"\n")

    def read_answer(self, timeout: float | None = 30.0) -> dict[str, Any] | None:
        """The next answer line, or ``None`` when the server closed the connection."""
        assert self.sock is not None
        self.sock.settimeout(timeout)
        while b"\n" not in self._buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                if self._buf:
                    raise ProtocolError("the control socket closed in the middle of an answer")
                return None
            self._buf += chunk
            if len(self._buf) > _MAX_LINE:
                raise ProtocolError("an answer longer than 16 MiB")
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            answer = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"not a JSON answer: {line[:80]!r}") from exc
        if not isinstance(answer, dict):
            raise ProtocolError(f"not a JSON object: {line[:80]!r}")
        return answer

    def request(self, req: dict[str, Any], timeout: float | None = 30.0) -> dict[str, Any]:
        """Send ``req``, return its answer.

        :raises ConnectionError: the job ended (the socket closed) before answering.
        """
        self.send(req)
        answer = self.read_answer(timeout)
        if answer is None:
            self.close()
            raise ConnectionResetError("the job's control socket closed (the job ended)")
        return answer

    def take_buffered(self) -> bytes:
        """Bytes received after the last answer (``attach``: the session's first bytes)."""
        data, self._buf = self._buf, b""
        return data
