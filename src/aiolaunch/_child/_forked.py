"""Inside a worker forked from the zygote: become what a fresh start would have made.

:func:`become` runs in the child right after the fork and returns the job the
zygote's ``main()`` then runs at the top of its stack, so the worker ends the
way an interpreter ends (``SystemExit`` -> atexit handlers, stdio flushed,
the exit status). What a spawned worker gets from ``exec`` and interpreter
start-up, a forked one gets here, in this order:

1. its own session (script and store jobs, as ``start_new_session=True``)
   or process group (function jobs: :func:`._child.run_worker` makes it);
2. signal dispositions: the zygote's, with the signals the supervisor
   ignores now ignored (as ``exec`` keeps ``SIG_IGN``), the others as
   Python's start-up leaves them;
3. its environment, replaced whole (``os.environ`` and the C ``environ``),
   and the supervisor's current folder;
4. fds 0/1/2 from the request (log files, pipes, or the supervisor's own),
   and ``sys.stdin``/``stdout``/``stderr`` built as CPython builds them
   (``-u``: unbuffered, write-through);
5. fresh per-process state: the garbage collector on, numpy's global random
   state and torch's default (CPU) generator reseeded from the OS (``random``
   reseeds itself at fork), a new multiprocessing authkey;
6. its command line and environment as ``ps`` and ``/proc/<pid>/environ``
   show them: the worker's own (:mod:`._cmdline`);
7. ``sys.argv``, ``sys.orig_argv``, ``sys.path[0]`` and ``__main__`` as
   ``python [-u] -m aiolaunch._child._bootstrap script.py ARGS`` would set them
   (:func:`aiolaunch._child._bootstrap.main`).

Differences that remain (documented in README "Warm start"): ``str`` hashes
use the zygote's seed (as with ``PYTHONHASHSEED`` fixed), modules the zygote
imported are already in ``sys.modules``, and the worker holds one more fd
(the zygote's status socket, close-on-exec) through which it reports its
exit status, in case the zygote is gone by then.
"""

from __future__ import annotations

import gc
import io
import os
import signal
import struct
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from ._cmdline import show
from ._wire import Fork, FunctionJob, ScriptJob, StoreJob

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["STATUS", "ChildContext", "become"]

#: a self-reported exit: (pid, exit code as waitstatus_to_exitcode gives it)
STATUS = struct.Struct("!ii")

_SKIP = {signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ}


class ChildContext:
    """What the zygote hands to each forked child."""

    def __init__(self, *, status_fd: int, lifeline_fd: int, signals: dict[int, Any]) -> None:
        self.status_fd = status_fd
        self.lifeline_fd = lifeline_fd
        self.signals = signals


def become(req: Fork, fds: list[int], ctx: ChildContext) -> Callable[[], None]:
    """Set this freshly forked process up as ``req`` asks; return its job."""
    got = dict(zip(req.fds, fds, strict=True))
    job = req.job
    try:
        if not isinstance(job, FunctionJob):
            os.setsid()
        _signals(ctx.signals, set(req.ignored))
        os.environ.clear()
        os.environ.update(req.env)
        os.chdir(req.cwd)
        _std_fds(got)
        for name in ("result", "listen", "stop"):
            if name in got:
                os.set_inheritable(got[name], False)  # ours, not for what the worker execs
        _fresh_state(job.process_name if isinstance(job, FunctionJob) else None)
        if not isinstance(job, StoreJob):
            show(job.orig_argv, req.env)  # ps, pgrep -f, /proc/<pid>/environ
    except BaseException as exc:
        os.write(2, f"aiolaunch: the forked worker could not start: {exc!r}\n".encode())
        os._exit(127)
    if isinstance(job, ScriptJob):
        os.close(ctx.lifeline_fd)
        return lambda: _run_script(job, ctx)
    if isinstance(job, FunctionJob):
        return lambda: _run_function(job, req.env, got, ctx)
    os.close(ctx.lifeline_fd)
    return lambda: _run_store(job, got)


def _signals(zygote: dict[int, Any], ignored: set[int]) -> None:
    for sig, handler in zygote.items():
        if sig in _SKIP:
            continue  # Python ignores SIGPIPE and SIGXFSZ at start-up, as the zygote did
        if sig in ignored:
            want: Any = signal.SIG_IGN
        elif handler is signal.SIG_IGN:  # the zygote's, not the supervisor's now
            want = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        else:
            want = handler
        if want is not handler:
            try:
                signal.signal(sig, want)
            except (OSError, ValueError):  # pragma: no cover
                pass


def _std_fds(got: dict[str, int]) -> None:
    import fcntl

    for name in ("stdin", "stdout", "stderr"):
        if name in got and got[name] < 3:  # (the zygote had no fd 0/1/2): out of the way
            got[name] = fcntl.fcntl(got[name], fcntl.F_DUPFD_CLOEXEC, 3)
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        src = got.get(name)
        if src is None:
            try:
                os.close(fd)  # the supervisor has none: neither does the worker
            except OSError:
                pass
        elif src != fd:
            os.dup2(src, fd)  # not inheritable-cleared: dup2 gives a plain fd
            os.close(src)


