"""Stack dumps of live workers, and the verdict on which rank is the odd one out.

Worker side (:mod:`aiolaunch._child._dump_handler`, installed by the function-worker
bootstrap and by ``python -m aiolaunch._child._bootstrap``): :mod:`faulthandler` is
registered for :data:`DUMP_SIGNAL` (a real-time signal: Slurm and libkineto
own SIGUSR1/2), appending every thread's stack to ``{dir}/{pid}.txt``; a
Python handler for :data:`TASKS_SIGNAL` appends the asyncio tasks of the main
thread's loop; a marker ``{dir}/{pid}.ok`` is written *after* both are in place.

Supervisor side (:func:`dump_stacks`): a worker is signalled only when its
marker exists, names its current process start time (a recycled pid is not
trusted) and ``/proc/<pid>/status`` shows a handler for the signal (``SigCgt``;
a worker that ``exec``'d since lost it). An unregistered real-time signal
would terminate the process: those workers get an entry saying why instead
(or a ``py-spy dump`` where py-spy is installed), never the signal.

faulthandler writes from inside the signal handler, in C, so a main thread
stuck in C code or holding the GIL still dumps. The supervisor knows a thread
dump is complete when the file stops growing and ends with a newline. Ranks
whose main thread then turns out to wait in an idle asyncio loop get the
second signal, and their answer ends with :data:`TASKS_END`.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .._child._dump_handler import (
    DUMP_SIGNAL,
    STACKS_DIR_ENV,
    TASKS_END,
    TASKS_SIGNAL,
    read_marker,
    register,
)
from .._workers._proc import handles_signal, read_stat, sigmasks
from ._dump_text import idle_loop_text, rank_where

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

__all__ = [
    "DUMP_SIGNAL",
    "QUIET_S",
    "STACKS_DIR_ENV",
    "TASKS_SIGNAL",
    "DumpFile",
    "StackReport",
    "collect_dumps",
    "dump_stacks",
    "register",
    "registered",
    "tasks_done",
    "thread_dump_done",
]

#: At most this long for an idle asyncio loop's task dump (its handler runs
#: as soon as the signal interrupts the loop's select()).
_TASKS_TIMEOUT = 1.0


#: how messages name :data:`DUMP_SIGNAL`
DUMP_SIGNAL_NAME = "SIGRTMIN+5"


def silent_reason(pid: int, timeout: float) -> str:
    """Why ``pid``, sent the dump signal, wrote nothing within ``timeout`` (one line)."""
    stat = read_stat(pid)
    state = "" if stat is None else stat.state
    if state in ("", "Z", "X"):
        return f"<pid {pid} has exited>"
    if state in ("T", "t"):
        return (
            f"<pid {pid} is stopped (SIGSTOP, Ctrl-Z or a debugger): it dumps once continued "
            "(kill -CONT)>"
        )
    if state == "D":
        return (
            f"<pid {pid} did not answer within {timeout:g}s: it is in uninterruptible sleep "
            "(D state: I/O or a driver call)>"
        )
    masks = sigmasks(pid, DUMP_SIGNAL)
    if masks.get(b"SigBlk"):
        return (
            f"<pid {pid} did not answer within {timeout:g}s: it blocks the dump signal "
            f"({DUMP_SIGNAL_NAME}) in its signal mask>"
        )
    return (
        f"<pid {pid} did not answer within {timeout:g}s although it runs: its handler for "
        f"the dump signal ({DUMP_SIGNAL_NAME}) is not aiolaunch's - the program replaced it "
        "(signal.signal or a library); leave that signal to aiolaunch, or install py-spy>"
    )


def start_time(pid: int) -> str | None:
    """The process start time in clock ticks since boot: with the pid, one process."""
    stat = read_stat(pid)
    return None if stat is None else str(stat.starttime)


def registered(directory: str, pid: int, sig: int = DUMP_SIGNAL, what: str = "") -> str | None:
    """``None`` if ``pid`` is a worker registered in ``directory`` (its marker,
    ``{pid}.ok``, names this very process) that handles ``sig`` now; else why
    not (one line). The one check before aiolaunch signals a worker: for a
    dump, a stack sample or an ``attach`` session (``what``: how to name ``sig``,
    e.g. ``"the attach signal (SIGRTMIN+6)"``)."""
    try:
        started = read_marker(os.path.join(directory, f"{pid}.ok"))
    except OSError:
        return (
            "not registered for stack dumps (not a Python worker started by aiolaunch: "
            "run Python programs through `aiolaunch script.py` / "
            "`python -m aiolaunch._child._bootstrap`)"
        )
    if started and started != start_time(pid):
        return "not registered for stack dumps (its pid belongs to another process now)"
    masks = sigmasks(pid, sig)
    what = what or f"the dump signal ({DUMP_SIGNAL_NAME})"
    if masks.get(b"SigIgn"):
        return f"ignores {what}: the program set SIG_IGN for it; leave that signal to aiolaunch"
    if not masks.get(b"SigCgt"):
        return (
            f"no longer handles {what}: it exec'd another program, or reset the handler to SIG_DFL"
        )
    return None


async def _py_spy(pid: int, timeout: float) -> str | None:
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        proc = await asyncio.create_subprocess_exec(
            exe,
            "dump",
            "--pid",
            str(pid),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError:
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        proc.kill()
        await proc.wait()
        return None
    return f"(py-spy dump)\n{out.decode(errors='replace')}" if proc.returncode == 0 else None


async def dump_stacks(
    directory: str, pids: Mapping[int, int], timeout: float, *, fallback: bool = True
) -> dict[int, str]:
    """Signal every registered worker in ``pids`` (``{rank: pid}``) at once; collect.

    Returns ``{rank: text}`` for every rank: faulthandler's dump (plus the
    asyncio task section of a rank idle in its event loop), or one line
    starting with ``<`` that says why there is none (unregistered, exited,
    no answer within ``timeout``). ``fallback``: ``py-spy dump`` an
    unregistered worker where py-spy is installed (a process per worker: not
    for periodic samples).
    """
    out: dict[int, str] = {}
    targets: dict[int, int] = {}
    for rank, pid in pids.items():
        why = registered(directory, pid)
        if why is None:
            targets[rank] = pid
            continue
        spy = await _py_spy(pid, timeout) if fallback else None
        out[rank] = spy if spy is not None else f"<pid {pid} {why}>"
    deadline = time.monotonic() + timeout
    files = {rank: _PathDump(directory, pid) for rank, pid in targets.items()}
    texts = await collect_dumps(files, DUMP_SIGNAL, deadline, thread_dump_done)
    for rank, pid in targets.items():
        text = texts.get(rank)
        out[rank] = text or silent_reason(pid, timeout)
    idle = {
        rank: pid
        for rank, pid in targets.items()
        if idle_loop_text(texts.get(rank, "")) and handles_signal(pid, TASKS_SIGNAL)
    }
    if idle:
        bound = min(deadline, time.monotonic() + _TASKS_TIMEOUT)
        idle_files = {rank: files[rank] for rank in idle}
        tasks = await collect_dumps(idle_files, TASKS_SIGNAL, bound, tasks_done)
        for rank, text in tasks.items():
            if tasks_done(text):
                out[rank] += text
    return {rank: out[rank] for rank in sorted(out)}


def thread_dump_done(text: str, stable: bool) -> bool:
    """Whether a thread dump is complete (``stable``: it did not grow since
    the previous look).

    faulthandler writes a dump line by line from its signal handler and has
    no end marker; a worker preempted mid-dump stops growing for a while, so
    "stopped growing" alone would cut a dump under load. The main thread
    comes last, and its outermost frame ends the dump: runpy's
    ``_run_module_as_main`` (``python -m``: the bootstrap), a spawned
    child's ``<string>`` ``<module>``, or ``...`` (faulthandler's depth or
    thread limits). A ``<module>`` frame of a file can be an inner one too (a
    script run by the bootstrap, a module being imported): that one counts
    once the dump stopped growing.
    """
    if not text.endswith("\n"):
        return False
    last = text[text.rstrip("\n").rfind("\n") + 1 :].strip()
    if last.endswith(" in _run_module_as_main") or last in ("...", "<no Python frame>"):
        return True
    if last.endswith(" in <module>"):
        return stable or last.startswith('File "<string>"')
    return False


def tasks_done(text: str, stable: bool = True) -> bool:
    """Whether an asyncio task dump is complete (it ends with its marker)."""
    return text.rstrip().endswith(TASKS_END)


#: A dump that stopped growing for this long without its known end is
#: taken as complete (a main thread with an unusual outermost frame).
QUIET_S = 0.2


class DumpFile(Protocol):
    """A worker's dump file as :func:`collect_dumps` reads it."""

    @property
    def pid(self) -> int: ...

    def size(self) -> int:
        """The file's size now; ``-1`` when it cannot be read."""
        ...

    def read(self, offset: int, size: int) -> str:
        """Bytes ``offset`` to ``size``, decoded; ``""`` when they cannot be read."""
        ...


