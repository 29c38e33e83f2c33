"""``wait()`` away from the main thread, and nested in a loop that already runs.

Only the main thread can handle signals, so a ``wait()`` running in another
thread's event loop installs no handler and forwards nothing (documented in
``PContext.wait``); everything else - exit detection, logs, results - works
the same. Inside the main thread's running loop, several concurrent waits on
one context share one outcome.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import pytest

import aiolaunch
from aiolaunch import Std

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from pathlib import Path

T = TypeVar("T")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def square(x: int) -> int:
    print(f"square {x}", flush=True)
    return x * x


def _in_thread(coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``coro_fn()`` in ``asyncio.run`` on a fresh non-main thread; return its result."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as exc:  # pragma: no cover - reported below
            box["error"] = exc

    thread = threading.Thread(target=target, name="aiolaunch-test-loop")
    thread.start()
    thread.join(60)
    if thread.is_alive():  # pragma: no cover
        pytest.fail("wait() in a worker thread did not return within 60s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


async def _start_and_wait(log_dir: Path) -> tuple[dict[int, Any], dict[int, Any], str]:
    assert threading.current_thread() is not threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    ctx = await aiolaunch.start_processes(
        name="sq",
        entrypoint=square,
        args={0: (2,), 1: (3,)},
        envs={0: {}, 1: {}},
        log_dir=log_dir,
        redirects=Std.ALL,
    )
    during: dict[int, Any] = {}
    async with ctx:
        waiter = asyncio.ensure_future(ctx.wait())
        await asyncio.sleep(0)  # wait() is now inside its signal scope
        during = {sig: signal.getsignal(sig) for sig in SIGNALS}
        loop_handlers = sorted(getattr(asyncio.get_running_loop(), "_signal_handlers", {}))
        result = await waiter
    assert during == before  # nothing installed: no race outside the main thread
    assert loop_handlers == []
    assert result is not None
    assert not result.is_failed()
    with open(result.stdouts[1]) as f:
        return result.return_values, during, f.read()


def test_wait_in_a_non_main_thread_with_its_own_loop(tmp_path: Path) -> None:
    values, _, log = _in_thread(lambda: _start_and_wait(tmp_path / "logs"))
    assert values == {0: 4, 1: 9}
    assert log == "square 3\n"


async def test_main_loop_and_thread_loop_wait_at_the_same_time(tmp_path: Path) -> None:
    """A main-thread wait() (signals raced) and a thread's wait() (not) don't disturb each other."""
    orig = {sig: signal.getsignal(sig) for sig in SIGNALS}
    async with aiolaunch.start_processes(
        name="main", entrypoint=square, args={0: (5,)}, envs={0: {}}
    ) as ctx:
        main_wait = asyncio.ensure_future(ctx.wait())
        await asyncio.sleep(0)
        # The main thread's wait() installed its handlers on this loop...
        assert signal.getsignal(signal.SIGTERM) is not orig[signal.SIGTERM]
        thread_values, _, _ = await anyio.to_thread.run_sync(
            _in_thread, lambda: _start_and_wait(tmp_path / "thread")
        )
        main_result = await main_wait
    assert thread_values == {0: 4, 1: 9}
    assert main_result is not None
    assert main_result.return_values == {0: 25}
    # ...and restored them; the thread's run changed nothing.
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == orig


async def test_concurrent_waits_in_a_running_loop_share_the_outcome() -> None:
    """wait() nested in tasks of the loop that already runs the caller: one outcome for all."""
    async with aiolaunch.start_processes(
        name="n", entrypoint=square, args={0: (4,), 1: (6,)}, envs={0: {}, 1: {}}
    ) as ctx:
        tasks = [asyncio.ensure_future(ctx.wait()) for _ in range(3)]
        direct = await ctx.wait()
        results = await asyncio.gather(*tasks)
    assert direct is not None
    assert direct.return_values == {0: 16, 1: 36}
    assert all(r is direct for r in results)


async def test_wait_driven_from_another_thread_onto_the_main_loop() -> None:
    """A thread submits wait() to the main loop (run_coroutine_threadsafe) and blocks on it."""
    loop = asyncio.get_running_loop()
    async with aiolaunch.start_processes(
        name="x", entrypoint=square, args={0: (7,)}, envs={0: {}}
    ) as ctx:

        def from_thread() -> Any:
            fut = asyncio.run_coroutine_threadsafe(ctx.wait(), loop)
            return fut.result(timeout=60)

        result = await anyio.to_thread.run_sync(from_thread)
    assert result is not None
    assert result.return_values == {0: 49}
    assert ctx.pids()[0] != os.getpid()


async def test_timed_out_wait_in_a_thread_then_close() -> None:
    """wait(timeout) returning None in a thread's loop; close() in that loop stops the worker."""

    async def scenario() -> tuple[Any, bool]:
        ctx = await aiolaunch.start_processes(
            name="slow",
            entrypoint="sleep",
            args={0: ("60",)},
            envs={0: {}},
            shutdown_timeout=5,
        )
        first = await ctx.wait(timeout=0.05)
        pid = ctx.pids()[0]
        await ctx.close(timeout=5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return first, True
        return first, False

    first, gone = await anyio.to_thread.run_sync(_in_thread, scenario)
    assert first is None
    assert gone
