"""Finding a running job's control socket, and one connection to it kept open.

:func:`find_socket` is how every client verb finds the job (``LOG_DIR``, or
this user's one running job from the registry).

``aiolaunch status`` sends one request and leaves; ``top`` asks for the status
once a second on one connection (a connect per poll would cost the
supervisor an accept and a task each time), ``events`` reads a stream of
answers, and ``attach`` turns the connection into a byte pipe to a rank's
debugger after the first answer. All three share this blocking client.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket

__all__ = [
    "ControlConnection",
    "ProtocolError",
    "find_socket",
    "permission_message",
    "running_jobs",
]

_MAX_LINE = 1 << 24


def running_jobs() -> list[str]:
    """Control sockets of this user's running groups (stale entries are removed)."""
    return _scan_registries()[0]


def _scan_registries() -> tuple[list[str], list[str], list[str]]:
    """``(sockets, problems, places looked in)`` over every registry folder.

    A folder that is not a private one of this user is not read (another user
    could have planted it); it becomes a problem to report instead.
    """
    from .._live._control import registry_dirs, unsafe_registry

    out: list[str] = []
    problems: list[str] = []
    looked: list[str] = []
    for folder in registry_dirs():
        looked.append(folder)
        why = unsafe_registry(folder)
        if why is not None:
            problems.append(why)
            continue
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"{folder} cannot be read ({exc.strerror})")
            continue
        found = [sock for name in names if (sock := _live_entry(folder, name)) is not None]
        if not found:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only if empty: stale entries were all removed
        out += [sock for sock in found if sock not in out]
    return out, problems, looked


def _live_entry(folder: str, name: str) -> str | None:
    """The socket an entry points to, or ``None`` (a stale entry is removed)."""
    entry = os.path.join(folder, name)
    try:
        pid = int(name.split("-", 1)[0])
        target = os.readlink(entry)
    except (ValueError, OSError):
        return None
    alive = True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        alive = False
    except PermissionError:
        pass
    if alive and os.path.exists(target):
        return target
    with contextlib.suppress(OSError):
        os.unlink(entry)
    return None


def permission_message(path: str) -> str:
    """What a client says when it may not connect to the job's socket ``path``."""
    return (
        f"cannot connect to {path}: permission denied - only the user who started the job "
        f"({_owner(path)}) can use its control socket; run this as that user"
    )


def _owner(path: str) -> str:
    """``"alice"`` (or ``"uid 1001"``): who owns ``path``."""
    import pwd

    try:
        uid = os.stat(path).st_uid
    except OSError:
        return "another user"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def find_socket(log_dir: str | None) -> str:
    """The newest ``control.sock`` in ``log_dir`` or up to 3 levels below it.

    (torch's layout puts it in ``{log_dir}/{run_id}_xxx/attempt_N/``.) Without
    ``log_dir``: the one group of this user that is running.

    :raises FileNotFoundError: there is none: the job is not running.
    :raises ValueError: no ``log_dir`` and several groups are running.
    """
    from .._live._control import SOCKET_NAME

    if log_dir is None:
        jobs, problems, looked = _scan_registries()
        if len(jobs) == 1:
            return jobs[0]
        if jobs:
            listing = "\n  ".join(os.path.dirname(j) for j in jobs)
            raise ValueError(
                f"{len(jobs)} aiolaunch jobs are running; pass one LOG_DIR:\n  {listing}"
            )
        if problems:
            raise FileNotFoundError(
                "no running aiolaunch job of yours was found, and a registry of running jobs "
                f"was not read: {'; '.join(problems)}. Remove it (another user may have "
                "planted it; a job started meanwhile is not listed) and pass the job's LOG_DIR"
            )
        raise FileNotFoundError(
            f"no running aiolaunch job of yours was found (looked in {' and '.join(looked)}; "
            "a job started with another $TMPDIR or $XDG_RUNTIME_DIR is listed elsewhere); "
            "pass its LOG_DIR (the --log-dir it was started with)"
        )
    found: list[tuple[float, str]] = []
    base = os.path.abspath(log_dir)
    try:
        is_dir = stat.S_ISDIR(os.stat(base).st_mode)
    except PermissionError:
        raise PermissionError(
            f"cannot look in {log_dir!r}: permission denied (a folder on its path is not "
            "open to you: is it another user's job?); run this as that user"
        ) from None
    except OSError:
        raise FileNotFoundError(
            f"{log_dir!r} does not exist: pass the --log-dir the job was started with"
        ) from None
    if not is_dir:
        raise FileNotFoundError(
            f"{log_dir!r} is not a folder: pass the --log-dir the job was started with"
        )
    denied: list[str] = []
    depth0 = base.rstrip(os.sep).count(os.sep)

    def onerror(exc: OSError) -> None:
        if isinstance(exc, PermissionError) and exc.filename:
            denied.append(exc.filename)

    for root, dirs, files in os.walk(base, onerror=onerror):
        if root.count(os.sep) - depth0 >= 3:
            dirs[:] = []
        if SOCKET_NAME in files or SOCKET_NAME in dirs:
            path = os.path.join(root, SOCKET_NAME)
            with contextlib.suppress(OSError):
                found.append((os.lstat(path).st_mtime, path))
    if not found and denied:
        raise PermissionError(
            f"cannot look for the job's {SOCKET_NAME} in {denied[0]!r}: permission denied "
            f"(it belongs to {_owner(denied[0])}); ask them, or run this as that user"
        )
    if not found:
        raise FileNotFoundError(
            f"no {SOCKET_NAME} in {log_dir!r}: no aiolaunch group is running with that log dir"
        )
    return max(found)[1]


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
        import socket

        self.close()
        path = find_socket(self.log_dir)
        target = os.readlink(path) if os.path.islink(path) else path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(target)
        except PermissionError as exc:
            sock.close()
            raise PermissionError(exc.errno, permission_message(path)) from None
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

    @property
    def has_answer(self) -> bool:
        """Whether a whole answer line was received already (:meth:`read_answer`
        returns it without waiting)."""
        return b"\n" in self._buf

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