def _fresh_state(process_name: str | None) -> None:
    gc.enable()
    # Global generators a spawned worker seeds from the OS at import (``random``
    # reseeds itself at fork); torch's CUDA generators start from a fixed seed
    # in every process, so they are left alone, as torch.seed() would not.
    nprandom = sys.modules.get("numpy.random")
    if nprandom is not None:
        nprandom.seed()
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        generator.seed()  # torch.initial_seed(), unseeded torch.rand, samplers' seeds
    import multiprocessing.process as mpp

    me = mpp.current_process()
    me.authkey = os.urandom(32)
    if process_name is not None:
        me.name = process_name


def _stdio(unbuffered: bool) -> None:
    """``sys.stdin/stdout/stderr`` over fds 0/1/2, as CPython's start-up makes them."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, f"__{name}__", None)
        try:
            os.fstat(fd)
        except OSError:
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)
            continue
        write = fd != 0
        raw_buffered = not (unbuffered and write)
        buf: Any = open(  # noqa: SIM115 - the stream owns it, as sys.stdout does
            fd, "wb" if write else "rb", -1 if raw_buffered else 0, closefd=False
        )
        raw = buf.raw if raw_buffered else buf
        raw.name = f"<{name}>"
        line_buffering = raw_buffered and write and (raw.isatty() or fd == 2)
        stream = io.TextIOWrapper(
            buf,
            encoding=getattr(old, "encoding", None) or "utf-8",
            errors=getattr(old, "errors", None) or ("backslashreplace" if fd == 2 else "strict"),
            newline="\n",
            line_buffering=line_buffering,
            write_through=not raw_buffered,
        )
        stream.mode = "w" if write else "r"  # type: ignore[misc]
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _report(ctx_fd: int, code: int) -> None:
    try:
        os.write(ctx_fd, STATUS.pack(os.getpid(), code))
    except OSError:
        pass  # the zygote's socket is gone: the zygote reports instead


def _exit_code(exc: SystemExit) -> int:
    """The status ``python`` exits with for ``exc`` (printing a non-int code, as it does)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        if sys.stderr is not None:
            sys.stderr.write(f"{code}\n")
    except Exception:
        pass
    return 1


def _end(status_fd: int, code: int, inherited: list[Any]) -> NoReturn:
    """End the worker as the interpreter would, minus the teardown of every module.

    Non-daemon threads are joined and ``atexit`` callbacks run (not the
    ``weakref.finalize`` callbacks the zygote made: torch's 174
    ``_del_library`` took 30 ms in a forked worker); then ``__main__`` is
    cleared, so the program's objects are finalized by reference counting
    (files flushed and closed); then every file still open is flushed
    (:func:`_flush_files`: a helper module's, one an object or a cycle
    holds; where the process writes to a file or pipe at all), and stdio (a
    failure there gives status 120, as in CPython).

    Unless a thread that Python did not start is still running (gloo's, an
    OpenMP pool's): then ``__main__`` is not cleared - every open file is
    flushed and nothing is destroyed. A destructor may join such a thread with the GIL held while
    the thread waits for the GIL - torch's DDP does, now and then: the
    Reducer's dealloc destroys a ProcessGroupGloo, which joins its threads
    while one drops a finished work's tensors (pytorch#56297). The
    interpreter avoids the hang by ending any thread that asks for the GIL
    once its exit has begun, but such a thread unwinds through C++
    destructors and aborts the process ("terminate called without an active
    exception"). Measured on a two-rank restart job on a loaded machine:
    clearing ``__main__`` hung 2 runs in 38; clearing it once the
    interpreter's exit had begun ended 2 in 88 by SIGABRT; this, 0 in 240.

    The interpreter would also tear down every other module and collect the
    garbage cycles left: the teardown copies every page the worker shares
    with the zygote (0.2-0.5 s for torch), and the final collection walks
    every object the worker made (60-120 ms after DDP imported
    torch._dynamo in the worker), both on the path of every restart;
    CPython does not promise that objects still alive at exit - cycles
    included - are finalized.
    """
    from ._compat import exit_steps

    for fin in inherited:
        fin.atexit = False  # the zygote's state: it goes with the process, as its modules
    try:
        exit_steps()
    except BaseException:
        import traceback

        traceback.print_exc()  # the interpreter prints a raising atexit callback too
    main = sys.modules.get("__main__")
    d = getattr(main, "__dict__", None)
    if isinstance(d, dict) and not _foreign_threads():
        for first in (True, False):  # CPython: _names first, then the rest
            for key in list(d):
                if key != "__builtins__" and key.startswith("_") == first:
                    d[key] = None
    if _writing_elsewhere():
        _flush_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            code = 120
    _report(status_fd, code)
    os._exit(code)


def _foreign_threads() -> bool:
    """Whether a thread that Python did not start runs in this process (Linux)."""
    import threading

    from ._proc import thread_ids

    tids = thread_ids()
    if tids is None:  # pragma: no cover - no procfs: assume the worst
        return True
    # The main thread's native_id is the zygote's (set before the fork).
    me = threading.current_thread()
    known = {threading.get_native_id()}
    known.update(t.native_id for t in threading.enumerate() if t is not me and t.native_id)
    return bool(tids - known)


