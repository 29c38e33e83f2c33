"""Code that runs *inside* a function worker, from bootstrap to exit.

Order matters and is part of the contract:

1. join a fresh process group (so ``close()`` reaches the worker's children);
2. arm parent-death protection: a thread blocks on a lifeline pipe whose only
   writer is the supervisor; its EOF (the supervisor died, even by SIGKILL)
   kills the worker's whole process group, grandchildren included;
3. point fd 1/2 at the supervisor's pipes (fd level: C extensions and
   subprocesses are captured too) and make ``sys.stdout`` line-buffered;
4. apply ``envs[rank]`` to ``os.environ``;
5. only then unpickle the entrypoint and its args, so import-time settings
   (``OMP_NUM_THREADS`` ...) take effect;
6. run it (``async def`` in a fresh event loop), send the return value on the
   result pipe at once, and exit - without waiting for the other ranks.

An exception is written to the error file (torch's JSON) and re-raised as
exit code 1 - unless the function wrote that file itself (``@record``, its
own data), which is then kept (:mod:`aiolaunch._child._uncaught`).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["ChildSpec", "PassFd", "run_worker"]

RESULT_TAG = b"R"
HEADER_SIZE = 9  # tag + 8-byte big-endian length


class PassFd:
    """An fd that travels to a multiprocessing child under any start method.

    Under ``fork`` the object is inherited as is (same fd number). Under
    ``spawn`` and ``forkserver`` it is pickled while multiprocessing is
    spawning, and registers the fd with the spawning ``Popen`` - the same
    mechanism multiprocessing uses for its own pipes.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from ._compat import dup_fd_for_child

        return (_rebuild_fd, (dup_fd_for_child(self.fd),))


def _rebuild_fd(dup: Any) -> PassFd:
    return PassFd(dup.detach())


class ChildSpec:
    """Everything a function worker needs, pickled with plain pickle."""

    def __init__(
        self,
        *,
        local_rank: int,
        fn: bytes,
        args: bytes,
        env: dict[str, str],
        stdout: PassFd | None,
        stderr: PassFd | None,
        result: PassFd,
        lifeline: PassFd | None,
        close_after_fork: tuple[int, ...],
        error_file: str,
        supervisor_pid: int,
        check_parent: bool,
    ) -> None:
        self.local_rank = local_rank
        self.fn = fn
        self.args = args
        self.env = env
        self.stdout = stdout
        self.stderr = stderr
        self.result = result
        self.lifeline = lifeline
        self.close_after_fork = close_after_fork
        self.error_file = error_file
        self.supervisor_pid = supervisor_pid
        self.check_parent = check_parent


def _watch_lifeline(fd: int) -> None:
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    # The supervisor is gone (even SIGKILLed): take the whole group down.
    os.killpg(0, signal.SIGKILL)


def _rebind_stdio(fd: int, name: str) -> None:
    stream = io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,  # one write() per line: lines of workers sharing a fd don't mix
    )
    setattr(sys, name, stream)
    setattr(sys, f"__{name}__", stream)


def _protect(spec: ChildSpec) -> None:
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    # Handlers inherited through fork (e.g. from a loop's add_signal_handler)
    # would make the worker deaf to the death signal.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # pragma: no cover - not main thread
        pass
    # No PR_SET_PDEATHSIG here: its SIGKILL would race the lifeline thread
    # and could kill the worker before it takes its own children down.
    if spec.check_parent and os.getppid() != spec.supervisor_pid:
        os._exit(1)  # the supervisor is already gone
    for fd in spec.close_after_fork:
        # The supervisor's ends of the lifeline and guardian pipes, inherited
        # through fork: holding them would keep those pipes from ever seeing EOF.
        try:
            os.close(fd)
        except OSError:
            pass
    if spec.lifeline is not None:
        threading.Thread(
            target=_watch_lifeline, args=(spec.lifeline.fd,), name="aiolaunch-lifeline", daemon=True
        ).start()


def _redirect(spec: ChildSpec) -> None:
    for passed, fd, name in ((spec.stdout, 1, "stdout"), (spec.stderr, 2, "stderr")):
        if passed is not None:
            try:
                getattr(sys, name).flush()
            except (AttributeError, OSError, ValueError):
                pass
            os.dup2(passed.fd, fd)
            os.close(passed.fd)
        _rebind_stdio(fd, name)
    # A fatal error's dump ("Fatal Python error: Segmentation fault" and the
    # stacks) belongs in the worker's stderr. faulthandler inherited through
    # fork writes to the fd the parent gave it (pytest: a copy of its
    # terminal, past any capture); point it at this worker's fd 2.
    faulthandler = sys.modules.get("faulthandler")
    if faulthandler is not None and faulthandler.is_enabled():
        try:
            faulthandler.enable(file=2, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass


def _send_result(fd: int, value: Any) -> None:
    import cloudpickle

    data = cloudpickle.dumps(value)
    header = RESULT_TAG + len(data).to_bytes(8, "big")
    with os.fdopen(fd, "wb", buffering=0) as f:
        view = memoryview(header + data)
        while view:
            n = f.write(view)
            assert n is not None
            view = view[n:]


def _reset_asyncio_after_fork() -> None:
    # Python < 3.12 leaves the parent's running loop set in a forked child.
    if "asyncio" in sys.modules:  # else importing _compat would import it
        from ._compat import clear_running_loop

        clear_running_loop()


def run_worker(spec: ChildSpec) -> None:
    """The multiprocessing target of every function worker."""
    _protect(spec)
    _redirect(spec)
    _reset_asyncio_after_fork()
    os.environ.update(spec.env)
    from ._attach import register as register_attach
    from ._dump_handler import register
    from ._record_server import watch

    register()  # stack dumps on request (before user code: a hang can come early)
    register_attach()  # `aiolaunch attach RANK`: pdb on request
    watch()  # collective records, once the entrypoint imports torch
    from ._uncaught import ErrorFileWatch

    error_file = ErrorFileWatch(spec.error_file)  # before the function can write it
    try:
        import cloudpickle

        fn = cloudpickle.loads(spec.fn)
        args = cloudpickle.loads(spec.args)
        try:
            value = fn(*args)
            import inspect

            if inspect.isawaitable(value):
                import asyncio

                async def _await(aw: Any) -> Any:
                    return await aw

                value = asyncio.run(_await(value))
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None
        try:
            _send_result(spec.result.fd, value)
        except Exception as exc:
            raise TypeError(
                f"the return value of local rank {spec.local_rank} "
                f"({type(value).__name__}) could not be pickled: {exc}"
            ) from exc
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback

        traceback.print_exc()
        error_file.record(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        raise SystemExit(code) from None
