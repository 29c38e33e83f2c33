"""What a failure says (issue #12.9): messages that can help, and outcomes that agree.

* A function worker records every Python exception it raises, so one that
  died without one (``os._exit``, a signal) gets its exit code or signal and
  the last lines of its stderr log - not "decorate with @aiolaunch.record".
* ``launch()``'s ``WorkerError`` carries the child's exception type, message
  and traceback (torch's ``mp.spawn`` does).
* ``RestartPolicy("always")`` whose budget is spent fails the group, as its
  docstring says, even when the last exit had code 0.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
from typing import TYPE_CHECKING

import pytest

import aiolaunch
from aiolaunch import ChildFailedError, RestartPolicy, Std, WorkerStarted

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX workers")


def exit_without_exception(code: int) -> None:
    print("loading shard 7", file=sys.stderr, flush=True)
    print("native allocator gave up", file=sys.stderr, flush=True)
    os._exit(code)


def killed_by_signal() -> None:
    print("about to be killed", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def raise_value_error(args: object) -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("boom-42 on rank 1")
    import time

    time.sleep(60)  # stopped by the fail-fast


def os_exit_on_rank_one(args: object) -> None:
    if os.environ["RANK"] == "1":
        os._exit(4)
    import time

    time.sleep(60)


async def _run_one(tmp_path: Path, fn: object, *args: object) -> aiolaunch.RunProcsResult:
    async with aiolaunch.start_processes(
        name="m",
        entrypoint=fn,  # type: ignore[arg-type]
        args={0: args},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None and list(result.failures) == [0]
    return result


async def test_os_exit_gives_the_exit_code_and_stderr_lines(tmp_path: Path) -> None:
    result = await _run_one(tmp_path, exit_without_exception, 3)
    failure = result.failures[0]
    assert failure.exitcode == 3
    message = failure.error_message
    assert "exited with code 3 without raising a Python exception" in message
    assert "loading shard 7\nnative allocator gave up" in message
    assert result.stderrs[0] in message  # where the whole log is
    assert "@aiolaunch.record" not in message
    summary = str(ChildFailedError("m", result.failures))
    assert "\n  native allocator gave up" in summary  # quoted lines stay indented


async def test_a_signal_gives_its_name_and_stderr_lines(tmp_path: Path) -> None:
    result = await _run_one(tmp_path, killed_by_signal)
    failure = result.failures[0]
    assert failure.exitcode == -signal.SIGKILL
    assert failure.error_message.startswith(f"Signal 9 (SIGKILL) received by PID {failure.pid}")
    assert "about to be killed" in failure.error_message
    assert "@aiolaunch.record" not in failure.error_message


async def test_binary_workers_keep_the_record_hint(tmp_path: Path) -> None:
    # A binary may be a Python script that can use @record: the hint still helps.
    async with aiolaunch.start_processes(
        name="b",
        entrypoint="/bin/sh",
        args={0: ("-c", "exit 3")},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None
    assert "@aiolaunch.record" in result.failures[0].error_message


async def test_launch_worker_error_carries_the_child_exception() -> None:
    with pytest.raises(aiolaunch.WorkerError) as info:
        await asyncio.wait_for(aiolaunch.launch(raise_value_error, None, 2), 120)
    exc = info.value
    assert (exc.worker_id, exc.exitcode) == (1, 1)
    assert str(exc) == "worker[1] failed with exitcode=1"  # the SPEC's text, unchanged
    assert exc.error_type == "ValueError"
    assert exc.error_message == "boom-42 on rank 1"
    assert exc.traceback is not None
    assert "in raise_value_error" in exc.traceback
    assert "ValueError: boom-42 on rank 1" in exc.traceback
    assert exc.failure is not None and exc.failure.local_rank == 1
    if sys.version_info >= (3, 11):
        assert any("in raise_value_error" in note for note in exc.__notes__)
    clone = pickle.loads(pickle.dumps(exc))
    assert (clone.error_type, clone.error_message, clone.traceback) == (
        exc.error_type,
        exc.error_message,
        exc.traceback,
    )


async def test_launch_worker_error_without_an_exception_says_how_it_died() -> None:
    with pytest.raises(aiolaunch.WorkerError) as info:
        await asyncio.wait_for(aiolaunch.launch(os_exit_on_rank_one, None, 2), 120)
    exc = info.value
    assert (exc.worker_id, exc.exitcode) == (1, 4)
    assert exc.error_type is None and exc.traceback is None
    assert exc.error_message is not None
    assert "exited with code 4 without raising a Python exception" in exc.error_message


async def test_always_policy_with_spent_budget_fails_the_group(tmp_path: Path) -> None:
    policy = RestartPolicy("always", max_restarts=2, window=60, backoff=0.01)
    async with aiolaunch.start_processes(
        name="r",
        entrypoint="/bin/sh",
        args={0: ("-c", "exit 0"), 1: ("-c", "exec sleep 60")},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path),
        restart={0: policy},
    ) as ctx:
        events = ctx.events()
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None and result.is_failed(), "the docstring says: fails the group"
    assert list(result.failures) == [0]
    failure = result.failures[0]
    assert failure.exitcode == 0
    assert "restart budget spent" in failure.error_message
    assert "RestartPolicy('always') allows 2 restart(s) within 60s" in failure.error_message
    starts = [e async for e in events if isinstance(e, WorkerStarted) and e.rank == 0]
    assert len(starts) == 3
