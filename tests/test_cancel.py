"""``_cancel.move_on_after`` and ``shielded``: bounded waits and cleanup that
cancellation delays but never skips, on asyncio alone (anyio's cancel scopes
only where the caller uses anyio)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from aiolaunch._cancel import DelayedTask, move_on_after, shielded


async def test_move_on_after_leaves_the_block_quietly_when_the_time_is_up() -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reached = False
    async with move_on_after(0.05) as scope:
        await asyncio.Event().wait()
        reached = True
    assert not reached
    assert scope.cancelled_caught
    assert 0.04 <= loop.time() - t0 < 5


async def test_move_on_after_does_nothing_when_the_block_ends_in_time() -> None:
    async with move_on_after(5) as scope:
        await asyncio.sleep(0)
    assert not scope.cancelled_caught
    for forever in (None, float("inf")):
        async with move_on_after(forever) as scope:
            await asyncio.sleep(0)
        assert not scope.cancelled_caught


async def test_move_on_after_lets_an_outside_cancellation_through() -> None:
    started = asyncio.Event()

    async def waiter() -> None:
        async with move_on_after(30):
            started.set()
            await asyncio.Event().wait()

    task = asyncio.ensure_future(waiter())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_move_on_after_keeps_the_blocks_own_errors() -> None:
    with pytest.raises(TimeoutError, match="mine"):
        async with move_on_after(30):
            raise TimeoutError("mine")
    with pytest.raises(ValueError, match="boom"):
        async with move_on_after(0):
            raise ValueError("boom")


async def test_shielded_finishes_the_work_then_reraises_the_cancellation() -> None:
    steps: list[str] = []
    counts: list[int] = []
    gate = asyncio.Event()

    async def cleanup() -> str:
        await gate.wait()
        steps.append("cleaned")
        return "done"

    async def caller() -> str:
        return await shielded(cleanup(), counts.append)

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["cleaned"]
    assert counts == [1, 2]


def test_no_anyio_import_on_the_supervisor_path(tmp_path: object) -> None:
    """A whole run - start, wait, close - never imports anyio's asyncio
    backend (~20 ms of CPU at first use, beside the workers just started);
    an application that uses anyio still gets its cancel scopes held off."""
    code = textwrap.dedent(
        """
        import asyncio, sys
        import aiolaunch

        async def main():
            async with aiolaunch.start_processes(
                name="q", entrypoint="/bin/sh", args={0: ("-c", "exit 0")}, envs={0: {}}
            ) as ctx:
                res = await ctx.wait()
            assert not res.is_failed()
            await ctx.close()

        asyncio.run(main())
        print(sorted(m for m in sys.modules if m.startswith("anyio")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


async def test_shielded_holds_off_an_anyio_cancel_scope() -> None:
    anyio = pytest.importorskip("anyio")
    done: list[str] = []

    async def cleanup() -> None:
        await asyncio.sleep(0.1)
        done.append("cleaned")

    with anyio.move_on_after(0.01) as scope:
        await shielded(cleanup())
        done.append("after")
        await asyncio.sleep(5)  # the scope's cancellation lands at this checkpoint
        done.append("not reached")
    # the cleanup ran to its end although the scope's deadline came first
    assert done == ["cleaned", "after"]
    assert scope.cancel_called


async def test_expire_ends_the_block_now_as_if_the_time_ran_out() -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with move_on_after(30) as scope:
        loop.call_later(0.02, scope.expire)
        await asyncio.Event().wait()
    assert scope.cancelled_caught
    assert loop.time() - t0 < 5


async def test_an_escalation_cuts_a_grace_period_short_without_a_task() -> None:
    from aiolaunch._terminate import Escalation, _grace_period

    loop = asyncio.get_running_loop()
    never = asyncio.Event()
    tasks_before = len(asyncio.all_tasks())
    seen: list[int] = []

    async def gone() -> None:
        seen.append(len(asyncio.all_tasks()))
        await never.wait()

    escalation = Escalation()
    loop.call_later(0.02, escalation.set)
    t0 = loop.time()
    assert await _grace_period(gone, 30, escalation) is True
    assert loop.time() - t0 < 5
    assert seen == [tasks_before], "gone() ran in the caller's task"
    assert await _grace_period(gone, 30, escalation) is True, "set before: no wait at all"
    assert seen == [tasks_before]
    # Running out is not being cut short; neither is gone() returning first,
    # and a later set() finds no hook left.
    assert await _grace_period(never.wait, 0.02, Escalation()) is False
    late = Escalation()
    done = asyncio.Event()
    loop.call_later(0.01, done.set)
    assert await _grace_period(done.wait, 30, late) is False
    assert late._callbacks == []
    late.set()

    async def fails() -> None:
        raise OSError("from gone()")

    with pytest.raises(OSError, match="from gone"):
        await _grace_period(fails, 30, Escalation())


async def test_a_delayed_task_runs_after_its_delay_and_not_when_stopped_before() -> None:
    loop = asyncio.get_running_loop()
    ran: list[float] = []

    async def run() -> None:
        ran.append(loop.time())

    t0 = loop.time()
    done = DelayedTask(0.05, run)
    await asyncio.sleep(0.3)  # allowed: past the delay
    assert len(ran) == 1 and ran[0] - t0 >= 0.045
    await done.stop()  # finished: nothing to cancel
    before = asyncio.all_tasks()
    stopped = DelayedTask(0.05, run)
    assert asyncio.all_tasks() == before  # only a timer until the delay
    await stopped.stop()
    await asyncio.sleep(0.3)  # allowed: past the delay that was cancelled
    assert len(ran) == 1


async def test_a_delayed_task_stopped_while_it_runs_is_cancelled_and_awaited() -> None:
    started, ended = asyncio.Event(), []

    async def run() -> None:
        started.set()
        try:
            await asyncio.sleep(30)  # allowed: waits to be cancelled
        finally:
            ended.append(True)

    task = DelayedTask(0.0, run)
    await asyncio.wait_for(started.wait(), 10)
    await task.stop()
    assert ended == [True]
    await task.stop()  # idempotent
