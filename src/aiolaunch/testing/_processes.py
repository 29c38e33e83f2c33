"""The process table: what a test started, orphans included (via the session token)."""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._workers._proc import HAVE_PROC, cmdline, environ, proc_pids, read_stat

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["HAVE_PROC", "TOKEN_ENV", "Proc", "all_pids", "new_processes", "session_token"]

TOKEN_ENV = "AIOLAUNCH_LEAKCHECK_TOKENS"

_session_token: str | None = None


def session_token() -> str:
    """This session's token, added to ``$AIOLAUNCH_LEAKCHECK_TOKENS`` on first use.

    Appended to what a parent session set, so a pytest run inside a test
    (pytester) does not hide its orphans from the outer one.
    """
    global _session_token
    if _session_token is None:
        _session_token = uuid.uuid4().hex
        os.environ[TOKEN_ENV] = ":".join(filter(None, [os.environ.get(TOKEN_ENV), _session_token]))
    return _session_token


@dataclass(frozen=True)
class Proc:
    """One process as seen in the process table."""

    pid: int
    ppid: int
    state: str  # "R", "S", "Z" (zombie)...
    cmdline: str

    def describe(self) -> str:
        zombie = " (zombie: not reaped)" if self.state == "Z" else ""
        return f"pid {self.pid} ppid {self.ppid} state {self.state}{zombie}: {self.cmdline}"


def _read_cmdline(pid: int, comm: str) -> str:
    args = cmdline(pid)
    return " ".join(args) if args else f"[{comm}]"  # zombies have no cmdline


def all_pids() -> set[int]:
    """Every pid on the machine now."""
    if not HAVE_PROC:  # pragma: no cover - macOS
        return set(_process_table_ps())
    return set(proc_pids())


def _read_proc(pid: int) -> Proc | None:
    stat = read_stat(pid)
    if stat is None:  # exited meanwhile
        return None
    return Proc(pid, stat.ppid, stat.state, _read_cmdline(pid, stat.comm))


def _process_table_ps() -> dict[int, Proc]:  # pragma: no cover - macOS
    ps = subprocess.run(
        ["ps", "-A", "-o", "pid=,ppid=,stat=,command="], capture_output=True, text=True, check=True
    )
    table: dict[int, Proc] = {}
    for line in ps.stdout.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3:
            pid, ppid = int(parts[0]), int(parts[1])
            table[pid] = Proc(pid, ppid, parts[2][:1], parts[3] if len(parts) > 3 else "")
    table.pop(next((p for p, pr in table.items() if pr.cmdline.startswith("ps -A")), -1), None)
    return table


def _is_descendant(pid: int, root: int, lookup: Callable[[int], Proc | None]) -> bool:
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        proc = lookup(pid)
        if proc is None:
            return False
        if proc.ppid == root:
            return True
        pid = proc.ppid
    return False


def _is_tagged(pid: int, token: str) -> bool:
    if not HAVE_PROC:  # pragma: no cover - macOS
        return False
    env = environ(pid)
    if env is None:  # another user's, or exited
        return False
    needle = TOKEN_ENV.encode() + b"="
    for entry in env.split(b"\0"):
        if entry.startswith(needle):
            return token.encode() in entry[len(needle) :].split(b":")
    return False


def new_processes(before: set[int]) -> list[Proc]:
    """Processes of ours whose pid is not in ``before``.

    Ours: descendants of this process (zombies included) and processes that
    carry this session's token (orphans).
    """
    me = os.getpid()
    token = session_token()
    if HAVE_PROC:
        cache: dict[int, Proc | None] = {}

        def lookup(pid: int) -> Proc | None:
            if pid not in cache:
                cache[pid] = _read_proc(pid)
            return cache[pid]

        candidates = all_pids() - before - {me}
    else:  # pragma: no cover - macOS
        table = _process_table_ps()

        def lookup(pid: int) -> Proc | None:
            return table.get(pid)

        candidates = set(table) - before - {me}
    found = []
    for pid in sorted(candidates):
        proc = lookup(pid)
        if proc is not None and (_is_descendant(pid, me, lookup) or _is_tagged(pid, token)):
            found.append(proc)
    return found
