"""A tee'd flood to a console slower than the workers: no line is lost."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import pytest

import aiolaunch
from aiolaunch import Std
from aiolaunch._logs import set_console_hook
from aiolaunch._logs._console import MAX_PENDING, console

# 4 MiB per worker: 32768 lines of 128 bytes, written in 64 KiB blocks.
FLOOD = """
import os, sys
r = int(sys.argv[1])
lines = [b"rank %02d line %06d " % (r, i) for i in range(32768)]
lines = [l + b"x" * (127 - len(l)) + b"\\n" for l in lines]
for i in range(0, len(lines), 512):
    os.write(1, b"".join(lines[i : i + 512]))
"""
N = 16
LINES = 32768


@pytest.mark.timeout(300)
async def test_flood_to_a_slow_console_shows_every_line_in_order(tmp_path: Path) -> None:
    """16 workers x 4 MiB tee'd to a console that takes ~20 ms per MiB (slower
    than they write): the workers are not slowed down, the console backlog stays
    bounded, and once ``wait()`` returns the console showed every line of every
    rank exactly once, in order per rank, with no "dropped" marker.
    """
    seen: list[str] = []
    peak = [0]
    lock = threading.Lock()

    def slow_console(stream: TextIO, text: str) -> None:
        peak[0] = max(peak[0], console().backlog)
        time.sleep(0.02 * len(text) / (1 << 20))  # allowed: a slow console
        with lock:
            seen.append(text)

    previous = set_console_hook(slow_console)
    try:
        t0 = time.monotonic()
        async with aiolaunch.start_processes(
            name="f",
            entrypoint=sys.executable,
            args={r: ("-c", FLOOD, str(r)) for r in range(N)},
            envs={r: {} for r in range(N)},
            log_dir=str(tmp_path / "logs"),
            tee=Std.OUT,
        ) as ctx:
            result = await ctx.wait()
        took = time.monotonic() - t0
    finally:
        set_console_hook(previous)
    assert result is not None and not result.is_failed()
    text = "".join(seen)
    assert "dropped" not in text and "[aiolaunch]" not in text
    per_rank: dict[int, list[int]] = {r: [] for r in range(N)}
    for line in text.splitlines():
        head, _, body = line.partition("]:")
        rank = int(head[len("[f") :])
        assert body.startswith(f"rank {rank:02d} line "), line[:80]
        per_rank[rank].append(int(body.split()[3]))
    for r in range(N):
        assert per_rank[r] == list(range(LINES)), f"rank {r}: {len(per_rank[r])} lines"
        assert Path(result.stdouts[r]).stat().st_size == LINES * 128
    # Bounded: the queue never held much more than the backlog limit (plus
    # the one chunk a follower feeds after checking for room).
    assert peak[0] <= MAX_PENDING + 4 * (1 << 20), peak[0]
    assert peak[0] > MAX_PENDING // 2, "the console never fell behind: the test proves nothing"
    assert took < 240
