"""A pytest plugin that fails tests which leave processes, fds or signal handlers behind.

Enable it (it is registered as the ``aiolaunch`` pytest plugin when aiolaunch
is installed, or list ``"aiolaunch.testing"`` in ``pytest_plugins``), then
either request the fixture::

    async def test_supervisor(no_leaks):
        ...

or check every test (``pytest.ini`` / ``pyproject.toml``)::

    [tool.pytest.ini_options]
    aiolaunch_leak_check = true        # or: pytest --aiolaunch-leak-check

After each checked test, three kinds of leak fail it at teardown:

(a) **Processes**: a live descendant of the test process, a *zombie* child
    nobody reaped, or an *orphan* - a grandchild whose parent died and that
    was re-parented away, which the ppid tree no longer shows. Orphans are
    found through an environment tag: the plugin puts a per-session token into
    ``$AIOLAUNCH_LEAKCHECK_TOKENS``; processes started by the tests inherit it
    and the check reads ``/proc/<pid>/environ``. (A process started with an
    empty environment escapes this part.) Only pids that appeared during the
    test are examined, so the check costs a few milliseconds.
(b) **File descriptors**: new entries of ``/proc/self/fd``, with their targets.
(c) **Signal handlers**: ``signal.getsignal()`` of SIGTERM, SIGINT, SIGHUP,
    SIGQUIT and SIGCHLD, and the ``signal.set_wakeup_fd`` fd.

Leaks get a bounded settle time (``aiolaunch_leak_settle``, default 2 s)
because a killed process takes a moment to be reaped.

**Event loops.** The check is a *sync* function-scoped fixture set up before
any other fixture of the test, so under pytest-asyncio and under anyio's
plugin the snapshot is taken before the test's event loop exists and compared
after it was closed. A loop or runner of a wider scope (a module-scoped
``anyio_backend`` runner kept alive by a module-scoped async fixture, a
session-scoped pytest-asyncio loop) is created before the snapshot of the
first test in that scope only if one of its fixtures was set up earlier: such
a test may see the loop's fds as new. Mark it ``leaks_ok("fds")`` or widen
nothing.

**Allowed helpers.** Processes started once per interpreter and kept until it
exits are never reported: ``multiprocessing``'s resource tracker and
forkserver, and aiolaunch's own lifeline pipe and guardian process. Add your
own with :func:`allow_long_lived_helper`.

**Opting out**: ``@pytest.mark.leaks_ok`` skips the check for one test;
``@pytest.mark.leaks_ok("fds")`` skips only the named parts (``"processes"``,
``"fds"``, ``"signals"``).

*Platform*: Linux reads ``/proc``; on macOS the check uses ``/dev/fd`` and
``ps`` and cannot see orphans. Importing :mod:`aiolaunch` never imports this
module (nor pytest).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "CHECKS",
    "Proc",
    "Snapshot",
    "allow_long_lived_helper",
    "new_processes",
    "no_leaks",
    "open_fds",
]

CHECKS = ("processes", "fds", "signals")
TOKEN_ENV = "AIOLAUNCH_LEAKCHECK_TOKENS"
DEFAULT_SETTLE_S = 2.0
_POLL_S = 0.02

SIGNALS = tuple(
    sig
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD)
    if isinstance(sig, signal.Signals)
)

_HAVE_PROC = os.path.isdir("/proc/self/fd")
_FD_DIR = "/proc/self/fd" if _HAVE_PROC else "/dev/fd"

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


def _all_pids() -> set[int]:
    if not _HAVE_PROC:  # pragma: no cover - macOS
        return set(_process_table_ps())
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def _read_proc(pid: int) -> Proc | None:
    from ._workers._proc import read_stat

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
    if not _HAVE_PROC:  # pragma: no cover - macOS
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
    """Processes of ours whose pid is not in ``before``.

    Ours: descendants of this process (zombies included) and processes that
    carry this session's token (orphans).
    """
    me = os.getpid()
    token = session_token()
    if _HAVE_PROC:
        cache: dict[int, Proc | None] = {}

        def lookup(pid: int) -> Proc | None:
            if pid not in cache:
                cache[pid] = _read_proc(pid)
            return cache[pid]

        candidates = _all_pids() - before - {me}
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


# -- long-lived helpers ------------------------------------------------------


def _multiprocessing_helpers() -> tuple[set[int], set[int]]:
    from ._compat import multiprocessing_helpers

    return multiprocessing_helpers()


def _aiolaunch_helpers() -> tuple[set[int], set[int]]:
    from ._workers import long_lived_helpers

    return long_lived_helpers()


_HELPERS: list[Callable[[], tuple[set[int], set[int]]]] = [
    _multiprocessing_helpers,
    _aiolaunch_helpers,
]


def allow_long_lived_helper(helper: Callable[[], tuple[set[int], set[int]]]) -> None:
    """Never report ``helper()``'s ``(pids, fds)``: things started once per interpreter."""
    _HELPERS.append(helper)


