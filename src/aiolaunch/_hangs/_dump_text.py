"""Reading a stack dump: threads, the main thread, asyncio tasks, "where" a rank is.

Pure functions on the text of one dump (:func:`aiolaunch._hangs._stacks.dump_stacks`):
faulthandler's format (every thread, the newest first, so the main thread is
the last block), optionally followed by the asyncio task section the worker's
Python handler appends (:data:`TASKS_HEADER` ... :data:`TASKS_END`, same line
format), or py-spy's format for workers that did not register. Used by the
verdict (:class:`aiolaunch.StackReport`), the stall rule (:func:`signature`:
did the stack move?) and the straggler statistic (:func:`frames_waiting`).
"""

from __future__ import annotations

import os
import re

from .._child._dump_handler import TASKS_END, TASKS_HEADER

__all__ = [
    "DEPTH",
    "Frame",
    "idle_in_event_loop",
    "idle_loop_text",
    "main_block",
    "main_frames",
    "rank_where",
    "signature",
    "split_tasks",
    "task_stacks",
    "where",
]

#: ``(function, file path, line)``; ``line`` is a string (``"???"`` when unknown)
Frame = tuple[str, str, str]

_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")
# py-spy's format: 'Thread 123 (idle): "MainThread"' then '    func (file.py:41)'
_SPY_THREAD = re.compile(r"^Thread (0x)?[0-9a-fA-F]+ .*:")
_SPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]+):(?P<line>\d+)\)$")
#: innermost frames that identify "where a rank is"
DEPTH = 3


def split_tasks(text: str) -> tuple[str, str | None]:
    """``(threads, tasks)``: the thread dump, and the last *complete* asyncio
    task section (``None`` when there is none)."""
    start = text.rfind(TASKS_HEADER)
    if start < 0:
        return text, None
    end = text.find(TASKS_END, start)
    threads = text[:start]
    if end < 0:  # cut short: an earlier complete one may still be there
        prev, tasks = split_tasks(threads)
        return prev + text[start:], tasks
    return threads + text[end + len(TASKS_END) :], text[start + len(TASKS_HEADER) : end]


def _blocks(text: str) -> tuple[list[list[Frame]], list[Frame] | None]:
    blocks: list[list[Frame]] = []
    main: list[Frame] | None = None
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
            blocks[-1].append((m["func"], m["file"], m["line"]))
    return blocks, main


def main_frames(text: str) -> list[Frame]:
    """Frames of the main thread, innermost first (``[]`` if none).

    CPython lists the newest thread first, so the main thread is the last
    block of a faulthandler dump; py-spy names it ``"MainThread"``.
    """
    blocks, main = _blocks(split_tasks(text)[0])
    if main is not None:
        return main
    return blocks[-1] if blocks else []


def task_stacks(tasks: str) -> list[tuple[str, list[Frame]]]:
    """``[(task line, frames innermost first), ...]`` of a task section."""
    out: list[tuple[str, list[Frame]]] = []
    for line in tasks.splitlines():
        if line.startswith("Task "):
            out.append((line.rstrip(":"), []))
            continue
        m = _FRAME.match(line)
        if m and out:
            out[-1][1].append((m["func"], m["file"], m["line"]))
    return out


def idle_in_event_loop(frames: list[Frame]) -> bool:
    """Whether these main-thread frames wait in an asyncio loop's ``select()``
    (the loop is idle: every task is suspended at an ``await``)."""
    return (
        len(frames) >= 2
        and os.path.basename(frames[0][1]) == "selectors.py"
        and frames[1][0] == "_run_once"
        and os.path.basename(frames[1][1]) == "base_events.py"
    )


def where(frames: list[Frame], depth: int = DEPTH) -> str:
    """``func (file:line) <- caller (file:line)``: the innermost ``depth`` frames."""
    return " <- ".join(
        f"{func} ({os.path.basename(file)}:{line})" for func, file, line in frames[:depth]
    )


def rank_where(text: str) -> tuple[str, str]:
    """Where a rank is, as :class:`StackReport` groups ranks: ``(key, where)``.

    ``where`` names the main thread's innermost frames; when it is idle in an
    asyncio event loop and the dump has the loop's tasks, the deepest task's
    await chain instead (``task: load_batch (data.py:41) <- step
    (train.py:9)``), since every asyncio rank's main thread waits in the same
    ``select()``. A dump without frames gives its first line (``<pid ...
    not registered ...>``). ``key`` is ``where`` without the innermost
    frame's line: ranks spinning in one loop, each at another of its lines,
    are in one place (the call sites above it keep their lines).
    """
    threads, tasks = split_tasks(text)
    blocks, main = _blocks(threads)
    frames = main if main is not None else (blocks[-1] if blocks else [])
    if tasks is not None and idle_in_event_loop(frames):
        stacks = [s for s in task_stacks(tasks) if s[1]]
        if stacks:
            deepest = max(stacks, key=lambda s: len(s[1]))  # the first of the deepest
            more = f" (+{len(stacks) - 1} more tasks)" if len(stacks) > 1 else ""
            return f"task: {_key(deepest[1])}{more}", f"task: {where(deepest[1])}{more}"
    if frames:
        return _key(frames), where(frames)
    first = text.strip().splitlines()[0] if text.strip() else "<empty dump>"
    line = first if first.startswith("<") else "<no Python frames>"
    return line, line


def _key(frames: list[Frame]) -> str:
    func, file, _ = frames[0]
    return where([(func, file, "*"), *frames[1:]])


def main_block(threads: str) -> str:
    """The frame lines of a faulthandler dump's last thread block (the main
    thread), without its header, which only says which thread happened to
    take the signal. String slicing, no parse: sampling reads every rank's
    dump each period."""
    cut = max(threads.rfind("\nThread 0x"), threads.rfind("\nCurrent thread 0x"))
    block = threads[cut + 1 :] if cut >= 0 else threads
    return block.split("\n", 1)[1].strip() if "\n" in block else ""


def idle_loop_text(text: str) -> bool:
    """:func:`idle_in_event_loop` on a faulthandler dump's text, without a parse."""
    lines = main_block(split_tasks(text)[0]).split("\n", 2)
    return (
        len(lines) >= 2
        and lines[0].lstrip().startswith('File "')
        and os.path.basename(lines[0].split('"')[1]) == "selectors.py"
        and lines[1].endswith(" in _run_once")
        and 'base_events.py"' in lines[1]
    )


def signature(text: str) -> str | None:
    """What must stay equal for "the stack did not move": the main thread's
    frames (every one, the innermost with its current line) and the task
    section.

    ``None`` for a dump without frames, and while the main thread imports: a
    long call into C there (loading a big extension such as torch's, seconds
    on a loaded host) would look like a spin; a hung import is idle, caught
    by the CPU rule.
    """
    threads, tasks = split_tasks(text)
    body = main_block(threads)
    if not body and not tasks:
        return None
    if (
        "importlib._bootstrap" in body.split("\n", 1)[0]
        or "importlib/_bootstrap" in (body.split("\n", 1)[0])
    ):
        return None
    if tasks:
        body += "\n" + tasks.strip()  # tasks come and go: that moves too
    return body
