"""Function workers: multiprocessing children with an exit event on the loop.

Exit detection: a pidfd (Linux >= 5.3) registered with ``loop.add_reader``,
else the process sentinel - no polling, no thread per worker. Under
``forkserver`` the sentinel is the forkserver's status socket, which carries
the exit code.

The return value travels on a dedicated pipe, length-prefixed, read as it
arrives (values of any size, no deadlock). At exit everything still buffered
is read synchronously, so the outcome is decided in the exit callback itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.process
import os
import signal
import warnings
from typing import Any

from .._child._function import HEADER_SIZE, RESULT_TAG, ChildSpec, PassFd, run_worker
from .._compat import forget_child, process_popen, spawn_without_main
from ._fds import close_fd, read_pipe_rest
from ._guardian import GUARDIAN_ENV, guardian
from ._handle import WorkerHandle
from ._lifeline import lifeline_fds
from ._processes import open_exit_fd

__all__ = ["FunctionWorker", "ResultReader", "settle_result", "spawn_function"]


class ResultReader(asyncio.Protocol):
    """Collects the worker's length-prefixed return record from the result pipe.

    Fd ownership: from ``connect_read_pipe`` on, the read end belongs to the
    transport alone. The transport closes it when it sees EOF (in
    ``connection_lost``, a loop iteration later) or on :meth:`close`, and the
    very next ``os.pipe()`` - another rank's blocking log pipe, whose write end
    the supervisor holds - may get the same number. So nothing here keeps the
    fd number: :meth:`read_rest` reads through the transport's own file object,
    and only while the transport is not closing (then it provably still holds
    the open fd). Once the transport is closing because of EOF, every byte was
    already delivered to :meth:`data_received`.
    """

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.ReadTransport | None = None
        #: the writer side reached EOF: ``buf`` holds everything ever written
        self.eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.ReadTransport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data

    def eof_received(self) -> bool | None:
        self.eof = True
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def read_rest(self) -> None:
        """Take what the kernel still buffers, without waiting (the writer exited).

        Every byte the worker wrote before exiting is in the pipe; a
        descendant that inherited the write end (``os.fork``) may keep it
        open, so this reads until the pipe is empty rather than until EOF.
        """
        if not self.eof and read_pipe_rest(self.transport, self.buf.extend):
            self.eof = True

    def record(self) -> bytes | None:
        if len(self.buf) < HEADER_SIZE or self.buf[:1] != RESULT_TAG:
            return None
        size = int.from_bytes(self.buf[1:HEADER_SIZE], "big")
        if len(self.buf) < HEADER_SIZE + size:
            return None
        return bytes(self.buf[HEADER_SIZE : HEADER_SIZE + size])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.buf = bytearray()


def settle_result(handle: WorkerHandle, reader: ResultReader | None, rc: int) -> None:
    """At a function worker's exit: its return value, or why a clean exit still failed.

    Reads what the result pipe still buffers, then closes ``reader``.
    """
    if reader is None:
        return
    reader.read_rest()
    data = reader.record()
    if data is not None:
        import cloudpickle

        try:
            handle.return_value = cloudpickle.loads(data)
        except Exception as exc:
            handle.fail(
                f"the return value of local rank {handle.local_rank} could not be "
                f"unpickled in the supervisor: {type(exc).__name__}: {exc}"
            )
    elif rc == 0:
        handle.fail(
            f"local rank {handle.local_rank} (pid {handle.pid}) exited with code 0 "
            "without returning from its function (os._exit(0) or a killed "
            "interpreter?)"
        )
    reader.close()


class FunctionWorker(WorkerHandle):
    records_exceptions = True

    def __init__(self, local_rank: int) -> None:
        super().__init__(local_rank)
        self.process: multiprocessing.process.BaseProcess | None = None
        # Fd owners: the exit fd is our pidfd (_own_exit_fd: closed in
        # release()) or the process sentinel (owned and closed by
        # self.process.close()); its reader is removed before either closes
        # it. The result pipe's read end is owned by _result's transport.
        self._exit_fd: int | None = None
        self._own_exit_fd = False
        self._result: ResultReader | None = None

    async def follow(
        self, proc: multiprocessing.process.BaseProcess, pipe: Any, *, forkserver: bool
    ) -> None:
        """Watch ``proc`` (just started) for its exit and ``pipe`` for its return value.

        ``pipe`` is the result pipe's read end (a binary file object); its
        transport owns it from here on (see :class:`ResultReader`).
        """
        loop = asyncio.get_running_loop()
        self.process = proc
        assert proc.pid is not None
        self.pid = proc.pid
        exit_fd = None
        if not forkserver:
            with contextlib.suppress(OSError):
                os.setpgid(proc.pid, proc.pid)  # closes the race with the child's own setpgid
            exit_fd = open_exit_fd(proc.pid)
        if exit_fd is None:
            self._exit_fd = proc.sentinel
        else:
            self._exit_fd, self._own_exit_fd = exit_fd, True
        reader = self._result = ResultReader()
        await loop.connect_read_pipe(lambda: reader, pipe)
        # Level-triggered: an exit that happened meanwhile is still reported.
        loop.add_reader(self._exit_fd, self._on_exit_readable)

    def _on_exit_readable(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._exit_fd is not None and self.process is not None
        loop.remove_reader(self._exit_fd)
        rc = process_popen(self.process).poll()
        if rc is None:  # pragma: no cover - pidfd readable means exited
            loop.add_reader(self._exit_fd, self._on_exit_readable)
            return
        settle_result(self, self._result, rc)
        self._result = None
        self.set_exited(rc)
        self.release()

    def release(self) -> None:
        if self._exit_fd is not None:
            if self.returncode is None:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(self._exit_fd)
            if self._own_exit_fd:
                close_fd(self._exit_fd)
            self._exit_fd = None
        if self.returncode is not None and self.process is not None:
            with contextlib.suppress(ValueError):
                self.process.close()
            self.process = None
        if self._result is not None and self.returncode is not None:
            self._result.close()
            self._result = None


def _supervisor_only_fds(lifeline_r: int) -> tuple[int, ...]:
    """What a child forked from the supervisor closes at once: every fd this
    process keeps for its lifetime but the lifeline's read end (the child's)."""
    from . import long_lived_helpers

    return tuple(sorted(long_lived_helpers()[1] - {lifeline_r}))


async def spawn_function(
    *,
    local_rank: int,
    name: str,
    start_method: str,
    fn: bytes,
    args: bytes,
    env: dict[str, str],
    stdout: int | None,
    stderr: int | None,
    error_file: str,
) -> FunctionWorker:
    """Start one function worker with multiprocessing.

    ``stdout``/``stderr`` are fds the child's fd 1/2 become (the caller keeps
    and closes its copies) or ``None`` to inherit the supervisor's. (Forked
    from a zygote instead: :func:`._forks.fork_function`.)
    """
    handle = FunctionWorker(local_rank)
    g = guardian()
    if g is not None:
        # The lifeline kills the worker's group; the guardian's token also
        # reaches descendants that left it (setsid) if the supervisor dies.
        env = {**env, GUARDIAN_ENV: g.token}
    lifeline_r = lifeline_fds()[0]
    # Failure cleanup (trio's _open_process): always_cleanup runs in any case,
    # cleanup_on_fail only if we never hand the worker over; pop_all() hands it.
    with contextlib.ExitStack() as always_cleanup, contextlib.ExitStack() as cleanup_on_fail:
        result_r, result_w = os.pipe()
        always_cleanup.callback(close_fd, result_w)  # the child holds its own copy
        pipe = os.fdopen(result_r, "rb", buffering=0)
        cleanup_on_fail.callback(pipe.close)
        spec = ChildSpec(
            local_rank=local_rank,
            fn=fn,
            args=args,
            env=env,
            stdout=PassFd(stdout) if stdout is not None else None,
            stderr=PassFd(stderr) if stderr is not None else None,
            result=PassFd(result_w),
            lifeline=PassFd(lifeline_r),
            close_after_fork=_supervisor_only_fds(lifeline_r) if start_method == "fork" else (),
            error_file=error_file,
            supervisor_pid=os.getpid(),
            check_parent=start_method != "forkserver",
        )
        mp = multiprocessing.get_context(start_method)
        proc = mp.Process(  # type: ignore[attr-defined]
            target=run_worker, args=(spec,), name=f"{name}{local_rank}"
        )
        with spawn_without_main(), warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a process with threads (ours:
            # the log and console writers). The user asked for fork; a warning
            # turned into an error here would orphan the forked child.
            warnings.filterwarnings("ignore", r".*multi-threaded.*fork", DeprecationWarning)
            proc.start()
        always_cleanup.close()  # the child has its copy of result_w: ours goes now
        # Not yet handed to the context: nobody else would stop it.
        cleanup_on_fail.callback(_kill_unhanded, proc, handle)
        # We reap our workers ourselves; multiprocessing must neither reap them
        # in its _cleanup() nor join them at interpreter exit.
        forget_child(proc)
        await handle.follow(proc, pipe, forkserver=start_method == "forkserver")
        cleanup_on_fail.pop_all()
    return handle


def _kill_unhanded(proc: multiprocessing.process.BaseProcess, handle: FunctionWorker) -> None:
    assert proc.pid is not None
    with contextlib.suppress(OSError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    handle.release()
