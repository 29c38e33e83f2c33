"""Hangs and stragglers of real torch.distributed (gloo) jobs (issue #22).

Independent scenarios run concurrently inside one test: torch takes seconds
to import on two loaded cores, so each test pays that once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from _helpers import together, wait_lines
from aiolaunch import Std, Watchdog, WorkerStalled, WorkerStraggling

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.torch
pytest.importorskip("torch.distributed")


def _envs(n: int) -> dict[int, dict[str, str]]:
    return {r: {} for r in range(n)}


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    print("joined", flush=True)


def fib(n: int) -> int:
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def compute(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        fib(15)


# -- the odd rank spins or prints while the others wait in all_reduce --------------------


def spin_before_all_reduce() -> None:
    while True:
        pass


def print_waiting() -> None:
    while True:
        print("waiting for data", flush=True)
        time.sleep(0.2)


def odd_rank_job(rank: int, world: int, port: int, mode: str) -> None:
    import torch
    import torch.distributed as dist

    _init(rank, world, port)
    if rank == 1:
        spin_before_all_reduce() if mode == "spin" else print_waiting()
    dist.all_reduce(torch.ones(4))


async def _odd_rank(log_dir: Path, mode: str) -> None:
    port = aiolaunch.free_port()
    async with aiolaunch.start_processes(
        f"odd-{mode}",
        odd_rank_job,
        {r: (r, 3, port, mode) for r in range(3)},
        _envs(3),
        log_dir=log_dir,
        redirects=Std.ALL,
        watchdog=Watchdog(stall_after=3),
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 120)
    assert result is not None and result.is_failed()
    # One story: the outlier of the verdict is the failure, the root cause and
    # the report's root cause, whether it spins or prints; the others were
    # stopped by aiolaunch.
    assert next(iter(result.failures)) == 1, (mode, result)
    where = "spin_before_all_reduce" if mode == "spin" else "print_waiting"
    assert where in str(result.failures[1].message), mode
    root_rank, _ = aiolaunch.ChildFailedError("x", result.failures).get_first_failure()
    assert root_rank == 1
    report = json.loads((log_dir / "report.json").read_text())
    assert report["root_cause"]["rank"] == 1, mode
    assert report["verdict"]["outliers"] == [1], mode
    assert report["stopped_by_aiolaunch"] == [0, 2], mode
    assert "all_reduce" in report["verdict"]["text"]


async def test_the_odd_rank_is_the_one_story_spinning_or_printing(tmp_path: Path) -> None:
    await together(_odd_rank(tmp_path / "spin", "spin"), _odd_rank(tmp_path / "print", "print"))


# -- healthy torch jobs are never flagged ---------------------------------------------


class SlowData:
    """A dataset whose items take seconds of CPU in the DataLoader workers."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        compute(3.0)
        return i


def data_loader_rank() -> str:
    import torch.utils.data

    loader: Any = torch.utils.data.DataLoader(SlowData(), num_workers=2, batch_size=None)  # type: ignore[arg-type]
    for _ in loader:  # the main thread waits while the workers compute
        pass
    return "done"


def rank0_prints_steps(rank: int, world: int, port: int, steps: int) -> str:
    import torch
    import torch.distributed as dist

    _init(rank, world, port)
    t = torch.ones(4)
    for step in range(steps):
        compute(0.3)
        dist.all_reduce(t)
        if rank == 0:
            print(f"step {step}", flush=True)
    return "done"


async def _never_flagged(
    name: str, log_dir: Path, entry: Any, args: dict[int, Any], **kw: Any
) -> None:
    async with aiolaunch.start_processes(
        name, entry, args, _envs(len(args)), log_dir=log_dir, redirects=Std.ALL, **kw
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 180)
    assert result is not None and not result.is_failed(), (name, result)
    assert [e for e in ctx._bus.history if isinstance(e, WorkerStalled)] == [], name


async def test_healthy_torch_jobs_are_never_flagged(tmp_path: Path) -> None:
    """DataLoader workers compute while the rank waits; a 4-rank gloo job with
    --progress-regex '^step ' where only rank 0 prints steps."""
    port = aiolaunch.free_port()
    await together(
        _never_flagged(
            "loader",
            tmp_path / "loader",
            data_loader_rank,
            {0: ()},
            watchdog=Watchdog(stall_after=5),
        ),
        _never_flagged(
            "steps",
            tmp_path / "steps",
            rank0_prints_steps,
            {r: (r, 4, port, 20) for r in range(4)},
            watchdog=Watchdog(stall_after=5, progress="^step "),
        ),
    )


# -- stragglers -----------------------------------------------------------------------


def load_batch(seconds: float) -> None:
    time.sleep(seconds)  # a slow data loader: it waits, so 4 ranks on 2 cores measure it


def training(rank: int, world: int, port: int, slow: int | None) -> None:
    import torch
    import torch.distributed as dist

    _init(rank, world, port)
    rng = random.Random(rank)
    t = torch.ones(4)
    for _ in itertools.count():
        if slow is None:  # balanced, but noisy: every rank waits for the last one
            load_batch(rng.uniform(0.05, 0.15))
        else:
            load_batch(0.2 if rank == slow else 0.1)
        dist.all_reduce(t)


@pytest.mark.slow
async def test_the_straggler_is_named_and_a_balanced_run_names_nobody(tmp_path: Path) -> None:
    # 0.25 s: ~35 samples (up to ~90) name it; 45 s holds on a loaded host.
    # The stack statistic: the ranks serve no collective record (that one is
    # tests/test_collectives.py's).
    wd = Watchdog(stall_after=600, stragglers=0.25)
    ports = aiolaunch.free_port(), aiolaunch.free_port()
    envs = {r: {"AIOLAUNCH_NO_COLLECTIVES": "1"} for r in range(4)}
    async with (
        aiolaunch.start_processes(
            "slow",
            training,
            {r: (r, 4, ports[0], 3) for r in range(4)},
            envs,
            log_dir=tmp_path / "slow",
            redirects=Std.ALL,
            watchdog=wd,
        ) as slow,
        aiolaunch.start_processes(
            "even",
            training,
            {r: (r, 4, ports[1], None) for r in range(4)},
            envs,
            log_dir=tmp_path / "even",
            redirects=Std.ALL,
            watchdog=wd,
        ) as even,
    ):
        logs = tmp_path
        joined = await wait_lines(logs, 8, "joined", timeout=120)

        def named(ctx: aiolaunch.PContext) -> list[WorkerStraggling]:
            return [e for e in ctx._bus.history if isinstance(e, WorkerStraggling)]

        while not named(slow) and time.monotonic() < joined + 45:
            await asyncio.sleep(0.2)  # allowed: waiting for a sampling window
        events = named(slow)
        watch = slow._hangs.stragglers
        shares = None if watch is None else (watch.stat._k, watch.stat._n)  # waits, samples
        assert events, f"the straggler was never named: (waits, samples) = {shares}"
        assert {e.rank for e in events} == {3}, (events, shares)
        assert events[0].wait_share < events[0].peers_wait_share / 2
        assert (events[0].source, events[0].lateness_s) == ("stacks", None)
        statuses = slow.status()
        assert statuses[3].state == "straggling" and statuses[3].straggling
        assert not any(s.straggling for s in statuses[:3])
        # The balanced job ran as long, sampled the same way: nobody named.
        assert named(even) == [], named(even)
        assert await slow.wait(timeout=0) is None and await even.wait(timeout=0) is None
