"""FileFollower without processes: when it reads what a worker wrote."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import TYPE_CHECKING

import pytest

from aiolaunch._logs._follow import FileFollower
from aiolaunch._logs._inotify import Watches
from aiolaunch._logs._sink import Sink
from aiolaunch._logs._tap import LineTap

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the follower needs /proc/self/fd"
)


class Recorder(Sink):
    """Keeps every byte fed, and how many ``feed`` calls brought them."""

    def __init__(self) -> None:
        self.data = b""
        self.feeds = 0

    def feed(self, data: bytes) -> None:
        self.data += data
        self.feeds += 1


async def test_start_leaves_the_first_read_to_the_loops_next_turn(tmp_path: Path) -> None:
    """``start()`` runs inside the spawn loop (after each rank's spawn): what
    the worker wrote by then is read on the loop's next turn - after the
    spawns of the later ranks - not framed inline between two spawns (#26)."""
    fd = os.open(tmp_path / "stdout.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC)
    watches = Watches()
    sink = Recorder()
    follower = FileFollower(fd, [sink], 0, watches, LineTap())
    try:
        written = b"a line of the worker\n" * 50_000  # ~1 MiB before start()
        os.write(fd, written)
        follower.start()
        assert sink.feeds == 0, "start() read the file inline"
        await asyncio.sleep(0)  # one loop turn: the first read is due
        assert sink.data == written
        os.write(fd, b"later\n")
        os.close(fd)
        fd = -1
        await follower.drain()  # the writer is gone: the rest, then the sink closes
        assert sink.data == written + b"later\n"
    finally:
        if fd >= 0:
            os.close(fd)
        watches.close()


async def test_a_follower_closed_before_its_first_read_reads_nothing(tmp_path: Path) -> None:
    """The deferred first read of a follower abandoned in the meantime (its
    worker never ran: a spawn failed part-way) touches neither the closed fd
    nor the sink."""
    fd = os.open(tmp_path / "stdout.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC)
    watches = Watches()
    sink = Recorder()
    follower = FileFollower(fd, [sink], 0, watches, LineTap())
    try:
        os.write(fd, b"x\n" * 100)
        follower.start()
        await follower.abandon()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert sink.feeds == 0
    finally:
        os.close(fd)
        watches.close()