class _PathDump:
    """A dump file opened anew for each look (one-off dumps hold no fds)."""

    __slots__ = ("path", "pid")

    def __init__(self, directory: str, pid: int) -> None:
        self.pid, self.path = pid, os.path.join(directory, f"{pid}.txt")

    def size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except OSError:
            return -1

    def read(self, offset: int, size: int) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                return f.read(size - offset).decode("utf-8", "replace")
        except OSError:
            return ""


async def collect_dumps(
    files: Mapping[int, DumpFile],
    sig: int,
    deadline: float,
    done: Callable[[str, bool], bool],
    grown: dict[int, int] | None = None,
) -> dict[int, str]:
    """Send ``sig`` to every file's pid; ``{rank: what its file grew by}``:
    once it is ``done``, or has not grown for :data:`QUIET_S`, or whatever
    came by ``deadline``. A rank whose file cannot be read or whose process
    is gone is left out. ``grown``: the bytes each rank's file grew by are
    added to it (a sampler discounts its own dumps from a rank's output).
    """
    offsets: dict[int, int] = {}
    for rank, f in files.items():
        start = f.size()
        if start < 0:
            continue  # its file is gone
        try:
            os.kill(f.pid, sig)
        except OSError:  # so is the process (ProcessLookupError)
            continue
        offsets[rank] = start
    out: dict[int, str] = {}
    sizes: dict[int, tuple[int, float]] = {}  # rank: (size, since when)
    pause = 0.002
    while offsets:
        await asyncio.sleep(pause)  # allowed: no completion event exists for a dump
        pause = min(pause * 2, 0.02)
        now = time.monotonic()
        last = now > deadline
        for rank in list(offsets):
            size = files[rank].size()
            prev, since = sizes.get(rank, (-1, now))
            if size != prev:
                sizes[rank] = (size, now)
            if size <= offsets[rank] and not last:
                continue  # nothing yet
            text = files[rank].read(offsets[rank], size) if size > offsets[rank] else ""
            if last or done(text, size == prev) or (size == prev and now - since >= QUIET_S):
                out[rank] = text
                if grown is not None:
                    grown[rank] = grown.get(rank, 0) + max(0, size - offsets[rank])
                del offsets[rank]
    return out


