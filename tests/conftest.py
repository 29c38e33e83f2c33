"""Test-suite wide fixtures: the autouse leak check (STYLE.md practice 12).

Every test, sync or async, is checked for three kinds of leak:

(a) **Processes.** No process may be left that the test started: neither a
    live descendant of the test runner (found through the ppid tree in
    ``/proc/*/stat``) nor a *zombie* child nobody reaped, nor an *orphan* - a
    grandchild whose parent died, now re-parented to init, which the ppid tree
    no longer shows. Orphans are found through an environment tag: this
    conftest puts a per-session token into ``$AIOLAUNCH_LEAKCHECK_TOKENS``,
    every process the tests start inherits it, and the check scans
    ``/proc/<pid>/environ`` for it. (A process started with an empty
    environment escapes this part of the check.) Only pids that appeared
    during the test are examined, so the check costs a few milliseconds.
(b) **File descriptors.** No new entry in ``/proc/self/fd``; the report gives
    each leaked fd and its ``readlink`` target.
(c) **Signal handlers.** ``signal.getsignal()`` of SIGTERM, SIGINT, SIGHUP,
    SIGQUIT and SIGCHLD, and the ``signal.set_wakeup_fd`` fd, are what they
    were before the test.

Leaks found right after the test get a bounded settle time (polling up to
``SETTLE_S`` = 2 s), since a killed process takes a moment to be reaped by the
event loop's child watcher; after that the test fails at teardown with the
list of leaked processes (pid, state, cmdline), fds and handlers.

**Ordering.** The check is a *sync* autouse fixture. pytest sets up autouse
fixtures before the fixtures a test requests, and pytest-asyncio adds its
event-loop runner to the *requested* ones, so the snapshot is taken before the
test's event loop exists and the check runs after the loop (its epoll fd and
self-pipe, its signal wakeup fd) is closed. Fixtures of a wider scope
(module, session) are set up before the snapshot and torn down after the
check, so their resources are never reported.

**Allowlist: helpers started once per interpreter.** ``multiprocessing``
starts two long-lived helpers on first use and keeps them until the
interpreter exits: the *resource tracker* (the ``spawn`` and ``forkserver``
start methods start it) and the *forkserver* process. Their processes and the
fd this interpreter keeps to each (``resource_tracker._resource_tracker._fd``,
``forkserver._forkserver._forkserver_alive_fd``) are read from
``multiprocessing``'s own state at check time and never reported. Only these
exact processes are allowed: workers the forkserver forks are checked like any
other descendant. aiolaunch's own once-per-interpreter *lifeline* pipe (its
EOF tells function workers that the supervisor died) is allowed the same way.
To allow another once-per-interpreter helper, add a function returning its
``(pids, fds)`` to ``LONG_LIVED_HELPERS``.

**Opting out.** ``@pytest.mark.leaks_ok`` skips the whole check for one test;
``@pytest.mark.leaks_ok("fds")`` skips only the named parts (``"processes"``,
``"fds"``, ``"signals"``). Use it sparingly, with a comment saying why.

Linux reads ``/proc``; on macOS the check uses ``/dev/fd`` and ``ps``, and
cannot see orphans.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

pytest_plugins = ("pytester",)

#: How long leaks may take to go away after a test (``$AIOLAUNCH_LEAKCHECK_SETTLE``).
SETTLE_S = float(os.environ.get("AIOLAUNCH_LEAKCHECK_SETTLE", "2.0"))
_POLL_S = 0.02

CHECKS = ("processes", "fds", "signals")

TOKEN_ENV = "AIOLAUNCH_LEAKCHECK_TOKENS"
# One token per pytest session, appended to what a parent session set, so a
# pytest run inside a test (pytester) does not hide its orphans from ours.
SESSION_TOKEN = uuid.uuid4().hex
os.environ[TOKEN_ENV] = ":".join(filter(None, [os.environ.get(TOKEN_ENV), SESSION_TOKEN]))

SIGNALS = tuple(
    sig
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD)
    if isinstance(sig, signal.Signals)
)

_HAVE_PROC = os.path.isdir("/proc/self/fd")
_FD_DIR = "/proc/self/fd" if _HAVE_PROC else "/dev/fd"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "leaks_ok(*checks): skip the autouse leak check for this test; with arguments, "
        "only the named parts (processes, fds, signals)",
    )


# -- processes ---------------------------------------------------------------


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
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return f"[{comm}]"
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    return " ".join(args) if args else f"[{comm}]"  # zombies have no cmdline


def all_pids() -> set[int]:
    """Every pid in the system (cheap: one directory listing)."""
    if not _HAVE_PROC:
        return set(_process_table_ps())
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def read_proc(pid: int) -> Proc | None:
    """``pid``'s ppid, state and cmdline, or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:  # exited meanwhile
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    lpar, rpar = stat.find("("), stat.rfind(")")
    comm = stat[lpar + 1 : rpar]
    fields = stat[rpar + 2 :].split()
    return Proc(pid, int(fields[1]), fields[0], _read_cmdline(pid, comm))


