"""Stack dumps of live workers, and the verdict on which rank is the odd one out.

Worker side (:func:`register`, run by the function-worker bootstrap and by
``python -m aiolaunch._bootstrap``): :mod:`faulthandler` is registered for
:data:`DUMP_SIGNAL` (a real-time signal: Slurm and libkineto own SIGUSR1/2),
appending every thread's stack to ``{dir}/{pid}.txt``, and a marker
``{dir}/{pid}.ok`` is written *after* the handler is in place.

Supervisor side (:func:`dump_stacks`): a worker is signalled only when its
marker exists, names its current process start time (a recycled pid is not
trusted) and ``/proc/<pid>/status`` shows a handler for the signal (``SigCgt``;
a worker that ``exec``'d since lost it). An unregistered real-time signal
would terminate the process: those workers get an entry saying why instead
(or a ``py-spy dump`` where py-spy is installed), never the signal.

faulthandler writes from inside the signal handler, in C, so a main thread
stuck in C code or holding the GIL still dumps. The supervisor knows a dump is
complete when the file stops growing and ends with a newline.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._dump_handler import DUMP_SIGNAL, STACKS_DIR_ENV, register, start_time

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = ["DUMP_SIGNAL", "STACKS_DIR_ENV", "StackReport", "dump_stacks", "register"]


#: how messages name :data:`DUMP_SIGNAL`
DUMP_SIGNAL_NAME = "SIGRTMIN+5"


def _sigmasks(pid: int) -> dict[bytes, bool]:
    """Whether :data:`DUMP_SIGNAL` is in each ``Sig*`` mask of ``/proc/<pid>/status``
    (``SigCgt``: caught, ``SigIgn``: ignored, ``SigBlk``: blocked); ``{}`` if gone."""
    masks: dict[bytes, bool] = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Sig") and line[6:7] == b":":
                    masks[line[:6]] = bool(int(line.split()[1], 16) >> (DUMP_SIGNAL - 1) & 1)
    except (OSError, ValueError):
        pass
    return masks


def silent_reason(pid: int, timeout: float) -> str:
    """Why ``pid``, sent the dump signal, wrote nothing within ``timeout`` (one line)."""
    from ._workers._proc import read_stat

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
    masks = _sigmasks(pid)
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


def registered(directory: str, pid: int) -> str | None:
    """``None`` if ``pid`` may be signalled, else why not (one line)."""
    try:
        with open(os.path.join(directory, f"{pid}.ok")) as f:
            started = f.read().strip()
    except OSError:
        return (
            "not registered for stack dumps (not a Python worker started by aiolaunch: "
            "run Python programs through `aiolaunch script.py` / `python -m aiolaunch._bootstrap`)"
        )
    if started and started != start_time(pid):
        return "not registered for stack dumps (its pid belongs to another process now)"
    masks = _sigmasks(pid)
    if masks.get(b"SigIgn"):
        return (
            f"ignores the dump signal ({DUMP_SIGNAL_NAME}): the program set SIG_IGN for it; "
            "leave that signal to aiolaunch"
        )
    if not masks.get(b"SigCgt"):
        return (
            f"no longer handles the dump signal ({DUMP_SIGNAL_NAME}): it exec'd another "
            "program, or reset the handler to SIG_DFL"
        )
    return None


async def _py_spy(pid: int, timeout: float) -> str | None:
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        proc = await asyncio.create_subprocess_exec(
            exe, "dump", "--pid", str(pid),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    except OSError:
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        proc.kill()
        await proc.wait()
        return None
    return f"(py-spy dump)\n{out.decode(errors='replace')}" if proc.returncode == 0 else None


async def dump_stacks(directory: str, pids: Mapping[int, int], timeout: float) -> dict[int, str]:
    """Signal every registered worker in ``pids`` (``{rank: pid}``) at once; collect.

    Returns ``{rank: text}`` for every rank: faulthandler's dump, or one line
    starting with ``<`` that says why there is none (unregistered, exited,
    no answer within ``timeout``).
    """
    out: dict[int, str] = {}
    offsets: dict[int, int] = {}
    for rank, pid in pids.items():
        why = registered(directory, pid)
        if why is not None:
            spy = await _py_spy(pid, timeout)
            out[rank] = spy if spy is not None else f"<pid {pid} {why}>"
            continue
        path = os.path.join(directory, f"{pid}.txt")
        try:
            offsets[rank] = os.stat(path).st_size
            os.kill(pid, DUMP_SIGNAL)
        except (OSError, ProcessLookupError):
            out[rank] = f"<pid {pid} has exited>"
    deadline = time.monotonic() + timeout
    sizes: dict[int, int] = {}
    pending = dict(offsets)
    while pending:
        # faulthandler writes the whole dump from its signal handler, usually in
        # well under a millisecond; a file that stopped growing and ends in a
        # newline is complete.
        await asyncio.sleep(0.005)  # allowed: no completion event exists for a dump
        for rank in list(pending):
            pid = pids[rank]
            size = _size(os.path.join(directory, f"{pid}.txt"))
            if size > pending[rank] and size == sizes.get(rank):
                text = _read_from(os.path.join(directory, f"{pid}.txt"), pending[rank])
                if text.endswith("\n"):
                    out[rank] = text
                    del pending[rank]
                    continue
            sizes[rank] = size
        if time.monotonic() > deadline:
            for rank in pending:
                pid = pids[rank]
                partial = _read_from(os.path.join(directory, f"{pid}.txt"), pending[rank])
                out[rank] = partial or silent_reason(pid, timeout)
            break
    return {rank: out[rank] for rank in sorted(out)}


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


# -- the verdict -------------------------------------------------------------

_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")
# py-spy's format: 'Thread 123 (idle): "MainThread"' then '    func (file.py:41)'
_SPY_THREAD = re.compile(r"^Thread (0x)?[0-9a-fA-F]+ .*:")
_SPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]+):(?P<line>\d+)\)$")
#: innermost frames of the main thread that identify "where a rank is"
_DEPTH = 3


def _main_thread_frames(text: str) -> list[tuple[str, str, str]]:
    """Frames (func, file basename, line) of the main thread, innermost first.

    CPython lists the newest thread first, so the main thread is the last
    block of a faulthandler dump; py-spy names it ``"MainThread"``.
    """
    blocks: list[list[tuple[str, str, str]]] = []
    main: list[tuple[str, str, str]] | None = None
    for line in text.splitlines():
        if _THREAD.match(line) or line.startswith("Stack (most recent call first)"):
            blocks.append([])
            continue
        if _SPY_THREAD.match(line):
            blocks.append([])
            if '"MainThread"' in line:
                main = blocks[-1]
            continue
        m = _FRAME.match(line) or _SPY_FRAME.match(line)
        if m:
            if not blocks:
                blocks.append([])
            blocks[-1].append((m["func"], os.path.basename(m["file"]), m["line"]))
    if main is not None:
        return main
    return blocks[-1] if blocks else []


def _where(frames: list[tuple[str, str, str]]) -> str:
    return " <- ".join(f"{func} ({file}:{line})" for func, file, line in frames[:_DEPTH])


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
    (file:line) <- caller (file:line)``), or the reason a rank has no dump.
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
        for rank in sorted(dumps):
            text = dumps[rank]
            frames = _main_thread_frames(text)
            if frames:
                where = _where(frames)
            else:
                first = text.strip().splitlines()[0] if text.strip() else "<empty dump>"
                where = first if first.startswith("<") else "<no Python frames>"
            by_where.setdefault(where, []).append(rank)
        groups = sorted(
            ((ranks, where) for where, ranks in by_where.items()), key=lambda g: (-len(g[0]), g[0])
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
