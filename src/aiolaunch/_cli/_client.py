"""The control socket's clients: ``aiolaunch status|stacks [LOG_DIR]``.

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
]


# -- finding the job ----------------------------------------------------------


def running_jobs() -> list[str]:
    """Control sockets of this user's running groups (stale entries are removed)."""
    from .._control import registry_dir

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


def find_socket(log_dir: str | None) -> str:
    """The newest ``control.sock`` in ``log_dir`` or up to 3 levels below it.

    (torch's layout puts it in ``{log_dir}/{run_id}_xxx/attempt_N/``.) Without
    ``log_dir``: the one group of this user that is running.

    :raises FileNotFoundError: there is none: the job is not running.
    :raises ValueError: no ``log_dir`` and several groups are running.
    """
    from .._control import SOCKET_NAME

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
        answer = request(find_socket(log_dir), req, timeout=wait)
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


VERBS: dict[str, Callable[[Sequence[str]], int]] = {
    "status": status_main,
    "stacks": stacks_main,
}
"""``aiolaunch VERB ...``: the client verbs, each its own ``main(argv) -> status``."""