def _writing_elsewhere() -> bool:
    """Whether a file object of this process may hold data its fd has not seen.

    That is: whether it holds a file, a pipe or a terminal open for writing
    besides its stdio - not the write end of a pipe whose read end it holds
    too (a thread pool's wake-up pipe: gloo's), not its stack-dump file
    (written unbuffered) - or cannot tell. A few system calls per fd: a
    worker that writes nowhere else (the common restart: gloo's sockets, its
    log files as fds 1 and 2) skips the walk of its objects, tens of
    milliseconds once it made a hundred thousand of them (torch._dynamo
    imported in the worker). Sockets do not count: a file object over one
    (``socket.makefile``) is flushed only along with others.
    """
    import fcntl
    import stat

    from ._dump_handler import STACKS_DIR_ENV
    from ._proc import fd_target, open_fds

    dumps = os.path.join(os.environ.get(STACKS_DIR_ENV) or "\0", "")
    pipes: dict[tuple[int, int], set[int]] = {}  # pipe -> the access modes of our ends
    for fd in open_fds():
        if fd <= 2:
            continue
        try:
            st = os.fstat(fd)
            access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        except OSError:
            continue  # closed meanwhile (or the listing's own fd)
        if stat.S_ISFIFO(st.st_mode):
            pipes.setdefault((st.st_dev, st.st_ino), set()).add(access)
            continue
        if access == os.O_RDONLY:
            continue
        if stat.S_ISCHR(st.st_mode) and os.isatty(fd):
            return True
        if stat.S_ISREG(st.st_mode):
            path = fd_target(fd)
            if path is None or not path.startswith(dumps):
                return True
    return any(os.O_RDONLY not in modes for modes in pipes.values())


def _flush_files() -> None:
    """Flush every file object still open, destroying nothing.

    What the interpreter's exit would flush as it tears the modules down and
    collects the cycles left: files held by a helper module, by an object or
    a dict, in a cycle. Found among the objects the worker made (the
    zygote's are frozen: ``gc.get_objects`` does not walk them), by type
    first (a few hundred types, not every object, go through ``io.IOBase``'s
    check). An error is ignored, as the interpreter ignores one in a file's
    finalizer; stdio is left to the caller.
    """
    import itertools

    objects = gc.get_objects()
    kinds = {t for t in set(map(type, objects)) if issubclass(t, io.IOBase)}
    stdio = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for f in itertools.compress(objects, map(kinds.__contains__, map(type, objects))):
        if any(f is s for s in stdio):
            continue
        try:
            if not f.closed:
                f.flush()
        except Exception:  # ignored, as by a file's finalizer at exit
            pass


def _inherited() -> list[Any]:
    """The ``weakref.finalize`` objects the worker got from the zygote."""
    from ._compat import exit_finalizers

    return exit_finalizers()


def _run_script(job: ScriptJob, ctx: ChildContext) -> None:
    from . import _bootstrap

    inherited = _inherited()
    _stdio(job.unbuffered)
    sys.orig_argv = list(job.orig_argv)
    if sys.path:
        sys.path[0] = os.getcwd()  # `python -m`; the bootstrap puts a script's folder there
    try:
        _bootstrap.main(list(job.argv), dumps=job.bootstrap)
    except SystemExit as exc:
        _end(ctx.status_fd, _exit_code(exc), inherited)
    except KeyboardInterrupt:
        _report(ctx.status_fd, -signal.SIGINT)  # the interpreter dies by SIGINT
        raise


def _run_function(
    job: FunctionJob, env: dict[str, str], got: dict[str, int], ctx: ChildContext
) -> None:
    from ._function import ChildSpec, PassFd, run_worker

    sys.argv = list(job.sys_argv)
    sys.path[:] = list(job.sys_path)
    _stdio(False)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - as multiprocessing's children
    spec = ChildSpec(
        local_rank=job.rank,
        fn=job.fn,
        args=job.args,
        env=env,
        stdout=None,
        stderr=None,
        result=PassFd(got["result"]),
        lifeline=PassFd(ctx.lifeline_fd),
        close_after_fork=(),
        error_file=job.error_file,
        supervisor_pid=job.supervisor_pid,
        check_parent=False,
    )
    inherited = _inherited()
    try:
        run_worker(spec)
    except SystemExit as exc:
        _end(ctx.status_fd, _exit_code(exc), inherited)
    _end(ctx.status_fd, 0, inherited)


def _run_store(job: StoreJob, got: dict[str, int]) -> None:
    """Host the attempt's TCPStore on the supervisor's listening socket until told to stop."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        job.host,
        job.port,
        None,
        True,
        timeout=timedelta(seconds=job.timeout),
        wait_for_workers=False,
        master_listen_fd=got["listen"],
        use_libuv=True,
    )
    stop = got["stop"]
    try:
        while os.read(stop, 1):
            pass
    finally:
        del store
        os._exit(0)  # the supervisor closed its end (the attempt is over) or died
