"""Fd ownership: a pipe's fd number is touched only by the object that owns it.

asyncio's read-pipe transport closes its fd at EOF; the number is reused at
once by the next ``os.pipe()`` (a later rank's log or result pipe, blocking,
whose write end the supervisor still holds). Reading "the rest" of a pipe by
its number after that blocks the event loop forever, or steals another
rank's bytes. These tests run many function workers that return at once
(regression for issue #12.1), and force the reuse ordering deterministically.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import anyio
import pytest

import aiolaunch
from aiolaunch import Std

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfd, /proc")


def echo_and_return(rank: int) -> dict[str, int]:
    print(f"out-{rank}", flush=True)
    print(f"err-{rank}", file=sys.stderr, flush=True)
    return {"rank": rank, "square": rank * rank}


async def _one_group(tmp_path: Path, index: int, nprocs: int) -> None:
    log_dir = tmp_path / f"g{index}"
    async with aiolaunch.start_processes(
        name=f"g{index}",
        entrypoint=echo_and_return,
        args={r: (r,) for r in range(nprocs)},
        envs={r: {} for r in range(nprocs)},
        log_dir=str(log_dir),
        redirects=Std.ALL,
        start_method="fork",
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    assert not result.is_failed(), {r: str(f.message) for r, f in result.failures.items()}
    assert result.return_values == {r: {"rank": r, "square": r * r} for r in range(nprocs)}
    for r in range(nprocs):
        assert Path(result.stdouts[r]).read_text() == f"out-{r}\n"
        assert Path(result.stderrs[r]).read_text() == f"err-{r}\n"


async def test_many_function_workers_returning_at_once(tmp_path: Path) -> None:
    """48 workers x several groups: every value and every log line arrives, no hang."""
    for index in range(6):
        # A frozen event loop cannot run wait_for's timeout either: the bound
        # catches slow groups; a blocked loop shows up as the suite's timeout.
        await asyncio.wait_for(_one_group(tmp_path, index, 48), 30)


def return_marker() -> str:
    return "marker"


async def test_result_read_after_eof_never_touches_a_reused_fd_number() -> None:
    """The exit callback runs after the result transport closed its fd at EOF.

    Forced order: the worker exits, the transport sees EOF and closes the read
    end, a new pipe takes the same fd number (as a later rank's pipe would),
    and only then the exit callback decides the result. It must report the
    value and leave the new pipe's bytes alone (before the fix it read them -
    or, with the write end open, blocked the loop forever).
    """
    import cloudpickle

    from aiolaunch._workers._function import spawn_function

    loop = asyncio.get_running_loop()
    handle = await spawn_function(
        local_rank=0,
        name="fd",
        start_method="fork",
        fn=cloudpickle.dumps(return_marker),
        args=cloudpickle.dumps(()),
        env={},
        stdout=None,
        stderr=None,
        error_file="",
    )
    exit_fd = handle._exit_fd
    reader = handle._result
    assert exit_fd is not None and reader is not None and reader.transport is not None
    result_fd = reader.transport.get_extra_info("pipe").fileno()
    # Hold the exit event back until the result pipe's fd is gone.
    loop.remove_reader(exit_fd)
    exited = asyncio.Event()
    loop.add_reader(exit_fd, exited.set)
    reused: tuple[int, int] | None = None
    try:
        await asyncio.wait_for(exited.wait(), 30)
        loop.remove_reader(exit_fd)
        with anyio.fail_after(30):
            # The transport saw EOF and closed its fd (in connection_lost).
            while os.path.exists(f"/proc/self/fd/{result_fd}"):
                await asyncio.sleep(0.01)
        reused = os.pipe()
        assert reused[0] == result_fd, "precondition: the fd number was reused"
        os.write(reused[1], b"another rank's bytes")
        os.close(reused[1])  # the old code then reads to EOF instead of blocking
        handle._on_exit_readable()
        assert handle.returncode == 0
        assert handle.failure_reason is None
        assert handle.return_value == "marker"
        assert os.read(reused[0], 100) == b"another rank's bytes"
    finally:
        if reused is not None:
            os.close(reused[0])
        if handle.returncode is None:
            handle.signal_tree(signal.SIGKILL)
            await asyncio.to_thread(handle.process.join)  # type: ignore[union-attr]
            handle.release()
