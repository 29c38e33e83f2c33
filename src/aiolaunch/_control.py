"""The live status endpoint: ``{log_dir}/control.sock`` and ``aiolaunch status|stacks``.

Protocol: one JSON object per line each way. Requests ``{"cmd": "status"}``
and ``{"cmd": "stacks", "timeout": 5.0}``; answers ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``. One request per connection is enough for
the CLI, but a client may send several.

The socket is created with mode 0600 (bound inside a private 0700 folder,
then renamed into place: no window where another user could connect) and
removed when the group closes. Where ``{log_dir}/control.sock`` is longer than
AF_UNIX allows (108 bytes), the socket lives in a short private temporary
folder and ``control.sock`` is a symlink to it; clients follow the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

__all__ = ["ControlServer", "request", "stacks_main", "status_main"]

SOCKET_NAME = "control.sock"
_MAX_PATH = 107  # sun_path is 108 bytes with the trailing NUL
_MAX_LINE = 1 << 20


class ControlServer:
    """Serves one group's control socket until :meth:`aclose`."""

    def __init__(self, link: str, real: str, tmpdir: str | None, server: asyncio.AbstractServer):
        self.path = link
        self._real = real
        self._tmpdir = tmpdir
        self._server = server
        self._entry = _register(os.path.abspath(link))

    @classmethod
    async def start(
        cls, log_dir: str, handler: Callable[[object], AsyncIterator[dict[str, Any]]]
    ) -> ControlServer:
        """Listen on ``{log_dir}/control.sock``; ``handler(request)`` gives the
        answers to one request (one, or several for a streaming command) and
        never raises for a bad one (``_commands.dispatch``)."""
        sock, link, real, tmpdir = _bind(log_dir)
        try:

            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                try:
                    while line := await reader.readline():
                        try:
                            req = json.loads(line)
                        except ValueError as exc:  # a bad request must not kill the server
                            req = {"cmd": None, "error": str(exc)}
                        async for answer in handler(req):
                            writer.write(json.dumps(answer).encode() + b"\n")
                            await writer.drain()
                except (ConnectionError, asyncio.IncompleteReadError, ValueError):
                    pass
                finally:
                    writer.close()

            # Not listening yet, and no await point: a cancellation cannot
            # land between the server taking the socket and us holding it.
            server = await asyncio.start_unix_server(
                serve, sock=sock, limit=_MAX_LINE, start_serving=False
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
        return cls(link, real, tmpdir, server)

    async def aclose(self) -> None:
        """Stop listening; remove the socket (and its private folder). Idempotent."""
        self.close()
        self.remove()

    def close(self) -> None:
        """Stop listening (on the loop). Idempotent."""
        self._server.close()

    def remove(self) -> None:
        """Remove the socket, its private folder and its entry (plain file
        operations: safe in a worker thread once closed). Idempotent."""
        _unbind(self.path, self._real, self._tmpdir)
        self._tmpdir = None
        if self._entry is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._entry)
            # The per-user folder goes with its last entry: nothing is left in
            # /tmp once no group runs (fails harmlessly while others are listed).
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self._entry))
            self._entry = None


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
# stale entry, which clients remove.


def registry_dir(create: bool = False) -> str | None:
    """``$XDG_RUNTIME_DIR/aiolaunch`` or ``/tmp/aiolaunch-<uid>``; ``None`` if unsafe."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    path = (
        os.path.join(runtime, "aiolaunch")
        if runtime
        else os.path.join(tempfile.gettempdir(), f"aiolaunch-{os.getuid()}")
    )
    try:
        if create:
            os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return None
    # Another user could have planted it in /tmp: use only our own private folder.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


_registered = itertools.count()


def _register(sock: str) -> str | None:
    entry = f"{os.getpid()}-{next(_registered)}"
    for _ in range(3):  # another group may remove the empty folder in between
        folder = registry_dir(create=True)
        if folder is None:
            return None
        try:
            os.symlink(sock, os.path.join(folder, entry))
        except FileNotFoundError:
            continue
        except OSError:
            return None
        return os.path.join(folder, entry)
    return None


def running_jobs() -> list[str]:
    """Control sockets of this user's running groups (stale entries are removed)."""
    folder = registry_dir()
    if folder is None:
        return []
    out: list[str] = []
    for name in sorted(os.listdir(folder)):
        entry = os.path.join(folder, name)
        try:
            pid = int(name.split("-", 1)[0])
            target = os.readlink(entry)
        except (ValueError, OSError):
            continue
        alive = True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = False
        except PermissionError:
            pass
        if alive and os.path.exists(target):
            out.append(target)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry)
    if not out:
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only if empty: stale entries were all removed
    return out


