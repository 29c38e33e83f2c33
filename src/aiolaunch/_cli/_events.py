"""``aiolaunch events [LOG_DIR] [--json]``: a running job's lifecycle events, live.

The ``events`` command of the control socket answers a header line, then one
line per event (``_event_json.py`` has the mapping), replaying the group's
history first, and closes after ``group_stopped``. With ``--json`` each event
is printed as the JSON object it came as (``ok`` dropped), one per line,
flushed at once (``| jq`` sees it live); without it, one readable line.

Under the elastic agent each attempt of the job is its own group with its own
socket: after a ``group_stopped`` the client waits for the next attempt's
socket while the supervisor process lives, so the output runs until the job
ends - or until its reader goes away: ``aiolaunch events | head -1`` ends as
soon as ``head`` does (the pipe's write end reports the reader gone while
the client waits), quietly and with status 0, not at the job's next event
with "Broken pipe".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from ._live import ControlConnection

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["events_main", "format_event"]

_BASE = ("v", "ok", "event", "group", "rank", "time", "monotonic")


def format_event(msg: dict[str, Any]) -> str:
    """One readable line: ``12:00:01.234 trainer rank 1 exited pid=4242 exitcode=3 ...``."""
    t = float(msg.get("time", 0.0))
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
    who = "group" if msg.get("rank") is None else f"rank {msg['rank']}"
    rest = " ".join(f"{k}={v}" for k, v in msg.items() if k not in _BASE)
    return f"{stamp} {msg.get('group', '')} {who} {msg.get('event')} {rest}".rstrip()


def _alive(pid: int) -> bool:
    """Whether the supervisor still runs (a zombie, not reaped yet, does not)."""
    from .._workers._proc import read_stat

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = read_stat(pid)
    return stat is None or stat.alive  # no /proc (macOS): trust kill()


class _ReaderGone(Exception):
    """Nobody reads our stdout any more (a pipe whose reader exited)."""


def _reader_gone(wait: float | None, also: int | None = None) -> bool:
    """Wait up to ``wait`` seconds (``None``: forever) for ``also`` to be
    readable or stdout's reader to go away; whether it went away.

    A pipe's write end polls ``POLLERR`` once no reader is left; a terminal
    or a file never does (and is never waited on here without ``also``).
    """
    import select

    try:
        out = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (tests)
        out = -1
    poller = select.poll()
    if out >= 0:
        poller.register(out, 0)  # errors and hang-ups only
    if also is not None:
        poller.register(also, select.POLLIN)
    if out < 0 and also is None:
        if wait:
            time.sleep(wait)  # allowed: the caller's pause, nothing to watch
        return False
    for fd, events in poller.poll(None if wait is None else int(wait * 1000)):
        if fd == out and events & (select.POLLERR | select.POLLHUP):
            return True
    return False


def _print(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        raise _ReaderGone from None


def _stream(
    conn: ControlConnection, as_json: bool, seen: set[str], printed: set[str]
) -> tuple[bool, int | None]:
    """Print one group's events; returns (its group_stopped came, the supervisor's pid).

    An agent's attempt replays the job's earlier attempts first (the header's
    ``"earlier"``): those already ``printed`` are skipped, those missed (an
    attempt that ended before this client found its socket) are printed.
    """
    conn.send({"cmd": "events"})
    head = conn.read_answer(timeout=30.0)
    if head is None:
        return False, None
    if not head.get("ok"):
        raise ValueError(str(head.get("error")))
    assert conn.path is not None
    seen.add(conn.path)
    assert conn.sock is not None
    for _ in range(int(head.get("earlier", 0))):
        msg = conn.read_answer(timeout=30.0)
        if msg is None:
            return False, head.get("supervisor_pid")
        msg.pop("ok", None)
        _print_once(msg, as_json, printed)
    while True:
        # A quiet job sends nothing for hours: watch our reader meanwhile.
        if not conn.has_answer and _reader_gone(None, conn.sock.fileno()):
            raise _ReaderGone
        msg = conn.read_answer(timeout=None)
        if msg is None:
            return False, head.get("supervisor_pid")
        msg.pop("ok", None)
        _print_once(msg, as_json, printed)
        if msg.get("event") == "group_stopped":
            return True, head.get("supervisor_pid")


def _print_once(msg: dict[str, Any], as_json: bool, printed: set[str]) -> None:
    # An event is the same one when all but its wall "time" match: the
    # supervisor derives that from "monotonic" anew at each sending.
    key = json.dumps({k: v for k, v in msg.items() if k != "time"}, sort_keys=True)
    if key not in printed:
        printed.add(key)
        _print(json.dumps(msg) if as_json else format_event(msg))


def _next_attempt(conn: ControlConnection, supervisor: int, seen: set[str]) -> bool:
    # The agent starts the next attempt's group within milliseconds of
    # stopping the last one; until the supervisor exits, look for it.
    while _alive(supervisor):
        try:
            conn.connect()
        except (OSError, ValueError):
            conn.close()
        else:
            if conn.path not in seen:
                return True
            conn.close()
        # waiting for another process to create a socket; our reader may go meanwhile
        if _reader_gone(0.1):
            raise _ReaderGone
    return False


def events_main(argv: Sequence[str]) -> int:
    """Run ``aiolaunch events``; 0 once the job ended, 1 if it could not be followed."""
    p = argparse.ArgumentParser(
        prog="aiolaunch events",
        description="Print a running job's lifecycle events (started, ready, exited, "
        "restarting, stalled, straggling, group_stopped) as they happen, until it ends.",
    )
    p.add_argument(
        "log_dir",
        nargs="?",
        default=None,
        help="the job's --log-dir (searched up to 3 levels down); default: your one running job",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(list(argv))
    conn = ControlConnection(args.log_dir)
    seen: set[str] = set()
    printed: set[str] = set()
    try:
        conn.connect()
        while True:
            stopped, supervisor = _stream(conn, args.json, seen, printed)
            conn.close()
            if not stopped:
                print(
                    "aiolaunch events: the job's control socket closed before its group "
                    "stopped (the supervisor died?)",
                    file=sys.stderr,
                )
                return 1
            if supervisor is None or not _next_attempt(conn, supervisor, seen):
                return 0
    except _ReaderGone:
        # As `yes | head -1`'s yes, minus the signal: nothing to say, and
        # nobody to say it to. Python would flush stdout again at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    except (OSError, ValueError) as exc:
        print(f"aiolaunch events: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        conn.close()
