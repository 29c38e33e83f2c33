"""The control socket's clients: ``aiolaunch status|stacks|top [LOG_DIR]``.

One function per verb (``status_main``, ``stacks_main``), each listed in
:data:`VERBS`: a new verb is one function here and its entry there. They share
finding the socket (:func:`find_socket`), one request (:func:`request`) and
the error handling (:func:`_ask`). The server, the registry's writer side and
the wire format are in ``_control.py``, imported when a verb runs (so that
``aiolaunch --help`` and a launch do not pay for it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import stat
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "VERBS",
    "find_socket",
    "format_status",
    "request",
    "running_jobs",
    "stacks_main",
    "status_main",
    "top_main",
]


# -- finding the job ----------------------------------------------------------


def running_jobs() -> list[str]:
    """Control sockets of this user's running groups (stale entries are removed)."""
    return _scan_registries()[0]


def _scan_registries() -> tuple[list[str], list[str], list[str]]:
    """``(sockets, problems, places looked in)`` over every registry folder.

    A folder that is not a private one of this user is not read (another user
    could have planted it); it becomes a problem to report instead.
    """
    from .._control import registry_dirs, unsafe_registry

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
    from .._control import SOCKET_NAME

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


# -- one request --------------------------------------------------------------


def request(path: str, req: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send one request to the control socket at ``path``; return the answer (blocking)."""
    import socket

    from .._control import decode, encode

    if os.path.islink(path):
        path = os.readlink(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(encode(req))
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    return decode(buf)


def _parser(verb: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"aiolaunch {verb}", description=description)
    p.add_argument(
        "log_dir",
        nargs="?",
        default=None,
        help="the job's --log-dir (searched up to 3 levels down); default: your one running job",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    return p


def _seconds(text: str) -> float:
    """A ``type`` for a duration: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds > 0 (finite); e.g. --timeout 5"
        )
    return value


def _ask(
    verb: str, log_dir: str | None, req: dict[str, Any], wait: float = 60.0
) -> dict[str, Any] | None:
    """The job's answer to ``req`` within ``wait`` seconds; ``None`` once the error is printed."""
    try:
        path = find_socket(log_dir)
        try:
            answer = request(path, req, timeout=wait)
        except PermissionError:
            raise PermissionError(
                f"cannot connect to {path}: permission denied - the job belongs to "
                f"{_owner(path)} (its control socket is private to that user); run this as "
                "that user"
            ) from None
        except ConnectionRefusedError:
            raise ConnectionRefusedError(
                f"{path} does not answer: its job ended without removing it (killed?); "
                "no aiolaunch group is running there"
            ) from None
    except (OSError, ValueError) as exc:
        print(f"aiolaunch {verb}: {exc}", file=sys.stderr)
        return None
    if not answer.get("ok"):
        print(f"aiolaunch {verb}: {answer.get('error')}", file=sys.stderr)
        return None
    answer.pop("ok", None)
    return answer


def _print_json(answer: dict[str, Any]) -> int:
    print(json.dumps(answer, indent=2))
    return 0


# -- the verbs ----------------------------------------------------------------


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


def status_main(argv: Sequence[str]) -> int:
    """``aiolaunch status [LOG_DIR] [--json]``: per-rank state of a running job."""
    args = _parser("status", "Per-rank state of a running job.").parse_args(list(argv))
    answer = _ask("status", args.log_dir, {"cmd": "status"})
    if answer is None:
        return 1
    if args.json:
        return _print_json(answer)
    print(f"{answer['name']} ({answer['log_dir']})")
    print(format_status(answer["workers"]))
    return 0


def stacks_main(argv: Sequence[str]) -> int:
    """``aiolaunch stacks [LOG_DIR] [--json]``: dump every rank's stacks and the verdict."""
    p = _parser("stacks", "Dump every rank's Python stacks and name the outlier.")
    p.add_argument(
        "--timeout", type=_seconds, default=5.0, help="seconds to wait per dump (default: 5)"
    )
    args = p.parse_args(list(argv))
    req = {"cmd": "stacks", "timeout": args.timeout}
    answer = _ask("stacks", args.log_dir, req, wait=60.0 + args.timeout)
    if answer is None:
        return 1
    if args.json:
        return _print_json(answer)
    for rank, text in sorted(answer["stacks"].items(), key=lambda kv: int(kv[0])):
        print(f"===== rank {rank} =====\n{text.rstrip()}\n")
    print(f"----- verdict -----\n{answer['verdict']}")
    files = answer.get("files") or {}
    if files:
        folder = os.path.dirname(os.path.dirname(next(iter(files.values()))))
        print(f"(written to {folder}/<rank>/stacks-*.txt)")
    return 0


def top_main(argv: Sequence[str]) -> int:
    """``aiolaunch top [LOG_DIR]``: the ranks live, in the terminal (``_top.py``)."""
    from ._top import top_main

    return top_main(argv)


VERBS: dict[str, Callable[[Sequence[str]], int]] = {
    "status": status_main,
    "stacks": stacks_main,
    "top": top_main,
}
"""``aiolaunch VERB ...``: the client verbs, each its own ``main(argv) -> status``."""