# -- client -------------------------------------------------------------------


def find_socket(log_dir: str | None) -> str:
    """The newest ``control.sock`` in ``log_dir`` or up to 3 levels below it.

    (torch's layout puts it in ``{log_dir}/{run_id}_xxx/attempt_N/``.) Without
    ``log_dir``: the one group of this user that is running.

    :raises FileNotFoundError: there is none: the job is not running.
    :raises ValueError: no ``log_dir`` and several groups are running.
    """
    if log_dir is None:
        jobs = running_jobs()
        if len(jobs) == 1:
            return jobs[0]
        if not jobs:
            raise FileNotFoundError("no running aiolaunch job of yours was found; pass its LOG_DIR")
        listing = "\n  ".join(os.path.dirname(j) for j in jobs)
        raise ValueError(f"{len(jobs)} aiolaunch jobs are running; pass one LOG_DIR:\n  {listing}")
    found: list[tuple[float, str]] = []
    base = os.path.abspath(log_dir)
    depth0 = base.rstrip(os.sep).count(os.sep)
    for root, dirs, files in os.walk(base):
        if root.count(os.sep) - depth0 >= 3:
            dirs[:] = []
        if SOCKET_NAME in files or SOCKET_NAME in dirs:
            path = os.path.join(root, SOCKET_NAME)
            with contextlib.suppress(OSError):
                found.append((os.lstat(path).st_mtime, path))
    if not found:
        raise FileNotFoundError(
            f"no {SOCKET_NAME} in {log_dir!r}: no aiolaunch group is running with that log dir"
        )
    return max(found)[1]


def request(path: str, req: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send one request to the control socket at ``path``; return the answer (blocking)."""
    if os.path.islink(path):
        path = os.readlink(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    answer: dict[str, Any] = json.loads(buf)
    return answer


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def format_status(workers: Sequence[dict[str, Any]]) -> str:
    """The table ``aiolaunch status`` prints."""
    rows = [("RANK", "STATE", "PID", "RESTARTS", "LAST OUTPUT", "CPU %", "RSS")]
    for w in workers:
        age = w.get("last_output_s")
        state = w["state"] if w.get("exitcode") is None else f"exited ({w['exitcode']})"
        rows.append(
            (
                str(w["rank"]), state, str(w["pid"]), str(w["restarts"]),
                "-" if age is None else f"{age:.1f}s ago",
                f"{w['cpu_percent']:.1f}", _fmt_bytes(int(w["rss"])),
            )
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def _client(argv: Sequence[str], cmd: str) -> int:
    import argparse

    p = argparse.ArgumentParser(prog=f"aiolaunch {cmd}")
    p.add_argument(
        "log_dir",
        nargs="?",
        default=None,
        help="the job's --log-dir (searched up to 3 levels down); default: your one running job",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    if cmd == "stacks":
        p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait per dump")
    args = p.parse_args(list(argv))
    try:
        path = find_socket(args.log_dir)
        req: dict[str, Any] = {"cmd": cmd}
        if cmd == "stacks":
            req["timeout"] = args.timeout
        answer = request(path, req, timeout=60.0)
    except (OSError, ValueError) as exc:
        print(f"aiolaunch {cmd}: {exc}", file=sys.stderr)  # noqa: T201
        return 1
    if not answer.get("ok"):
        print(f"aiolaunch {cmd}: {answer.get('error')}", file=sys.stderr)  # noqa: T201
        return 1
    if args.json:
        answer.pop("ok", None)
        print(json.dumps(answer, indent=2))  # noqa: T201
    elif cmd == "status":
        print(f"{answer['name']} ({answer['log_dir']})")  # noqa: T201
        print(format_status(answer["workers"]))  # noqa: T201
    else:
        for rank, text in sorted(answer["stacks"].items(), key=lambda kv: int(kv[0])):
            print(f"===== rank {rank} =====\n{text.rstrip()}\n")  # noqa: T201
        print(f"----- verdict -----\n{answer['verdict']}")  # noqa: T201
        files = answer.get("files") or {}
        if files:
            print(f"(written to {os.path.dirname(os.path.dirname(next(iter(files.values()))))}"  # noqa: T201
                  "/<rank>/stacks-*.txt)")  # fmt: skip
    return 0


def status_main(argv: Sequence[str]) -> int:
    """``aiolaunch status [LOG_DIR] [--json]``: per-rank state of a running job."""
    return _client(argv, "status")


def stacks_main(argv: Sequence[str]) -> int:
    """``aiolaunch stacks [LOG_DIR] [--json]``: dump every rank's stacks and the verdict."""
    return _client(argv, "stacks")
