"""close() stays quick beside a CPU-bound asyncio task (issue #27 item 5).

The cleanup after a result - the ``/proc`` sweep for escaped daemons, the
group's files, empty temp folders - used to run in worker threads. Beside a
task that keeps the loop thread busy, a thread waits for the GIL before each
of its many small syscalls (one switch interval each), and close() of 64
exited workers took 12-28 s. Now that work runs on the loop, a slice at a
time, and close() does not wait for any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import TYPE_CHECKING, Any

import aiolaunch

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


class _CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, counting what is submitted to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=4)
        self.submitted: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        self.submitted.append(getattr(fn, "__qualname__", repr(fn)))
        return super().submit(fn, *args, **kwargs)


async def _burn(stop: asyncio.Event) -> None:
    while not stop.is_set():
        sum(range(1_000_000))  # tens of milliseconds holding the GIL
        await asyncio.sleep(0)


async def test_close_of_64_exited_workers_beside_a_busy_task(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    executor = _CountingExecutor()
    loop.set_default_executor(executor)
    stop = asyncio.Event()
    burner = asyncio.ensure_future(_burn(stop))
    try:
        async with aiolaunch.start_processes(
            "b",
            "/bin/true",
            {r: () for r in range(64)},
            {r: {} for r in range(64)},
            log_dir=tmp_path / "logs",
        ) as ctx:
            result = await asyncio.wait_for(ctx.wait(), 60)
            assert result is not None and not result.is_failed()
            before = len(executor.submitted)
            t0 = time.monotonic()
        elapsed = time.monotonic() - t0
        during_close = executor.submitted[before:]
    finally:
        stop.set()
        await burner
    assert during_close == [], f"close() waited for thread work: {during_close}"
    # Generous: the point is seconds vs. a fraction of one (see the benchmark).
    assert elapsed < 10, f"close() took {elapsed:.1f}s beside a busy task"
