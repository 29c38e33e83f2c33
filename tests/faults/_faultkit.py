"""Helpers for the fault matrix: supervisors in subprocesses, under a subreaper.

The autouse leak check of ``tests/conftest.py`` sees the processes this test
process starts. A *supervisor subprocess* that dies (SIGKILL, a signal, an
error) leaves its orphans re-parented away from us, so for those tests we run
the supervisor under a tiny **subreaper** (``prctl(PR_SET_CHILD_SUBREAPER)``):
every orphan of the supervisor's tree is re-parented to the subreaper instead
of init. Once the supervisor exited, the subreaper reaps what dies within a
settle time and reports - then SIGKILLs - whatever is still alive: a precise
list of leaked processes with their command lines, and nothing escapes the
test.

Signals go only to processes the test started (the supervisor, whose pid it
prints first), never to the test runner.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# One liveness rule for the whole suite (zombie = dead), re-exported here.
from _helpers import alive, on_teardown, popen, proc_state, wait_dead

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "Report",
    "Supervised",
    "alive",
    "descendants",
    "proc_state",
    "start_supervised",
    "wait_dead",
]

SUBREAPER = r"""
import ctypes, json, os, signal, subprocess, sys, time

PR_SET_CHILD_SUBREAPER = 36
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
report_path, settle = sys.argv[1], float(sys.argv[2])
argv = sys.argv[4:]
# The test signals the supervisor, never us: don't die of a stray terminal signal.
# (Ignored only after the spawn: the supervisor must inherit default dispositions.)
sup = subprocess.Popen(argv)
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)
rc = sup.wait()
me = os.getpid()

def stat(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    fields = s[s.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), cmd

def children():
    out = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            st = stat(int(e))
            if st is not None and st[1] == me:
                out[int(e)] = st
    return out

reaped = []
deadline = time.monotonic() + settle
while True:
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid:
        reaped.append(pid)
        continue
    if time.monotonic() >= deadline:
        break
    time.sleep(0.01)
leaked = []
for pid, (state, _, cmd) in sorted(children().items()):
    if state != "Z":
        leaked.append({"pid": pid, "state": state, "cmdline": cmd})
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
end = time.monotonic() + 10
while time.monotonic() < end:
    try:
        pid, _ = os.waitpid(-1, 0)
    except ChildProcessError:
        break
with open(report_path + ".tmp", "w") as f:
    json.dump({"rc": rc, "leaked": leaked, "reaped": len(reaped)}, f)
os.replace(report_path + ".tmp", report_path)
"""


@dataclass
class Report:
    """What the subreaper saw once the supervisor exited."""

    rc: int  # the supervisor's exit status (negative: killed by that signal)
    leaked: list[dict[str, Any]]  # processes alive ``settle`` s after the supervisor exited
    reaped: int  # orphans that exited within the settle time
    stdout: str = ""
    stderr: str = ""

    def leaked_summary(self) -> str:
        return "\n".join(f"  pid {p['pid']} [{p['state']}]: {p['cmdline']}" for p in self.leaked)


@dataclass
class Supervised:
    """A supervisor subprocess running under the subreaper."""

    proc: subprocess.Popen[bytes]
    report_path: Path
    lines: list[dict[str, Any]] = field(default_factory=list)
    pid: int = 0
    _buf: bytes = b""

    def read_json(self, timeout: float = 30.0) -> dict[str, Any]:
        """The next JSON line the supervisor printed on stdout (fails on EOF/timeout)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError(f"no line from the supervisor in {timeout}s")
                chunk = os.read(fd, 65536)
                if not chunk:
                    err = self._stderr_now()
                    raise EOFError(f"supervisor closed stdout; stderr:\n{err}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        self.lines.append(msg)
        return msg

    def _stderr_now(self) -> str:
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return "<still running>"
        assert self.proc.stderr is not None
        return self.proc.stderr.read().decode(errors="replace")

    def send(self, sig: int) -> None:
        """Signal the supervisor (a process this test started)."""
        assert self.pid
        os.kill(self.pid, sig)

    def stop(self) -> None:
        """Kill and reap the supervisor and the subreaper, if still running.

        Run after each test (``on_teardown``): a test that failed before
        :meth:`finish` must not leave its supervisor behind. Killing the
        supervisor first lets the subreaper clean up its orphans and exit; the
        subreaper is killed only if it does not.
        """
        if self.proc.poll() is not None:
            return
        if self.pid and alive(self.pid):
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
        try:
            self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate(timeout=30)

    def finish(self, timeout: float = 60.0) -> Report:
        """Wait for the subreaper's report (the supervisor must exit on its own)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            if self.pid:
                os.kill(self.pid, signal.SIGKILL)
            out, err = self.proc.communicate(timeout=30)
            raise AssertionError(
                f"supervisor did not exit in {timeout}s; stderr:\n{err!r}"
            ) from exc
        data = json.loads(self.report_path.read_text())
        return Report(
            rc=data["rc"],
            leaked=data["leaked"],
            reaped=data["reaped"],
            stdout=(self._buf + (out or b"")).decode(errors="replace"),
            stderr=(err or b"").decode(errors="replace"),
        )


def start_supervised(
    tmp_path: Path,
    code: str,
    *argv: str,
    settle: float = 5.0,
    env: dict[str, str] | None = None,
    stdout: int = subprocess.PIPE,
    name: str = "supervisor.py",
) -> Supervised:
    """Run ``code`` (dedented) as a supervisor script under the subreaper.

    The script must print ``{"pid": os.getpid()}`` as its first stdout line
    (``PRELUDE`` does it); :meth:`Supervised.read_json` reads it here.
    """
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    reaper = tmp_path / "subreaper.py"
    reaper.write_text(SUBREAPER)
    report = tmp_path / (name + ".report.json")
    # Default signal dispositions whatever the runner inherited (nohup, a
    # background job): the supervisor inherits them from the subreaper.
    proc = popen(
        [
            sys.executable,
            str(reaper),
            str(report),
            str(settle),
            "--",
            sys.executable,
            str(script),
            *argv,
        ],
        stdout=stdout,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    sup = Supervised(proc, report)
    on_teardown(sup.stop)
    if stdout == subprocess.PIPE:
        try:
            sup.pid = int(sup.read_json()["pid"])
        except BaseException:
            proc.kill()
            proc.communicate(timeout=30)
            raise
    return sup


#: First lines of every supervisor script: announce the pid.
PRELUDE = """\
import asyncio, json, os, signal, sys, time
import aiolaunch
from aiolaunch import Std

def say(**kw):
    print(json.dumps(kw), flush=True)

say(pid=os.getpid())
"""


def descendants(root: int) -> set[int]:
    """Live descendants of ``root`` (by ppid, read from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    stack = [root]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in found:
                found.add(c)
                stack.append(c)
    return {p for p in found if alive(p)}


def read_pids(path: Path, n: int, timeout: float = 20.0) -> list[int]:
    """Wait for ``n`` pid files ``path/*.pid`` (written by workers); return the pids."""
    deadline = time.monotonic() + timeout
    while True:
        pids = []
        for p in path.glob("*.pid"):
            text = p.read_text().strip()
            if text.endswith("."):
                pids.append(int(text[:-1]))
        if len(pids) >= n or time.monotonic() >= deadline:
            return sorted(pids)
        time.sleep(0.01)
