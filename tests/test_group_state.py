"""The group's state and its wake-up rule, without processes; the control
protocol's dispatcher against a small target (the real command table)."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import pytest

from aiolaunch._events import GroupStopped, WorkerStarted
from aiolaunch._group import GroupState, Wakeup
from aiolaunch._hangs._dumper import Dump
from aiolaunch._live._commands import COMMANDS, PROTOCOL_VERSION, dispatch
from aiolaunch._live._status import WorkerStatus
from aiolaunch._workers._handle import WorkerHandle

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence
    from contextlib import AbstractAsyncContextManager

    from aiolaunch._events import Event
    from aiolaunch._live._attach import Session


def _handle(rank: int, pid: int) -> WorkerHandle:
    h = WorkerHandle(rank)
    h.pid = pid
    return h


def _exit(state: GroupState, h: WorkerHandle, code: int) -> None:
    h.set_exited(code)
    state.gone(h.local_rank)


async def test_wakeup_never_misses_a_change_made_while_checking() -> None:
    wake = Wakeup()
    seen = wake.version
    wake.notify()  # between reading the version and waiting
    await asyncio.wait_for(wake.changed(seen), 1)  # returns at once


async def test_waiters_do_not_consume_each_others_wakeups() -> None:
    wake = Wakeup()
    seen = wake.version
    a = asyncio.ensure_future(wake.changed(seen))
    b = asyncio.ensure_future(wake.changed(seen))
    await asyncio.sleep(0)
    assert not a.done() and not b.done()
    wake.notify()
    await asyncio.wait_for(asyncio.gather(a, b), 1)
    # a waiter that read the version after the notify waits for the next one
    c = asyncio.ensure_future(wake.changed(wake.version))
    await asyncio.sleep(0)
    assert not c.done()
    wake.notify()
    await asyncio.wait_for(c, 1)


async def test_decided_when_every_rank_exited_cleanly() -> None:
    state = GroupState("g", 2)
    h0, h1 = _handle(0, 100), _handle(1, 101)
    state.started(h0)
    assert not state.decided()  # rank 1 not started yet
    state.started(h1)
    _exit(state, h0, 0)
    assert not state.decided()
    _exit(state, h1, 0)
    assert state.decided() and state.failed_ranks() == []
    assert state.exit_order == (0, 1)


async def test_first_failure_decides_and_failures_keep_exit_order() -> None:
    state = GroupState("g", 3)
    hs = [_handle(r, 200 + r) for r in range(3)]
    for h in hs:
        state.started(h)
    _exit(state, hs[2], 3)
    assert state.decided() and state.failed_ranks() == [2]
    _exit(state, hs[0], -9)
    hs[1].stopped_by_us = True
    _exit(state, hs[1], -15)
    assert state.failed_ranks() == [2, 0]  # stopped on purpose is not failed


async def test_restarting_rank_is_neither_failed_nor_done() -> None:
    state = GroupState("g", 1)
    h = _handle(0, 300)
    state.started(h)
    state.restart_planned(0)
    h.set_exited(1)
    assert state.restarting(0) and state.any_restarting()
    assert not state.decided()
    assert state.next_attempt(0) == 1
    state.started(_handle(0, 301))
    state.restart_finished(0)
    assert not state.restarting(0)
    assert state.attempts(0) == 1 and state.worker(0) is not None
    assert state.pids() == {0: 301}


async def test_forced_failures_come_first_and_the_first_verdict_wins() -> None:
    state = GroupState("g", 3)
    hs = [_handle(r, 400 + r) for r in range(3)]
    for h in hs:
        state.started(h)
    _exit(state, hs[0], 1)
    seen = state.wakeup.version
    state.fail(2, "stalled: no output", when=5.0)
    assert state.wakeup.version != seen
    state.fail(2, "something else", when=9.0)
    assert state.failed_ranks() == [2, 0]
    assert state.forced[2].message == "stalled: no output" and state.forced[2].time == 5.0
    assert state.decided()


async def test_kill_records_why_and_refuses_exited_ranks() -> None:
    state = GroupState("g", 1)
    h = _handle(0, 500)
    state.started(h)
    h.set_exited(0)
    assert not state.kill(0, 9, "stalled") and h.failure_reason is None
    assert not state.kill(5, 9, "no such rank")


async def test_end_begun_wakes_waiters() -> None:
    state = GroupState("g", 1)
    seen = state.wakeup.version
    waiter = asyncio.ensure_future(state.wakeup.changed(seen))
    state.end_begun()
    await asyncio.wait_for(waiter, 1)
    assert state.ending


class _Target:
    """A ControlTarget over fixed data: the commands' side of the protocol."""

    name = "svc"
    log_dir = "/logs"

    def __init__(self) -> None:
        self.dumped: list[float] = []

    def status(self) -> list[WorkerStatus]:
        return [WorkerStatus(0, 11, "running", 0, 0.5, 12.0, 1 << 20)]

    async def dump(self, ranks: Sequence[int] | None, timeout: float) -> Dump:
        self.dumped.append(timeout)
        text = 'Current thread 0x1 (most recent call first):\n  File "a.py", line 3 in f\n'
        return Dump(1, {0: text}, {0: "/logs/0/stacks-1.txt"})

    started = 1.5
    metrics_url = None
    earlier = ()

    async def events(self) -> AsyncIterator[Event]:
        yield WorkerStarted(rank=0, time=1.0, pid=11)
        yield GroupStopped(rank=None, time=2.0, failed=False)

    def attach(self, rank: int, timeout: float) -> AbstractAsyncContextManager[Session]:
        raise AssertionError("not attached in these tests")


