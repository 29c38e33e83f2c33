"""The stream plan, the line tap and sink backpressure, without worker processes.

Pure rules (which route a stream takes) are tested as a table; the readers
(a pump on a real pipe, a follower on a real file) with sinks whose room the
test controls.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

import pytest

from aiolaunch._logs import LineTap, Route, Sink, StreamPump
from aiolaunch._logs._follow import FileFollower
from aiolaunch._logs._inotify import Watches
from aiolaunch._logs._plan import StreamPlanner, StreamTarget, plan_route

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify (Linux)")


@pytest.mark.parametrize(
    ("path", "lines", "direct", "route"),
    [
        ("/x/stdout.log", False, True, Route.FILE),
        ("/x/stdout.log", True, True, Route.FILE),
        ("/x/stdout.log", False, False, Route.PIPE),
        (os.devnull, False, True, Route.DEVNULL),
        (os.devnull, True, True, Route.PIPE),
        ("", True, True, Route.PIPE),
    ],
)
def test_route_of_each_destination(path: str, lines: bool, direct: bool, route: Route) -> None:
    target = StreamTarget(0, "stdout", path, tee=False, lines=lines)
    assert plan_route(target, direct=direct) is route


def test_the_console_is_inherited_only_where_it_is_fd_1(monkeypatch: pytest.MonkeyPatch) -> None:
    target = StreamTarget(0, "stdout", "")
    with open(1, "w", closefd=False) as fd1:
        monkeypatch.setattr(sys, "stdout", fd1)
        assert plan_route(target, direct=True) is Route.INHERIT
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a notebook cell: carried over
    assert plan_route(target, direct=True) is Route.PIPE


class _Listener:
    def __init__(self, reads: bool = False) -> None:
        self.lines: list[tuple[int, str, str]] = []
        self.listening = True
        self._reads = reads

    def reads(self, rank: int, stream: str) -> bool:
        return self._reads and stream == "stdout"

    def wants(self, rank: int, stream: str) -> bool:
        return self.listening

    def line(self, rank: int, stream: str, text: str) -> None:
        self.lines.append((rank, stream, text))


async def test_sinks_of_each_route_are_chosen_in_one_place(tmp_path: Path) -> None:
    tap = LineTap()
    tap.subscribe(_Listener(reads=True))
    planner = StreamPlanner(name="w", tap=tap, prefix={}, dedup_window=None, strip_ansi=False)
    log = str(tmp_path / "stdout.log")
    async with AsyncExitStack() as stack:
        kinds = {}
        for name, target, direct in [
            ("file+tee", planner.target(0, "stdout", log, True), True),
            ("piped file+tee", planner.target(1, "stdout", log, True), False),
            ("console, probed", planner.target(2, "stdout", "", False), True),
            ("devnull, not probed", planner.target(3, "stderr", os.devnull, False), True),
        ]:
            plan = planner.plan(target, direct=direct, stack=stack)
            kinds[name] = (plan.route, [type(s).__name__ for s in plan.sinks])
    assert kinds == {
        "file+tee": (Route.FILE, ["ConsoleSink", "LineSink"]),
        "piped file+tee": (Route.PIPE, ["FileSink", "ConsoleSink", "LineSink"]),
        "console, probed": (Route.PIPE, ["PassthroughSink", "LineSink"]),
        "devnull, not probed": (Route.DEVNULL, []),
    }


async def test_the_tap_feeds_each_listener_only_while_it_wants() -> None:
    tap = LineTap()
    a, b = _Listener(), _Listener()
    tap.subscribe(a)
    rose: list[int] = []
    tap.on_demand(lambda: rose.append(1))
    notify = tap.subscribe(b)
    assert rose == [1]  # a new listener may want lines: followers wake
    sink = tap.sink(3, "stderr")
    sink.feed(b"one\ntw")
    b.listening = False
    sink.feed(b"o\nthree\n")
    a.listening = False
    assert not sink.wanted()
    b.listening = True
    notify()
    assert rose == [1, 1]
    sink.feed(b"four\n")
    await sink.aclose()
    assert a.lines == [(3, "stderr", "one"), (3, "stderr", "two"), (3, "stderr", "three")]
    # b resumed at a line boundary: what went by while nobody wanted is skipped
    assert b.lines == [(3, "stderr", "one"), (3, "stderr", "four")]
    assert tap.reads(3, "stdout") is False


class _Gated(Sink):
    """A sink whose room the test opens and closes."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.open = True
        self._waiters: list[Callable[[], None]] = []

    def feed(self, data: bytes) -> None:
        self.data += data

    def room(self) -> bool:
        return self.open

    def when_room(self, callback: Callable[[], None]) -> None:
        self._waiters.append(callback)

    def set_open(self, value: bool) -> None:
        self.open = value
        if value:
            waiters, self._waiters = self._waiters, []
            for cb in waiters:
                cb()


async def test_a_sink_without_room_pauses_the_pipe() -> None:
    r, w = os.pipe()
    gated = _Gated()
    pump = await StreamPump.open(r, [gated])
    pump.start()
    os.set_blocking(w, False)
    gated.set_open(False)
    os.write(w, b"x" * 1000)
    for _ in range(100):
        if gated.data:
            break
        await asyncio.sleep(0.01)
    assert bytes(gated.data) == b"x" * 1000
    # No room: the pump reads nothing more, so the pipe fills and the writer blocks.
    written = 0
    while True:
        try:
            written += os.write(w, b"y" * 65536)
        except BlockingIOError:
            break
    await asyncio.sleep(0.05)
    assert len(gated.data) == 1000
    gated.set_open(True)
    os.close(w)
    await asyncio.wait_for(pump.eof.wait(), 10)
    await pump.drain()
    assert bytes(gated.data) == b"x" * 1000 + b"y" * written


@linux
async def test_a_follower_sink_without_room_falls_behind_and_catches_up(tmp_path: Path) -> None:
    watches = Watches()
    path = tmp_path / "stdout.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    slow, fast = _Gated(), _Gated()
    follower = FileFollower(fd, [slow, fast], 0, watches, LineTap())
    try:
        follower.start()
        slow.set_open(False)
        chunks = [b"%06d\n" % i * 1000 for i in range(20)]
        for chunk in chunks[:10]:
            os.write(fd, chunk)
        expected = b"".join(chunks)
        for _ in range(500):
            if len(fast.data) >= len(b"".join(chunks[:10])):
                break
            await asyncio.sleep(0.01)
        # the other sink went on while this one had no room
        assert bytes(fast.data) == b"".join(chunks[:10])
        assert len(slow.data) < len(fast.data)
        slow.set_open(True)
        for chunk in chunks[10:]:
            os.write(fd, chunk)
        await follower.drain()
        assert bytes(fast.data) == expected
        assert bytes(slow.data) == expected
    finally:
        os.close(fd)
        await follower.abandon()
        watches.close()
