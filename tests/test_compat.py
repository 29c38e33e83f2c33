"""Each CPython-private access of ``aiolaunch._compat`` and
``aiolaunch._signals._compat`` still works on this Python.

Real processes, pipes and loops: a failure here means a CPython change broke
one accessor, and says which.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from _helpers import driver
from aiolaunch import _compat
from aiolaunch._child import _compat as _child_compat
from aiolaunch._signals import _compat as _compat_signals

if TYPE_CHECKING:
    from collections.abc import Callable

SRC = str(Path(__file__).resolve().parents[1] / "src")


async def _until(ready: Callable[[], object], timeout: float = 10.0) -> None:
    """Let the loop run until ``ready()`` (a signal's callback ran), at most ``timeout`` s."""
    for _ in range(int(timeout / 0.01)):
        if ready():
            return
        await asyncio.sleep(0.01)


def _spawn_ctx() -> multiprocessing.context.SpawnContext:
    return multiprocessing.get_context("spawn")


def test_process_popen_polls_and_reaps_a_started_process() -> None:
    proc = _spawn_ctx().Process(target=os.getpid)
    proc.start()
    try:
        popen = _compat.process_popen(proc)
        # Wait until it is a zombie (a pidfd turns readable), as the supervisor
        # does before it polls; the sentinel closes slightly earlier.
        pidfd = os.pidfd_open(proc.pid)  # type: ignore[arg-type]
        try:
            assert select.select([pidfd], [], [], 60)[0], "the child did not exit"
        finally:
            os.close(pidfd)
        assert popen.poll() == 0
    finally:
        proc.join(60)
    assert proc.exitcode == 0


def test_forget_child_takes_it_out_of_multiprocessing_bookkeeping() -> None:
    proc = _spawn_ctx().Process(target=os.getpid)
    proc.start()
    try:
        assert proc in multiprocessing.active_children()
        _compat.forget_child(proc)
        assert proc not in multiprocessing.active_children()
    finally:
        proc.join(60)  # we reap it ourselves, as the supervisor does
    assert proc.exitcode == 0


def test_dup_fd_for_child_passes_a_pipe_to_a_spawned_child(tmp_path: Path) -> None:
    (tmp_path / "passfd_helper.py").write_text(
        textwrap.dedent(
            """
            import os
            from aiolaunch._child._compat import dup_fd_for_child

            class Passed:
                def __init__(self, fd):
                    self.fd = fd
                def __reduce__(self):
                    return (_rebuild, (dup_fd_for_child(self.fd),))

            def _rebuild(dup):
                return dup.detach()

            def write(fd):
                os.write(fd, b"through the passed fd")
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import passfd_helper  # type: ignore[import-not-found]

        r, w = os.pipe()
        proc = _spawn_ctx().Process(target=passfd_helper.write, args=(passfd_helper.Passed(w),))
        try:
            proc.start()
        finally:
            os.close(w)
        try:
            with os.fdopen(r, "rb") as f:
                assert f.read() == b"through the passed fd"
        finally:
            proc.join(60)
        assert proc.exitcode == 0
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("passfd_helper", None)


def test_dup_fd_for_child_refuses_outside_a_spawn() -> None:
    with pytest.raises(RuntimeError, match="while spawning"):
        _child_compat.dup_fd_for_child(0)


_DRIVER = """
import concurrent.futures, multiprocessing, os, sys, threading
from aiolaunch._compat import spawn_without_main

MARKS = {marks!r}
if __name__ == "__mp_main__":  # a spawned child re-imported this __main__
    with open(MARKS, "a") as f:
        f.write(f"{{os.getpid()}}\\n")


def task():  # reachable by a child only through the re-imported __main__
    return "ran in a child of the user's pool"


if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    inside, done = threading.Event(), threading.Event()
    own = []

    def hold():
        with spawn_without_main():
            inside.set()
            done.wait(120)
            proc = ctx.Process(target=os.getpid)  # our spawn: no __main__ re-import
            proc.start()
            proc.join(120)
            own.append(proc.exitcode)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(120)
    # The user's pool spawns while another thread is inside spawn_without_main().
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        print(pool.submit(task).result(timeout=120))
    done.set()
    t.join(120)
    print("own exit", own)
"""


def test_spawn_without_main_leaves_other_threads_spawns_alone(tmp_path: Path) -> None:
    marks = tmp_path / "reimports"
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER.format(marks=str(marks)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, str(driver)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "ran in a child of the user's pool" in out.stdout
    assert "own exit [0]" in out.stdout
    # Exactly the pool's one worker re-imported __main__; our own spawn did not.
    assert len(marks.read_text().split()) == 1


def test_spawn_without_main_strips_main_only_in_this_thread() -> None:
    import multiprocessing.spawn

    with _compat.spawn_without_main():
        inside = multiprocessing.spawn.get_preparation_data("x")
        seen: list[dict[str, object]] = []
        other = threading.Thread(
            target=lambda: seen.append(multiprocessing.spawn.get_preparation_data("x"))
        )
        other.start()
        other.join(30)
    after = multiprocessing.spawn.get_preparation_data("x")
    main_keys = {"init_main_from_name", "init_main_from_path"}
    if not main_keys & set(after):
        pytest.skip("this interpreter's __main__ is not importable: nothing to strip")
    assert not main_keys & set(inside)
    assert main_keys & set(seen[0])  # another thread, at the same moment


def test_multiprocessing_helpers_reports_the_resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    pids, fds = _compat.multiprocessing_helpers()
    tracker_pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    assert tracker_pid in pids
    assert all(os.fstat(fd) for fd in fds)


def test_clear_running_loop_in_a_forked_child() -> None:
    async def fork_and_check() -> int:
        with warnings.catch_warnings():
            # 3.12+: fork() in a process with threads (the test runner's).
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child inherits the running loop before 3.12
            code = 0
            try:
                _child_compat.clear_running_loop()
                asyncio.get_running_loop()
                code = 3  # still "running"
            except RuntimeError:
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    assert asyncio.run(fork_and_check()) == 0


async def test_loop_signal_handler_round_trip() -> None:
    loop = asyncio.get_running_loop()
    got: list[str] = []
    loop.add_signal_handler(signal.SIGUSR1, got.append, "handled")
    try:
        handle = _compat_signals.loop_signal_handler(loop, signal.SIGUSR1)
        assert handle is not None
        loop.remove_signal_handler(signal.SIGUSR1)
        assert _compat_signals.loop_signal_handler(loop, signal.SIGUSR1) is None
        assert _compat_signals.reinstall_loop_signal_handler(loop, signal.SIGUSR1, handle)
        assert _compat_signals.call_handle_soon(loop, handle)
        await asyncio.sleep(0)
        assert got == ["handled"]
        os.kill(os.getpid(), signal.SIGUSR1)  # the reinstalled handler runs on a real signal
        await _until(lambda: len(got) == 2)
        assert got == ["handled", "handled"]
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)


_RUNNER = """
import asyncio, signal
from aiolaunch._signals._compat import is_asyncio_run_sigint_handler, is_default_handler

async def main():
    h = signal.getsignal(signal.SIGINT)
    return is_asyncio_run_sigint_handler(h), is_default_handler(h)

print(*asyncio.run(main()))
"""


def test_asyncio_run_sigint_handler_is_recognised() -> None:
    # asyncio.run() installs its own SIGINT handler on 3.11+ (none before).
    with driver([sys.executable, "-c", _RUNNER]) as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    runner = sys.version_info >= (3, 11)
    assert out.split() == [str(runner), "True"]


def test_default_handlers() -> None:
    assert _compat_signals.is_default_handler(signal.SIG_DFL)
    assert _compat_signals.is_default_handler(None)
    assert _compat_signals.is_default_handler(signal.default_int_handler)
    assert not _compat_signals.is_default_handler(signal.SIG_IGN)
    assert not _compat_signals.is_default_handler(lambda s, f: None)
    assert not _compat_signals.is_asyncio_run_sigint_handler(signal.default_int_handler)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is 3.11+")
async def test_task_cancelling_counts_pending_cancellations() -> None:
    seen: list[int] = []
    started = asyncio.Event()

    async def victim() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(_compat.task_cancelling(asyncio.current_task()))
            raise

    task = asyncio.ensure_future(victim())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [1]
    assert _compat.task_cancelling(None) == 0


def test_environ_data_follows_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _compat.environ_data()
    assert data is not None, "os.environ._data is gone: _kinds._environ_snapshot re-decodes"
    before = dict(data)
    monkeypatch.setenv("AIOLAUNCH_COMPAT_PROBE", "1")
    assert _compat.environ_data() != before
    assert os.fsencode("AIOLAUNCH_COMPAT_PROBE") in data
    monkeypatch.delenv("AIOLAUNCH_COMPAT_PROBE")
    assert _compat.environ_data() == before


async def test_add_and_remove_loop_signal_handler_skip_valid_signals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wrappers install and remove a real handler (a real signal reaches it)
    without asyncio's per-call ``signal.valid_signals()`` (~65 enum members
    built each call, 8 calls per ``wait()``), and still refuse bad numbers."""
    loop = asyncio.get_running_loop()
    calls: list[int] = []
    real = signal.valid_signals
    _compat_signals._valid_signals()  # computed once, before the count starts

    def counted() -> set[signal.Signals]:
        calls.append(1)
        return real()

    monkeypatch.setattr(signal, "valid_signals", counted)
    got: list[str] = []
    _compat_signals.add_loop_signal_handler(loop, signal.SIGUSR2, got.append, "handled")
    try:
        assert _compat_signals.loop_signal_handler(loop, signal.SIGUSR2) is not None
        os.kill(os.getpid(), signal.SIGUSR2)
        await _until(lambda: got)
        assert got == ["handled"]
    finally:
        assert _compat_signals.remove_loop_signal_handler(loop, signal.SIGUSR2)
    assert _compat_signals.loop_signal_handler(loop, signal.SIGUSR2) is None
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert calls == [], "asyncio's check ran signal.valid_signals()"
    assert "_check_signal" not in vars(loop), "the loop keeps its own check afterwards"
    with pytest.raises(ValueError, match="invalid signal number"):
        _compat_signals.add_loop_signal_handler(loop, 0, got.append)
    with pytest.raises(TypeError):
        _compat_signals.add_loop_signal_handler(loop, "SIGUSR2", got.append)  # type: ignore[arg-type]
    assert "_check_signal" not in vars(loop)
    # the loop's own methods check as before
    with pytest.raises(ValueError, match="invalid signal number"):
        loop.add_signal_handler(0, lambda: None)
    assert calls, "the loop's own add_signal_handler still uses signal.valid_signals()"


class _CostlyRepr:
    """A Python-level signal handler whose repr is counted (as asyncio.run()'s
    SIGINT handler, a partial holding the main task, is costly to format)."""

    def __init__(self) -> None:
        self.reprs = 0
        self.calls: list[int] = []

    def __call__(self, signum: int, frame: object) -> None:
        self.calls.append(signum)

    def __repr__(self) -> str:
        self.reprs += 1
        return "<costly>"


async def test_taking_a_signal_over_does_not_format_the_handler_it_replaces() -> None:
    """``signal.signal()`` builds ``repr(old handler)`` into a ValueError it
    catches itself (``signal.Handlers(handler)``); the wrapper swaps a Python
    handler for a relay first, so a wait() never formats it; the handler is
    back afterwards, and the relay passes a signal on to it."""
    loop = asyncio.get_running_loop()
    handler = _CostlyRepr()
    before = signal.signal(signal.SIGUSR2, handler)
    try:
        assert _compat_signals.raw_getsignal(signal.SIGUSR2) is handler
        _compat_signals.add_loop_signal_handler(loop, signal.SIGUSR2, lambda: None)
        assert _compat_signals.remove_loop_signal_handler(loop, signal.SIGUSR2)
        signal.signal(signal.SIGUSR2, handler)  # what _Hub.release puts back
        assert handler.reprs == 0
        # A signal between the swap and the loop's own handler goes to the handler.
        _compat_signals._Relay(handler)(int(signal.SIGUSR2), None)
        assert handler.calls == [signal.SIGUSR2]
        # A failing add (not the main thread, a closed loop) leaves the handler as it was.
        closed = asyncio.new_event_loop()
        closed.close()
        with pytest.raises(RuntimeError):
            _compat_signals.add_loop_signal_handler(closed, signal.SIGUSR2, lambda: None)
        assert signal.getsignal(signal.SIGUSR2) is handler
    finally:
        signal.signal(signal.SIGUSR2, before)


def _wakeup_fd() -> int:
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


async def test_the_direct_signal_path_leaves_what_the_loops_own_methods_leave() -> None:
    """On asyncio's own unix loop, the wrappers take the loop's steps through
    the C signal module: the same handler table, OS handler, wakeup fd and
    errors as ``loop.add_signal_handler``/``remove_signal_handler``."""
    loop = asyncio.get_running_loop()
    assert _compat_signals._direct(loop)
    noop = asyncio.unix_events._sighandler_noop  # type: ignore[attr-defined]
    # The loop may hold handlers of its own (an application's): the wakeup
    # fd goes back to -1 only when the last handler goes.
    own = bool(loop._signal_handlers)  # type: ignore[attr-defined]
    calls: list[str] = []
    _compat_signals.add_loop_signal_handler(loop, signal.SIGUSR1, calls.append, "direct")
    loop.add_signal_handler(signal.SIGUSR2, calls.append, "loop")
    try:
        ours = _compat_signals.loop_signal_handler(loop, signal.SIGUSR1)
        theirs = _compat_signals.loop_signal_handler(loop, signal.SIGUSR2)
        assert type(ours) is type(theirs) is asyncio.Handle
        assert signal.getsignal(signal.SIGUSR1) is signal.getsignal(signal.SIGUSR2) is noop
        assert _wakeup_fd() == loop._csock.fileno()  # type: ignore[attr-defined]
        os.kill(os.getpid(), signal.SIGUSR1)
        await _until(lambda: calls)
        assert calls == ["direct"]
        # Refused as the loop refuses, leaving the table as it was.
        with pytest.raises(RuntimeError, match="cannot be caught"):
            _compat_signals.add_loop_signal_handler(loop, signal.SIGKILL, calls.append)
        assert _compat_signals.loop_signal_handler(loop, signal.SIGKILL) is None
        with pytest.raises(ValueError, match="invalid signal number"):
            _compat_signals.remove_loop_signal_handler(loop, 0)
    finally:
        assert _compat_signals.remove_loop_signal_handler(loop, signal.SIGUSR1)
        assert not _compat_signals.remove_loop_signal_handler(loop, signal.SIGUSR1)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        assert _wakeup_fd() == loop._csock.fileno()  # type: ignore[attr-defined]  # USR2's
        loop.remove_signal_handler(signal.SIGUSR2)
    if not own:
        assert _wakeup_fd() == -1  # the last handler gone: as the loop leaves it
    # SIGINT goes back to Python's default, as with the loop's own method.
    previous = signal.getsignal(signal.SIGINT)
    try:
        _compat_signals.add_loop_signal_handler(loop, signal.SIGINT, calls.append)
        assert _compat_signals.remove_loop_signal_handler(loop, signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if not own:
            assert _wakeup_fd() == -1
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_loop_with_its_own_signal_methods_is_called_as_it_is() -> None:
    calls: list[tuple[str, int]] = []

    class Own(asyncio.SelectorEventLoop):
        def add_signal_handler(self, sig: int, callback: Any, *args: Any) -> None:  # type: ignore[override]
            calls.append(("add", sig))
            super().add_signal_handler(sig, callback, *args)

        def remove_signal_handler(self, sig: int) -> bool:
            calls.append(("remove", sig))
            return super().remove_signal_handler(sig)

    loop = Own()
    try:
        assert not _compat_signals._direct(loop)
        _compat_signals.add_loop_signal_handler(loop, signal.SIGUSR1, lambda: None)
        assert signal.getsignal(signal.SIGUSR1) is asyncio.unix_events._sighandler_noop  # type: ignore[attr-defined]
        assert _compat_signals.remove_loop_signal_handler(loop, signal.SIGUSR1)
        assert calls == [("add", signal.SIGUSR1), ("remove", signal.SIGUSR1)]
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        loop.close()
