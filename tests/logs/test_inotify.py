"""The inotify pieces without processes: the event parser and the group's tick."""

from __future__ import annotations

import asyncio
import itertools
import struct
import sys

import pytest

from aiolaunch._logs import _inotify
from aiolaunch._logs._inotify import HOLD_S, STREAM_TICK_S, Watches

EVENT = struct.Struct("iIII")
IN_MODIFY, IN_Q_OVERFLOW, IN_IGNORED = 0x2, 0x4000, 0x8000


class Each:
    """A ticked file that grew by ``grown`` bytes at every tick; its second
    pass calls ``tick()`` (and records what the others grew by)."""

    def __init__(self, tick, grown: int = 0) -> None:  # type: ignore[no-untyped-def]
        self._tick, self.grown = tick, grown
        self.calls: list[str] = []
        self.others: list[float] = []

    def measure(self) -> int:
        self.calls.append("measure")
        return self.grown

    def tick(self, others: float) -> bool:
        self.calls.append("tick")
        self.others.append(others)
        return bool(self._tick())


def _events(*evs: tuple[int, int, bytes]) -> bytes:
    return b"".join(EVENT.pack(wd, mask, 0, len(name)) + name for wd, mask, name in evs)


def test_parse_gives_each_watch_once() -> None:
    buf = _events(*[(wd, IN_MODIFY, b"") for wd in (3, 1, 3, 2, 1)])
    assert _inotify._parse(buf) == ({1, 2, 3}, False)


def test_parse_sees_an_overflow() -> None:
    buf = _events((4, IN_MODIFY, b""), (-1, IN_Q_OVERFLOW, b""), (5, IN_MODIFY, b""))
    assert _inotify._parse(buf) == ({4, 5}, True)


def test_parse_walks_events_with_names() -> None:
    # Not from a file's watch (a directory's), but parsed, not misread.
    name = b"x.log".ljust(16, b"\0")
    buf = _events((7, IN_MODIFY, name), (8, IN_MODIFY, b""), (-1, IN_Q_OVERFLOW, b""))
    assert _inotify._parse(buf) == ({7, 8}, True)


def test_parse_an_ignored_event_is_its_watch_id() -> None:
    # IN_IGNORED (the watch is gone) names a wd whose callbacks are gone:
    # reported, and harmless to the caller (no callbacks for it).
    assert _inotify._parse(_events((9, IN_IGNORED, b""))) == ({9}, False)


def test_parse_nothing() -> None:
    assert _inotify._parse(b"") == (set(), False)


async def test_repeat_calls_every_callback_on_one_tick_until_false() -> None:
    loop = asyncio.get_running_loop()
    ticks: list[float] = []  # the time of each tick (its first callback)
    calls: dict[str, list[int]] = {"a": [], "b": []}  # the tick of each call

    def first() -> bool:
        ticks.append(loop.time())
        return len(calls["a"]) < 3  # a's fourth call is the last

    def make(name: str, times: int):  # type: ignore[no-untyped-def]
        def tick() -> bool:
            calls[name].append(len(ticks))
            return len(calls[name]) < times

        return tick

    watches = Watches()
    t0 = loop.time()
    watches.repeat(Each(first))
    # A tick that was not running starts HOLD_S from now (a worker's first
    # lines are read that soon), not a whole period later.
    assert watches._tick is not None and watches._tick.when() <= loop.time() + HOLD_S
    watches.repeat(Each(make("a", 4)))
    watches.repeat(Each(make("b", 2)))
    while len(calls["a"]) < 4:
        await asyncio.sleep(HOLD_S)
    await asyncio.sleep(3 * STREAM_TICK_S)
    assert calls == {"a": [1, 2, 3, 4], "b": [1, 2]}  # one tick for all; none after False
    assert len(ticks) == 4
    assert ticks[0] >= t0 + HOLD_S * 0.9
    # then every STREAM_TICK_S: one wakeup per period beside the writers
    assert all(b - a >= STREAM_TICK_S * 0.9 for a, b in itertools.pairwise(ticks))
    # Stopped, then started again by a new callback.
    watches.repeat(Each(make("b", 3)))
    while len(calls["b"]) < 3:
        await asyncio.sleep(HOLD_S)
    watches.close()


