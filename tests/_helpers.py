"""Shared test helpers: driver subprocesses, process liveness, group setup.

The suite must not depend on how it was started. Run as a background job of a
non-interactive shell, or under ``nohup``, the test runner inherits SIGINT and
SIGQUIT (or SIGHUP) as *ignored*, and ``exec`` keeps an ignored disposition:
a supervisor started from such a runner would ignore the very signal a test
sends it. :func:`driver` and :func:`popen` therefore start every driver
subprocess with the default disposition of the terminal signals (and an empty
signal mask), whatever the runner inherited; only the test of an inherited
``SIG_IGN`` asks for one explicitly (``ignore=``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from pathlib import Path

    from aiolaunch._api import _Starting

__all__ = [
    "RESET_SIGNALS",
    "alive",
    "cli_argv",
    "cli_env",
    "default_signals",
    "driver",
    "on_teardown",
    "popen",
    "proc_state",
    "run_teardowns",
    "start",
    "together",
    "wait_dead",
    "wait_lines",
    "wait_until",
    "write_atomic",
]

#: Signals whose disposition a driver subprocess gets reset to ``SIG_DFL``:
#: those a shell or ``nohup`` may hand down as ignored, and those tests send.
RESET_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def default_signals(ignore: Iterable[signal.Signals] = ()) -> Callable[[], None]:
    """A ``preexec_fn`` that resets :data:`RESET_SIGNALS` to ``SIG_DFL`` and unblocks all.

    Runs in the forked child before ``exec``; dispositions set to ``SIG_DFL``
    or ``SIG_IGN`` survive ``exec`` (handlers do not), so the new program
    starts as if launched from an interactive shell. Signals in ``ignore``
    are set to ``SIG_IGN`` instead (the inherited-``SIG_IGN`` tests).
    """
    ignored = frozenset(ignore)

    def preexec() -> None:
        for sig in RESET_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        for sig in ignored - set(RESET_SIGNALS):
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())

    return preexec


def popen(
    argv: list[str], *, ignore: Iterable[signal.Signals] = (), **kwargs: Any
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **kwargs)`` with default signal dispositions.

    The caller owns the process: kill and reap it (or use :func:`driver`).
    """
    return subprocess.Popen(argv, preexec_fn=default_signals(ignore), **kwargs)


@contextlib.contextmanager
def driver(
    argv: list[str],
    *,
    ignore: Iterable[signal.Signals] = (),
    stdout: int | None = subprocess.PIPE,
    stderr: int | None = subprocess.PIPE,
    text: bool = True,
    **kwargs: Any,
) -> Iterator[subprocess.Popen[Any]]:
    """Run a driver subprocess (a supervisor script, the CLI) for the ``with`` block.

    Starts with default signal dispositions (see :func:`default_signals`),
    stdout and stderr piped as text by default. On exit - normal, failed
    assertion or timeout - a process still running is SIGKILLed, and it is
    always reaped and its pipes closed, so no test leaves a supervisor behind
    to disturb the next one.
    """
    proc = popen(argv, ignore=ignore, stdout=stdout, stderr=stderr, text=text, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        # communicate() drains and closes the pipes; wait() alone could block
        # on a full pipe of a process that is not dead yet.
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
            proc.communicate(timeout=30)
        proc.wait()


_teardowns: list[Callable[[], None]] = []


def on_teardown(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current test ends, pass or fail (latest first).

    For helpers that start processes outside a ``with`` block: the autouse
    fixture of ``tests/conftest.py`` calls :func:`run_teardowns` before its
    leak check, so a test that failed early reports its own failure, not a leak.
    """
    _teardowns.append(fn)


def run_teardowns() -> None:
    """Run and forget every :func:`on_teardown` callback (all of them, even if one raises)."""
    errors: list[BaseException] = []
    while _teardowns:
        try:
            _teardowns.pop()()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def proc_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (``R``, ``S``, ``Z``...), ``None`` when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie has exited: it is dead).

    ``os.kill(pid, 0)`` succeeds on a zombie, so it cannot tell; ``/proc`` can.
    """
    return proc_state(pid) not in (None, "Z", "X")


def wait_dead(pids: int | Iterable[int], timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is alive, at most ``timeout`` s; return the survivors.

    Callers assert the result is empty (``assert not wait_dead(...)``), so a
    failure names the processes that outlived the bound.
    """
    todo = [pids] if isinstance(pids, int) else list(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in todo if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.01)


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so a reader never sees it empty or partial.

    Writes a sibling temp file, then renames it over ``path`` (atomic on POSIX).
    """
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def start(
    tmp_path: Path,
    entrypoint: Any,
    *args: tuple[Any, ...],
    name: str = "t",
    n: int | None = None,
    **kwargs: Any,
) -> _Starting:
    """``start_processes`` with the boilerplate of most tests filled in.

    ``args`` are the per-rank argument tuples (rank i gets ``args[i]``); with
    ``n`` and no ``args``, ``n`` ranks get no arguments. Every rank gets an
    empty env, logs go under ``tmp_path``; ``kwargs`` override or
    add any other argument. Returns what ``start_processes`` returns: use it
    as ``async with start(...) as ctx`` or ``ctx = await start(...)``.
    """
    if not args:
        args = tuple(() for _ in range(n or 1))
    kwargs.setdefault("log_dir", str(tmp_path))
    return aiolaunch.start_processes(
        name=name,
        entrypoint=entrypoint,
        args=dict(enumerate(args)),
        envs={i: {} for i in range(len(args))},
        **kwargs,
    )


async def wait_lines(log_dir: Path, ranks: int, needle: str, timeout: float = 60) -> float:
    """Wait until ``ranks`` of the ``stdout.log`` files under ``log_dir`` hold
    ``needle`` (a worker's handshake line); the monotonic time they did."""
    import pytest

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = 0
        for path in log_dir.glob("**/stdout.log"):
            try:
                done += needle in path.read_text(errors="replace")
            except OSError:
                pass
        if done >= ranks:
            return time.monotonic()
        await asyncio.sleep(0.05)  # allowed: polling log files the test reads
    pytest.fail(f"{ranks} ranks did not print {needle!r} in {log_dir} within {timeout}s")


async def together(*coros: Any) -> list[Any]:
    """``asyncio.gather`` that, when one fails, cancels and awaits the others
    (their ``async with`` blocks close their groups) before raising."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def exited(ctx: aiolaunch.PContext, rank: int) -> aiolaunch.WorkerExited:
    """The first :class:`WorkerExited` of ``rank`` (replayed if it happened already)."""
    async for event in ctx.events():
        if isinstance(event, aiolaunch.WorkerExited) and event.rank == rank:
            return event
    raise AssertionError(f"the group stopped without an exit of rank {rank}")


def cli_env() -> dict[str, str]:
    """This environment, with this interpreter's ``sys.path`` for a child
    ``python -m aiolaunch`` (the checkout, not an installed copy)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def cli_argv(*args: str) -> list[str]:
    """``python -m aiolaunch ARGS...`` with this interpreter."""
    return [sys.executable, "-m", "aiolaunch", *args]


def wait_until(
    what: str,
    check: Callable[[], object],
    timeout: float = 30.0,
    show: Callable[[], str] = str,
    period: float = 0.1,
) -> Any:
    """``check()``'s first true value, asked every ``period`` seconds; fails
    the test after ``timeout`` naming ``what`` (and ``show()``)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{show()}")
        time.sleep(period)  # allowed: polling another process's output
