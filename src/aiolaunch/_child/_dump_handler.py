"""The worker side of stack dumps: two signal handlers (supervisor side: :mod:`.._stacks`).

Installed by every Python worker before its program starts (the function-worker
bootstrap and ``python -m aiolaunch._child._bootstrap``), so it imports only ``os``,
``sys`` and two C modules, ``_signal`` and ``faulthandler``: ``signal``'s enum
wrappers alone would add ~3 ms (enum, functools, collections) to a worker's
~26 ms start, and the process table module ``typing`` and ``re`` (~6 ms).

Two signals, because threads and asyncio tasks need different code:

- :data:`DUMP_SIGNAL` (SIGRTMIN+5): :mod:`faulthandler` writes every thread's
  Python stack to ``{dir}/{pid}.txt`` from inside the signal handler, in C:
  async-signal-safe, and it answers even when the main thread is stuck in C
  code or holds the GIL.
- :data:`TASKS_SIGNAL` (SIGRTMIN+7): a Python handler, so it runs in the main
  thread between two bytecodes. It appends where each task of the main
  thread's running asyncio loop awaits (its coroutine chain, innermost first,
  in faulthandler's line format) between :data:`TASKS_HEADER` and
  :data:`TASKS_END`. The supervisor sends it only when the thread dump shows
  the main thread idle in the loop's ``select()``: the signal interrupts that
  call, CPython runs the handler at once and resumes the wait.

Both handlers are installed with ``SA_RESTART`` (``siginterrupt(sig, False)``),
so periodic sampling never makes a restartable system call of the program or
of its C libraries fail with ``EINTR``. The marker ``{dir}/{pid}.ok``, holding
the process start time (a symbolic link: :func:`read_marker`), is made once
both are in place: the supervisor signals only a pid with a current marker
whose ``SigCgt`` shows the handler.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # `signal` without its enums (see above)
import os
import sys

__all__ = [
    "DUMP_SIGNAL",
    "STACKS_DIR_ENV",
    "TASKS_END",
    "TASKS_HEADER",
    "TASKS_SIGNAL",
    "register",
    "tasks_text",
]

_RTMIN: int = getattr(_signal, "SIGRTMIN", 34)
#: The signal of thread dumps (faulthandler; SIGRTMIN+5 on Linux: Slurm and
#: libkineto own SIGUSR1/2).
DUMP_SIGNAL: int = _RTMIN + 5
#: The signal of asyncio task dumps (a Python handler in the main thread;
#: SIGRTMIN+6 is ``aiolaunch attach``'s).
TASKS_SIGNAL: int = _RTMIN + 7
#: Environment variable naming the folder of dumps and markers.
STACKS_DIR_ENV = "AIOLAUNCH_STACKS_DIR"
#: The first line of an asyncio task dump, and its last.
TASKS_HEADER = "asyncio tasks of the main thread's event loop (most recent call first):"
TASKS_END = "(end of asyncio tasks)"
#: At most this many tasks, each at most this many coroutine frames deep: a
#: server's ten thousand connection tasks must not stall its main thread.
MAX_TASKS = 100
MAX_DEPTH = 50

_keep: list[object] = []  # the dump file: faulthandler only borrows its fd


_UNKNOWN = "unknown"


def read_marker(path: str) -> str:
    """The start time held by the marker at ``path`` (``""`` when not known).

    :raises OSError: no marker there.
    """
    try:
        started = os.readlink(path)
    except OSError as exc:
        if exc.errno != 22:  # EINVAL: a regular file (an older worker's marker)
            raise
        with open(path) as f:
            started = f.read().strip()
    return "" if started == _UNKNOWN else started


def register(directory: str | None = None) -> bool:
    """Install both dump handlers and write the marker; ``False`` if it can't.

    Called in the worker's main thread. ``directory`` defaults to
    ``$AIOLAUNCH_STACKS_DIR``; without either nothing happens. Never raises:
    a worker must start even where dumps are impossible.
    """
    directory = directory or os.environ.get(STACKS_DIR_ENV)
    if not directory:
        return False
    try:
        import faulthandler

        pid = os.getpid()
        path = os.path.join(directory, f"{pid}.txt")
        try:
            out = open(path, "ab", buffering=0)  # noqa: SIM115
        except FileNotFoundError:
            # The supervisor makes the folder as start_processes returns; a
            # worker can get here first.
            os.makedirs(directory, mode=0o700, exist_ok=True)
            out = open(path, "ab", buffering=0)  # noqa: SIM115
        faulthandler.register(DUMP_SIGNAL, file=out, all_threads=True, chain=False)
        _keep[:] = [out]
        _signal.signal(TASKS_SIGNAL, _on_tasks_signal)
        for sig in (DUMP_SIGNAL, TASKS_SIGNAL):
            _signal.siginterrupt(sig, False)  # SA_RESTART, handler kept
        marker = os.path.join(directory, f"{pid}.ok")
        try:
            from ._proc import start_time

            started = start_time()
        except (OSError, IndexError):  # no /proc: the pid alone identifies it
            started = ""
        # A symbolic link holds the start time: made without a write(), so
        # the worker's count of written bytes (wchar: its output age where
        # nothing reads its streams) stays its own program's.
        tmp = f"{marker}.{os.urandom(4).hex()}.tmp"
        os.symlink(started or _UNKNOWN, tmp)
        os.replace(tmp, marker)  # atomic: never a half-made marker
    except (OSError, ValueError, RuntimeError, AttributeError):
        return False
    return True


def _on_tasks_signal(signum: int, frame: object) -> None:
    # Runs between two bytecodes of whatever the main thread was doing: it
    # must never raise into the program, take a lock, or log.
    try:
        text = tasks_text()
    except Exception as exc:
        text = f"{TASKS_HEADER}\n<failed: {type(exc).__name__}>\n{TASKS_END}\n"
    if not _keep:
        return
    try:
        os.write(_keep[0].fileno(), text.encode("utf-8", "replace"))  # type: ignore[attr-defined]
    except (OSError, ValueError):
        pass


def tasks_text() -> str:
    """Where every task of the main thread's running asyncio loop awaits.

    Each task: ``Task 'name' (coroutine qualname):`` then its coroutine chain
    innermost first as ``  File "f", line n in func``, then ``  awaits T``
    (the type of the object the innermost coroutine waits on: ``Future``,
    ``_GatheringFuture``...). Between :data:`TASKS_HEADER` and
    :data:`TASKS_END`.
    """
    lines = [TASKS_HEADER]
    asyncio = sys.modules.get("asyncio")
    loop = None
    if asyncio is not None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # none in the main thread
            pass
    if asyncio is None or loop is None:
        lines.append("<no running event loop in the main thread>")
    else:
        tasks: list[object] = []
        for _ in range(3):  # the loop's task set may change under us: retry
            try:
                tasks = list(asyncio.all_tasks(loop))
                break
            except RuntimeError:
                continue
        tasks.sort(key=_task_order)
        for task in tasks[:MAX_TASKS]:
            lines += _task_lines(task)
        if len(tasks) > MAX_TASKS:
            lines.append(f"<{len(tasks) - MAX_TASKS} more tasks>")
    lines.append(TASKS_END)
    return "\n".join(lines) + "\n"


def _task_order(task: object) -> tuple[int, str]:
    # "Task-12" after "Task-2": creation order for default names.
    name = str(task.get_name())  # type: ignore[attr-defined]
    return (len(name), name)


def _task_lines(task: object) -> list[str]:
    coro = task.get_coro()  # type: ignore[attr-defined]
    qualname = getattr(coro, "__qualname__", type(coro).__name__)
    lines = [f"Task {task.get_name()!r} ({qualname}):"]  # type: ignore[attr-defined]
    frames: list[str] = []
    obj: object = coro
    for _ in range(MAX_DEPTH):
        frame = (
            getattr(obj, "cr_frame", None)
            or getattr(obj, "gi_frame", None)
            or getattr(obj, "ag_frame", None)
        )
        if frame is None:  # a Future (or another awaitable), or a finished coroutine
            break
        code = frame.f_code
        frames.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
        nxt = (
            getattr(obj, "cr_await", None)
            or getattr(obj, "gi_yieldfrom", None)
            or getattr(obj, "ag_await", None)
        )
        if nxt is None:
            obj = None
            break
        obj = nxt
    lines += reversed(frames)  # innermost first, like faulthandler
    if obj is not None and obj is not coro:
        kind = type(obj).__name__
        lines.append(f"  awaits {'Future' if kind == 'FutureIter' else kind}")
    return lines