async def _ask(target: _Target, request: object) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    async for answer in dispatch(target, request):
        assert isinstance(answer, dict)
        out.append(answer)
    return out


async def test_every_answer_carries_the_protocol_version() -> None:
    target = _Target()
    for request in ({"cmd": "status"}, {"cmd": "help"}, {"cmd": "nope"}, [1], {"x": 1}):
        answers = await _ask(target, request)
        assert len(answers) == 1 and answers[0]["v"] == PROTOCOL_VERSION, request
    (status,) = await _ask(target, {"cmd": "status"})
    assert status["ok"] is True and status["name"] == "svc"
    assert status["workers"] == [WorkerStatus(0, 11, "running", 0, 0.5, 12.0, 1 << 20).to_json()]
    (bad,) = await _ask(target, {"cmd": "nope"})
    assert bad["ok"] is False and "unknown command 'nope'" in str(bad["error"])
    assert "status" in str(bad["error"]) and "stacks" in str(bad["error"])


async def test_help_lists_every_command_with_its_docstring() -> None:
    (answer,) = await _ask(_Target(), {"cmd": "help"})
    commands = answer["commands"]
    assert isinstance(commands, dict) and set(commands) == set(COMMANDS)
    assert commands["stacks"].startswith("Dump every rank's stacks")


@pytest.mark.parametrize("timeout", [math.inf, math.nan, -1, 0, True, "5", None])
async def test_stacks_refuses_a_timeout_that_could_hold_the_dumper(timeout: object) -> None:
    target = _Target()
    (answer,) = await _ask(target, {"cmd": "stacks", "timeout": timeout})
    assert answer["ok"] is False and '"timeout"' in str(answer["error"])
    assert target.dumped == []


async def test_stacks_answers_with_the_verdict() -> None:
    target = _Target()
    (answer,) = await _ask(target, {"cmd": "stacks", "timeout": 2})
    assert answer["ok"] is True and target.dumped == [2.0]
    assert answer["files"] == {"0": "/logs/0/stacks-1.txt"}
    assert answer["verdict"] == "rank 0: f (a.py:3)"


async def test_stacks_takes_a_list_of_ranks() -> None:
    target = _Target()
    (answer,) = await _ask(target, {"cmd": "stacks", "ranks": [0]})
    assert answer["ok"] is True
    for ranks in ([1], [True], "0", [0.0], {"0": 1}):
        (answer,) = await _ask(target, {"cmd": "stacks", "ranks": ranks})
        assert answer["ok"] is False and '"ranks"' in str(answer["error"]), ranks


async def test_events_streams_a_header_then_one_versioned_answer_per_event() -> None:
    answers = await _ask(_Target(), {"cmd": "events"})
    assert [a.get("event") for a in answers] == [None, "started", "group_stopped"]
    assert all(a["ok"] is True and a["v"] == PROTOCOL_VERSION for a in answers)
    assert answers[0]["stream"] == "events" and answers[0]["name"] == "svc"
    assert answers[1]["rank"] == 0 and answers[1]["pid"] == 11 and answers[1]["group"] == "svc"


@pytest.mark.parametrize(
    "request_",
    [
        {"cmd": "attach"},
        {"cmd": "attach", "rank": "2"},
        {"cmd": "attach", "rank": True},
        {"cmd": "attach", "rank": 0, "timeout": 0},
    ],
)
async def test_attach_refuses_a_bad_request_before_taking_the_connection(
    request_: dict[str, object],
) -> None:
    (answer,) = await _ask(_Target(), request_)
    assert answer["ok"] is False and answer["v"] == PROTOCOL_VERSION