def _helpers() -> tuple[set[int], set[int]]:
    pids: set[int] = set()
    fds: set[int] = set()
    for helper in _HELPERS:
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
    try:
        # set_wakeup_fd() both reads and sets: put the old value straight back.
        wakeup = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup)
    except ValueError:  # not the main thread (pytest-xdist worker threads, etc.)
        wakeup = None
    state["wakeup_fd"] = wakeup
    return state


# -- the check ---------------------------------------------------------------


@dataclass
class Snapshot:
    """What existed before a test: the baseline :meth:`leaks` compares to."""

    pids: set[int]
    fds: set[int]
    signals: dict[str, object]
    checks: tuple[str, ...] = CHECKS
    ignore_fds: set[int] = field(default_factory=set)

    @classmethod
    def take(cls, checks: tuple[str, ...] = CHECKS) -> Snapshot:
        session_token()
        return cls(_all_pids(), set(open_fds()), _signal_state(), checks)

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
                if fd not in self.fds and fd not in helper_fds and fd not in self.ignore_fds:
                    problems.append(f"fd {fd} -> {target}")
        if "signals" in self.checks:
            now = _signal_state()
            for name, before in self.signals.items():
                if now[name] != before:
                    problems.append(f"signal {name}: handler was {before!r}, now {now[name]!r}")
        return problems

    def wait_for_no_leaks(self, settle: float = DEFAULT_SETTLE_S) -> list[str]:
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
            time.sleep(_POLL_S)  # allowed: a bounded settle; a stranger process has no exit event


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


def _settle(config: pytest.Config) -> float:
    env = os.environ.get("AIOLAUNCH_LEAKCHECK_SETTLE")
    if env:
        return float(env)
    value = config.getini("aiolaunch_leak_settle")
    return float(value) if value else DEFAULT_SETTLE_S


@pytest.fixture
def no_leaks(request: pytest.FixtureRequest) -> Iterator[Snapshot | None]:
    """Fail the test at teardown if it leaves processes, fds or changed signal handlers.

    Yields the :class:`Snapshot` (or ``None`` when ``leaks_ok`` turned every
    check off); ``snapshot.ignore_fds`` may be extended by the test.
    """
    checks = _checks_for(request.node)
    if not checks:
        yield None
        return
    before = Snapshot.take(checks)
    yield before
    settle = _settle(request.config)
    problems = before.wait_for_no_leaks(settle)
    if problems:
        pytest.fail(
            f"{request.node.nodeid} leaked (still there after {settle:g} s):\n  "
            + "\n  ".join(problems)
            + "\n(mark the test @pytest.mark.leaks_ok only if this is intended)",
            pytrace=False,
        )


# -- plugin hooks ------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aiolaunch")
    group.addoption(
        "--aiolaunch-leak-check",
        action="store_true",
        default=None,
        help="check every test for leaked processes, fds and signal handlers",
    )
    parser.addini(
        "aiolaunch_leak_check",
        type="bool",
        default=False,
        help="check every test for leaked processes, fds and signal handlers (no_leaks)",
    )
    parser.addini(
        "aiolaunch_leak_settle",
        default="",
        help=f"seconds leaks may take to go away after a test (default {DEFAULT_SETTLE_S})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "leaks_ok(*checks): skip aiolaunch's leak check for this test; with arguments, "
        "only the named parts (processes, fds, signals)",
    )
    session_token()


def _autouse(config: pytest.Config) -> bool:
    option = config.getoption("--aiolaunch-leak-check", default=None)
    if option is not None:
        return bool(option)
    return bool(config.getini("aiolaunch_leak_check"))


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if not _autouse(config):
        return
    for item in items:
        names = getattr(item, "fixturenames", None)
        if isinstance(names, list) and "no_leaks" not in names:
            # First: set up before the test's event loop and torn down after it.
            names.insert(0, "no_leaks")