def _process_table_ps() -> dict[int, Proc]:  # pragma: no cover - macOS
    ps = subprocess.run(
        ["ps", "-A", "-o", "pid=,ppid=,stat=,command="],
        capture_output=True,
        text=True,
        check=True,
    )
    table: dict[int, Proc] = {}
    for line in ps.stdout.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3:
            pid, ppid = int(parts[0]), int(parts[1])
            table[pid] = Proc(pid, ppid, parts[2][:1], parts[3] if len(parts) > 3 else "")
    # ps itself was our child while it listed.
    table.pop(next((p for p, pr in table.items() if pr.cmdline.startswith("ps -A")), -1), None)
    return table


def is_descendant(pid: int, root: int, lookup: Callable[[int], Proc | None]) -> bool:
    """Whether ``root`` is among ``pid``'s ancestors (following ppids)."""
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


def is_tagged(pid: int, token: str = SESSION_TOKEN) -> bool:
    """Whether ``pid``'s environment carries ``token`` (started, maybe indirectly, by us)."""
    if not _HAVE_PROC:  # pragma: no cover - macOS: no /proc/<pid>/environ
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:  # another user's, or exited
        return False
    needle = TOKEN_ENV.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(needle):
            return token.encode() in entry[len(needle) :].split(b":")
    return False


def new_processes(before: set[int]) -> list[Proc]:
    """Our processes whose pid is not in ``before``.

    Ours: descendants of this process (zombies included) and processes that
    carry this session's token (orphans). Only pids new since ``before`` are
    examined, so the check costs little however busy the machine is.
    """
    me = os.getpid()
    if _HAVE_PROC:
        cache: dict[int, Proc | None] = {}

        def lookup(pid: int) -> Proc | None:
            if pid not in cache:
                cache[pid] = read_proc(pid)
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
        if proc is not None and (is_descendant(pid, me, lookup) or is_tagged(pid)):
            found.append(proc)
    return found


# -- long-lived helpers ------------------------------------------------------


def _multiprocessing_helpers() -> tuple[set[int], set[int]]:
    """The resource tracker and forkserver of this interpreter, if started."""
    pids: set[int] = set()
    fds: set[int] = set()
    tracker_mod = sys.modules.get("multiprocessing.resource_tracker")
    tracker = getattr(tracker_mod, "_resource_tracker", None)
    if tracker is not None:
        pid, fd = getattr(tracker, "_pid", None), getattr(tracker, "_fd", None)
        if isinstance(pid, int):
            pids.add(pid)
        if isinstance(fd, int):
            fds.add(fd)
    forkserver_mod = sys.modules.get("multiprocessing.forkserver")
    forkserver = getattr(forkserver_mod, "_forkserver", None)
    if forkserver is not None:
        pid = getattr(forkserver, "_forkserver_pid", None)
        fd = getattr(forkserver, "_forkserver_alive_fd", None)
        if isinstance(pid, int):
            pids.add(pid)
        if isinstance(fd, int):
            fds.add(fd)
    return pids, fds


def _aiolaunch_lifeline() -> tuple[set[int], set[int]]:
    """aiolaunch's process-wide lifeline pipe (``_workers/_function.py``).

    Function workers watch its read end for EOF to learn that the supervisor
    died; it is created on first use and kept for the interpreter's life.
    """
    module = sys.modules.get("aiolaunch._workers._function")
    lifeline = getattr(module, "_lifeline", None)
    if isinstance(lifeline, tuple) and len(lifeline) == 3 and lifeline[0] == os.getpid():
        return set(), {fd for fd in lifeline[1:] if isinstance(fd, int)}
    return set(), set()


def _aiolaunch_guardian() -> tuple[set[int], set[int]]:
    """aiolaunch's guardian process and our end of its pipe (``_workers/_guardian.py``).

    It kills binary workers' groups if the supervisor dies; one per interpreter.
    """
    module = sys.modules.get("aiolaunch._workers._guardian")
    guard = getattr(module, "_guardian", None)
    if guard is None or getattr(guard, "owner", None) != os.getpid():
        return set(), set()
    return {guard.pid}, {guard.fd}


