"""The direct-write path: redirected workers write their log files themselves."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

import aiolaunch
from aiolaunch import Std

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the direct path needs inotify (Linux)"
)

BULK = """
import os, sys
block = (b"y" * 127 + b"\\n") * 8192  # 1 MiB
for _ in range(int(sys.argv[1])):
    os.write(1, block)
"""


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


async def test_redirected_bytes_are_not_copied_through_the_supervisor(tmp_path: Path) -> None:
    """32 MiB redirected and nobody reading (no tee, no probe, no LogLine
    consumer): the file has every byte, and the supervisor read almost none
    of them (``rchar`` counts every byte its read syscalls returned)."""
    before = _rchar()
    async with aiolaunch.start_processes(
        name="d",
        entrypoint=sys.executable,
        args={0: ("-c", BULK, "32")},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.OUT,
    ) as ctx:
        result = await ctx.wait()
    read = _rchar() - before
    assert result is not None and not result.is_failed()
    data = Path(result.stdouts[0]).read_bytes()
    assert data == (b"y" * 127 + b"\n") * 8192 * 32
    assert read < 8 << 20, f"the supervisor read {read} bytes"


async def test_bytes_written_before_sigkill_are_kept(tmp_path: Path) -> None:
    """A worker writes 3 MiB and a marker line, then is SIGKILLed: every byte is in its file."""
    code = BULK + "os.write(1, b'marker\\n')\nimport time\ntime.sleep(60)\n"
    async with aiolaunch.start_processes(
        name="k",
        entrypoint=sys.executable,
        args={0: ("-c", code, "3")},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.OUT,
    ) as ctx:
        log = Path(ctx.stdouts[0])
        expected = (b"y" * 127 + b"\n") * 8192 * 3 + b"marker\n"
        for _ in range(3000):
            if log.stat().st_size >= len(expected):
                break
            await asyncio.sleep(0.01)
        os.kill(ctx.pids()[0], signal.SIGKILL)
        result = await ctx.wait()
    assert result is not None and result.failures[0].exitcode == -signal.SIGKILL
    assert log.read_bytes() == expected


async def test_output_age_per_rank(tmp_path: Path) -> None:
    """``last_output(rank)``: seconds since that rank last wrote (``None`` if never),
    learnt from the file (no polling); it grows while the rank is silent."""
    code = "import sys, time\nif sys.argv[1] == '0': print('hello', flush=True)\ntime.sleep(60)"
    async with aiolaunch.start_processes(
        name="a",
        entrypoint=sys.executable,
        args={0: ("-c", code, "0"), 1: ("-c", code, "1")},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
    ) as ctx:
        for _ in range(3000):
            if Path(ctx.stdouts[0]).stat().st_size:
                break
            await asyncio.sleep(0.01)
        first = ctx._logs.last_output(0)
        assert first is not None and 0 <= first < 30
        assert ctx._logs.last_output(1) is None
        await asyncio.sleep(0.3)
        later = ctx._logs.last_output(0)
        assert later is not None and later >= first + 0.2
        await ctx.close(timeout=5)


def _inotify_fds() -> int:
    fds = os.listdir("/proc/self/fd")
    targets = []
    for fd in fds:
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own fd, closed by now
            pass
    return sum(t == "anon_inode:inotify" for t in targets)


@pytest.mark.parametrize(("redirects", "made"), [(Std.NONE, 0), (Std.ALL, 1)])
async def test_an_inotify_instance_only_where_a_stream_goes_to_a_file(
    tmp_path: Path, redirects: Std, made: int
) -> None:
    # Output to the console needs no output-age watch: no fd, no loop reader.
    before = _inotify_fds()
    async with aiolaunch.start_processes(
        "i", "/bin/sh", {r: ("-c", "sleep 30") for r in range(2)}, {0: {}, 1: {}},
        log_dir=tmp_path, redirects=redirects,
    ):  # fmt: skip
        assert _inotify_fds() - before == made
    assert _inotify_fds() == before