# -- the verdict -------------------------------------------------------------


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 3]`` -> ``"0-1,3"``."""
    out: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


@dataclass(frozen=True)
class StackReport:
    """Ranks grouped by where their main thread is, and the ranks that differ.

    ``groups``: ``[(ranks, summary), ...]``, the largest group first, where
    ``summary`` names the innermost frames of the main thread (``func
    (file:line) <- caller (file:line)``), or the reason a rank has no dump;
    ranks at different lines of one innermost function (one spin loop) are
    one group, shown with its first rank's line.
    An asyncio rank whose main thread waits in its idle event loop is placed
    by its deepest task's await chain instead (``task: load_batch (data.py:41)
    <- step (train.py:9)``): every asyncio rank waits in that same loop.
    ``outliers``: ranks outside the one largest group (empty when every rank
    is in one place, or when no group is larger than all others: then there
    is no majority to differ from). ``str(report)`` is the readable form::

        ranks 0-1,3: all_reduce (distributed_c10d.py:2950) <- train_step (train.py:88)
        rank 2: load_batch (data.py:41)  <- outlier
    """

    groups: list[tuple[list[int], str]] = field(default_factory=list)
    outliers: list[int] = field(default_factory=list)

    @classmethod
    def from_dumps(cls, dumps: Mapping[int, str]) -> StackReport:
        """Build the report from :meth:`PContext.dump_stacks`'s ``{rank: text}``."""
        by_where: dict[str, list[int]] = {}
        shown: dict[str, str] = {}  # key -> where, with the first rank's innermost line
        for rank in sorted(dumps):
            key, where = rank_where(dumps[rank])
            by_where.setdefault(key, []).append(rank)
            shown.setdefault(key, where)
        groups = sorted(
            ((ranks, shown[key]) for key, ranks in by_where.items()),
            key=lambda g: (-len(g[0]), g[0]),
        )
        outliers: list[int] = []
        if len(groups) > 1 and len(groups[0][0]) > len(groups[1][0]):
            outliers = sorted(r for ranks, _ in groups[1:] for r in ranks)
        return cls(groups=groups, outliers=outliers)

    def line_for(self, rank: int) -> str | None:
        """The report's line for the group that holds ``rank``."""
        for ranks, where in self.groups:
            if rank in ranks:
                return self._line(ranks, where)
        return None

    def _line(self, ranks: list[int], where: str) -> str:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
        mark = "  <- outlier" if ranks and ranks[0] in self.outliers else ""
        return f"{who}: {where}{mark}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``groups`` as ``{"ranks", "where"}`` and ``outliers``."""
        return {
            "groups": [{"ranks": ranks, "where": where} for ranks, where in self.groups],
            "outliers": list(self.outliers),
        }

    def __str__(self) -> str:
        return "\n".join(self._line(ranks, where) for ranks, where in self.groups)
