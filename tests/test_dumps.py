"""Stack dumps are bounded: no request can hold the dumper (or the watchdog) for ever.

Regression tests for issue #27 item 3: ``aiolaunch stacks --timeout inf`` (or
``nan``, or ``ctx.dump_stacks(timeout=math.inf)``) while one rank did not
answer held the dump lock for ever; every later ``stacks`` hung and the
watchdog never fired again.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from typing import TYPE_CHECKING

import pytest

import aiolaunch
import aiolaunch._hangs._dumper
from aiolaunch import Std

if TYPE_CHECKING:
    from pathlib import Path


def parked(rank: int) -> None:
    print(f"rank {rank} parked", flush=True)
    while True:
        time.sleep(3600)


async def _started(ctx: aiolaunch.PContext, tmp_path: Path, n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        logs = [tmp_path / str(r) / "stdout.log" for r in range(n)]
        if all(p.exists() and b"parked" in p.read_bytes() for p in logs):
            return
        await asyncio.sleep(0.05)  # allowed: polling a file the test reads
    pytest.fail("workers did not start")


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 0, -1, True])
async def test_dump_stacks_refuses_unbounded_timeouts(tmp_path: Path, timeout: float) -> None:
    async with aiolaunch.start_processes(
        "d", parked, {0: (0,)}, {0: {}}, log_dir=tmp_path, redirects=Std.ALL
    ) as ctx:
        with pytest.raises(ValueError, match=r"dump_stacks\(timeout\)=.* finite number"):
            await ctx.dump_stacks(timeout=timeout)


async def test_a_silent_rank_holds_a_dump_no_longer_than_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aiolaunch._hangs._dumper, "MAX_DUMP_TIMEOUT", 1.0)
    async with aiolaunch.start_processes(
        "d",
        parked,
        {r: (r,) for r in range(2)},
        {0: {}, 1: {}},
        log_dir=tmp_path,
        redirects=Std.ALL,
    ) as ctx:
        await _started(ctx, tmp_path, 2)
        os.kill(ctx.pids()[1], signal.SIGSTOP)  # rank 1 cannot answer
        try:
            t0 = time.monotonic()
            first = asyncio.ensure_future(ctx.dump_stacks(timeout=1e9))  # a client's dump
            await asyncio.sleep(0.1)
            # The watchdog's (or a second client's) dump of every rank joins it.
            second = await asyncio.wait_for(ctx.dump_stacks(timeout=5), 10)
            dumps = await asyncio.wait_for(first, 10)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(ctx.pids()[1], signal.SIGCONT)
    assert elapsed < 5, f"the dump took {elapsed:.1f}s with a 1 s cap"
    assert second == dumps
    assert "parked" in dumps[0]
    assert dumps[1].startswith("<pid") and "is stopped" in dumps[1]  # the real reason (#27)
    # one round was dumped, not two
    assert sorted(p.name for p in (tmp_path / "0").glob("stacks-*.txt")) == ["stacks-1.txt"]
