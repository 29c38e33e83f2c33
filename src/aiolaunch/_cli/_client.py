"""The control socket's clients: ``aiolaunch status|stacks|top|events|attach [LOG_DIR]``.

One function per verb (``status_main``, ``stacks_main``, and the entry points
of ``top``, ``events``, ``attach``, whose code has a module each), each listed
in :data:`VERBS`: a new verb is one function here and its entry there. They
share finding the socket (``_live.find_socket``), one request (:func:`request`)
and the error handling (:func:`_ask`). The server, the registry's writer side and
the wire format are in ``_control.py``, imported when a verb runs (so that
``aiolaunch --help`` and a launch do not pay for it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "VERBS",
    "attach_main",
    "events_main",
    "format_status",
    "request",
    "stacks_main",
    "status_main",
    "top_main",
]


# -- one request --------------------------------------------------------------


def request(path: str, req: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send one request to the control socket at ``path``; return the answer (blocking)."""
    import socket

    from .._live._control import decode, encode

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
    from ._live import find_socket, permission_message

    try:
        path = find_socket(log_dir)
        try:
            answer = request(path, req, timeout=wait)
        except PermissionError:
            raise PermissionError(permission_message(path)) from None
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
                str(w["rank"]),
                state,
                str(w["pid"]),
                str(w["restarts"]),
                "-" if age is None else f"{age:.1f}s ago",
                f"{w['cpu_percent']:.1f}",
                _fmt_bytes(int(w["rss"])),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    # What the collective records say of a rank (torch ranks, with a watchdog).
    for w in workers:
        late = w.get("lateness_s")
        if w.get("straggling") and late is not None:
            lines.append(f"rank {w['rank']}: {late:.3f}s late at collectives (median)")
        if w.get("collective"):
            lines.append(f"rank {w['rank']}: {w['collective']}")
    return "\n".join(lines)


def status_main(argv: Sequence[str]) -> int:
    """``aiolaunch status [LOG_DIR] [--json]``: per-rank state of a running job."""
    args = _parser("status", "Per-rank state of a running job.").parse_args(list(argv))
    answer = _ask("status", args.log_dir, {"cmd": "status"})
    if answer is None:
        return 1
    if args.json:
        return _print_json(answer)
    print(f"{answer['name']} ({answer['log_dir']})")
    for name, section in sorted(answer.items()):  # the job's sections (its hosts)
        if isinstance(section, dict) and isinstance(section.get("summary"), str):
            print(f"{name}: {section['summary']}")
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


def events_main(argv: Sequence[str]) -> int:
    """``aiolaunch events [LOG_DIR] [--json]``: lifecycle events, live (``_events.py``)."""
    from ._events import events_main

    return events_main(argv)


def attach_main(argv: Sequence[str]) -> int:
    """``aiolaunch attach RANK [LOG_DIR]``: pdb inside a running rank (``_attach.py``)."""
    from ._attach import attach_main

    return attach_main(argv)


VERBS: dict[str, Callable[[Sequence[str]], int]] = {
    "status": status_main,
    "stacks": stacks_main,
    "top": top_main,
    "events": events_main,
    "attach": attach_main,
}
"""``aiolaunch VERB ...``: the client verbs, each its own ``main(argv) -> status``."""