#: Functions returning ``(pids, fds)`` of helpers legitimately started once per
#: interpreter and kept until it exits; never reported as leaks.
LONG_LIVED_HELPERS: list[Callable[[], tuple[set[int], set[int]]]] = [
    _multiprocessing_helpers,
    _aiolaunch_lifeline,
    _aiolaunch_guardian,
]


def _helpers() -> tuple[set[int], set[int]]:
    pids: set[int] = set()
    fds: set[int] = set()
    for helper in LONG_LIVED_HELPERS:
        more_pids, more_fds = helper()
        pids |= more_pids
        fds |= more_fds
    return pids, fds


# -- fds and signals ---------------------------------------------------------


def open_fds() -> dict[int, str]:
    """This process's open fds and what they point to: ``{fd: target}``."""
    fds: dict[int, str] = {}
    for name in os.listdir(_FD_DIR):
        fd = int(name)
        try:
            target = os.readlink(f"{_FD_DIR}/{fd}") if _HAVE_PROC else _fd_kind(fd)
        except OSError:  # the fd of the listing itself, closed by now
            continue
        fds[fd] = target
    return fds


def _fd_kind(fd: int) -> str:  # pragma: no cover - macOS
    import stat

    mode = os.fstat(fd).st_mode
    for test, kind in ((stat.S_ISFIFO, "pipe"), (stat.S_ISSOCK, "socket"), (stat.S_ISREG, "file")):
        if test(mode):
            return kind
    return "other"


def _signal_state() -> dict[str, object]:
    state: dict[str, object] = {sig.name: signal.getsignal(sig) for sig in SIGNALS}
    # set_wakeup_fd() both reads and sets: put the old value straight back.
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    state["wakeup_fd"] = wakeup
    return state


# -- the check ---------------------------------------------------------------


@dataclass
class Snapshot:
    """What existed before a test: the baseline the leak check compares to."""

    pids: set[int]  # every pid of the system, not only ours
    fds: set[int]
    signals: dict[str, object]
    checks: tuple[str, ...] = CHECKS

    @classmethod
    def take(cls, checks: tuple[str, ...] = CHECKS) -> Snapshot:
        return cls(all_pids(), set(open_fds()), _signal_state(), checks)

    def leaks(self) -> list[str]:
        """Describe everything new since the snapshot (empty: no leak)."""
        problems: list[str] = []
        helper_pids, helper_fds = _helpers()
        if "processes" in self.checks:
            for proc in new_processes(self.pids):
                if proc.pid not in helper_pids:
                    problems.append(f"process {proc.describe()}")
        if "fds" in self.checks:
            for fd, target in sorted(open_fds().items()):
                if fd not in self.fds and fd not in helper_fds:
                    problems.append(f"fd {fd} -> {target}")
        if "signals" in self.checks:
            now = _signal_state()
            for name, before in self.signals.items():
                if now[name] != before:
                    problems.append(f"signal {name}: handler was {before!r}, now {now[name]!r}")
        return problems

    def wait_for_no_leaks(self, settle: float = SETTLE_S) -> list[str]:
        """Poll :meth:`leaks` for up to ``settle`` seconds; return the last findings."""
        deadline = time.monotonic() + settle
        collected = False
        while True:
            problems = self.leaks()
            if not problems or time.monotonic() >= deadline:
                return problems
            if not collected:
                # An fd held only by garbage (an unclosed file in a cycle) is
                # released here, and shows up as a ResourceWarning instead.
                gc.collect()
                collected = True
            time.sleep(_POLL_S)


def _checks_for(item: pytest.Item) -> tuple[str, ...]:
    marker = item.get_closest_marker("leaks_ok")
    if marker is None:
        return CHECKS
    if not marker.args:
        return ()
    unknown = set(marker.args) - set(CHECKS)
    if unknown:
        raise pytest.UsageError(f"leaks_ok({', '.join(map(repr, marker.args))}): use {CHECKS}")
    return tuple(c for c in CHECKS if c not in marker.args)


@pytest.fixture(autouse=True)
def _leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if it leaves processes, fds or changed signal handlers behind."""
    checks = _checks_for(request.node)
    if not checks:
        yield
        return
    before = Snapshot.take(checks)
    yield
    problems = before.wait_for_no_leaks()
    if problems:
        pytest.fail(
            f"{request.node.nodeid} leaked (still there after {SETTLE_S:g} s):\n  "
            + "\n  ".join(problems)
            + "\n(mark the test @pytest.mark.leaks_ok only if this is intended)",
            pytrace=False,
        )