async def test_a_callback_may_repeat_itself_again_and_close_stops_all() -> None:
    watches = Watches()
    seen: list[str] = []

    def once() -> bool:
        seen.append("once")
        watches.repeat(Each(again))  # registered from inside a tick
        return False

    def again() -> bool:
        seen.append("again")
        return True

    watches.repeat(Each(once))
    while "again" not in seen:
        await asyncio.sleep(HOLD_S)
    watches.close()
    n = len(seen)
    await asyncio.sleep(5 * STREAM_TICK_S)
    assert len(seen) == n  # closed: nothing ticks


async def test_a_tick_measures_every_file_before_it_tells_each_what_the_others_grew_by() -> None:
    """#26: the group's rate decides whether a file is read behind its
    writer (``_growth``), so every file is measured before any is ticked -
    the order of the files does not matter - and each learns the others'
    growth in the tick's period, bytes per second, not its own."""
    ticks = 0

    def go_on() -> bool:
        nonlocal ticks
        ticks += 1
        return ticks < 6  # three ticks of two files

    quiet, bulk = Each(go_on, 1000), Each(go_on, 3 << 20)
    bulk.calls = quiet.calls  # one record of both, in call order
    watches = Watches()
    watches.repeat(quiet)  # first in the round: measured before bulk's growth is known
    watches.repeat(bulk)
    while ticks < 6:
        await asyncio.sleep(HOLD_S)
    assert quiet.calls == ["measure", "measure", "tick", "tick"] * 3
    # the same period for both: each sees the other's bytes over it
    for q, b in zip(quiet.others, bulk.others, strict=True):
        assert q > 0 and q / b == pytest.approx((3 << 20) / 1000)
    assert max(bulk.others) <= 1000 / (HOLD_S * 0.9)  # a period is HOLD_S or more
    watches.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
async def test_events_after_a_quiet_spell_are_read_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The hold applies while events keep coming: a modification after a
    quiet spell reaches its callback on the loop's next turn, and every
    modification, held or not, reaches it."""
    watches = Watches()
    assert watches.ensure()
    path = tmp_path / "f"
    path.write_bytes(b"")
    got = asyncio.Event()
    count = 0

    def modified() -> None:
        nonlocal count
        count += 1
        got.set()

    watches.watch(str(path), modified)
    with path.open("ab", buffering=0) as f:
        for _ in range(3):
            got.clear()
            f.write(b"x")
            await asyncio.wait_for(got.wait(), 5)
            await asyncio.sleep(5 * HOLD_S)  # quiet
    assert count == 3
    watches.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
async def test_a_modification_lost_to_a_full_queue_is_still_reported(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The kernel's event queue overflows (``IN_Q_OVERFLOW``) while the loop
    does not read it: the modification of a file whose event the kernel
    dropped reaches its callback anyway (every callback is called)."""
    with open("/proc/sys/fs/inotify/max_queued_events") as f:
        limit = int(f.read())
    if limit > 1 << 17:
        pytest.skip(f"max_queued_events is {limit}: too many writes to fill it")
    watches = Watches()
    assert watches.ensure()
    called: set[str] = set()
    paths = {name: tmp_path / name for name in ("a", "b", "late")}
    for name, path in paths.items():
        path.write_bytes(b"")
        watches.watch(str(path), lambda name=name: called.add(name))  # type: ignore[misc]
    # Without a loop turn: a and b alternate (events that do not merge)
    # until the queue is full; then late's event has no room.
    with paths["a"].open("ab", buffering=0) as a, paths["b"].open("ab", buffering=0) as b:
        for _ in range(limit // 2 + 1):
            a.write(b"x")
            b.write(b"x")
    paths["late"].write_bytes(b"x")
    for _ in range(1000):
        if "late" in called:
            break
        await asyncio.sleep(HOLD_S)
    watches.close()
    assert called == {"a", "b", "late"}
