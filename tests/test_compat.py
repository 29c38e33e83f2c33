"""The CPython internals aiolaunch reads, each behind one function of ``_compat``.

If a CPython release changes one of them, the matching test here fails and
names the function to adapt (the supervisor itself only degrades).
"""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from _helpers import driver
from aiolaunch._compat import (
    call_handle_soon,
    is_asyncio_run_sigint_handler,
    is_default_handler,
    loop_signal_handler,
    reinstall_loop_signal_handler,
    task_cancelling,
)


async def test_loop_signal_handler_is_found_reinstalled_and_called() -> None:
    loop = asyncio.get_running_loop()
    calls: list[tuple[str, int]] = []
    done = asyncio.Event()

    def on_usr2(tag: str, n: int) -> None:
        calls.append((tag, n))
        done.set()

    assert loop_signal_handler(loop, signal.SIGUSR2) is None
    loop.add_signal_handler(signal.SIGUSR2, on_usr2, "app", 7)
    try:
        handle = loop_signal_handler(loop, signal.SIGUSR2)
        assert handle is not None
        loop.add_signal_handler(signal.SIGUSR2, lambda: None)  # someone takes it over
        assert reinstall_loop_signal_handler(loop, signal.SIGUSR2, handle)
        again = loop_signal_handler(loop, signal.SIGUSR2)
        assert again is not None and again is not handle
        assert call_handle_soon(loop, again)
        await asyncio.wait_for(done.wait(), 10)
        assert calls == [("app", 7)]
        handle.cancel()
        assert not call_handle_soon(loop, handle)  # a cancelled handle is not run
    finally:
        loop.remove_signal_handler(signal.SIGUSR2)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


_RUNNER = """
import asyncio, signal
from aiolaunch._compat import is_asyncio_run_sigint_handler, is_default_handler

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
    assert is_default_handler(signal.SIG_DFL)
    assert is_default_handler(None)
    assert is_default_handler(signal.default_int_handler)
    assert not is_default_handler(signal.SIG_IGN)
    assert not is_default_handler(lambda s, f: None)
    assert not is_asyncio_run_sigint_handler(signal.default_int_handler)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is 3.11+")
async def test_task_cancelling_counts_pending_cancellations() -> None:
    seen: list[int] = []
    started = asyncio.Event()

    async def victim() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(task_cancelling(asyncio.current_task()))
            raise

    task = asyncio.ensure_future(victim())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [1]
    assert task_cancelling(None) == 0
