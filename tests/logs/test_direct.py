"""The direct-write path: redirected workers write their log files themselves."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import aiolaunch
from aiolaunch import Std

if TYPE_CHECKING:
    from collections.abc import Callable

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


def _inotify_fds() -> set[str]:
    """This process's inotify instances (fd numbers). An instance is closed
    off the loop, in the log thread pool: a group's may outlive it briefly."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                out.add(fd)
        except OSError:  # the listing's own fd, closed by now
            pass
    return out


@pytest.mark.parametrize(
    ("redirects", "tee", "made"),
    [(Std.NONE, Std.NONE, 0), (Std.ALL, Std.NONE, 0), (Std.NONE, Std.ALL, 1)],
)
async def test_an_inotify_instance_only_where_a_file_is_followed(
    tmp_path: Path, redirects: Std, tee: Std, made: int
) -> None:
    # Output to the console, or to files nobody reads (#26: redirect-only),
    # needs no watch: no fd, no loop reader. A tee follows the files.
    before = _inotify_fds()
    async with aiolaunch.start_processes(
        "i",
        "/bin/sh",
        {r: ("-c", "sleep 30") for r in range(2)},
        {0: {}, 1: {}},
        log_dir=tmp_path,
        redirects=redirects,
        tee=tee,
    ):
        assert len(_inotify_fds() - before) == made
    await _until(lambda: not _inotify_fds() - before, "the group's inotify fd to be closed")


def _inotify_watches(besides: set[str]) -> int:
    """Watches of this process's inotify instances (``inotify wd:`` lines of
    fdinfo), not counting the instances in ``besides``."""
    count = 0
    for fd in _inotify_fds() - besides:
        try:
            with open(f"/proc/self/fdinfo/{fd}") as info:
                count += sum(line.startswith("inotify wd:") for line in info)
        except OSError:  # closed meanwhile
            pass
    return count


# Writes 8 MiB in 1 MiB blocks, then "ready" after GO exists, then sleeps.
STAGED = """
import os, sys, time
block = (b"y" * 127 + b"\\n") * 8192
for _ in range(8):
    os.write(1, block)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
os.write(1, b"late 1\\nlate 2\\n")
time.sleep(60)
"""


async def _until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(3000):
        if cond():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


async def test_a_redirect_only_group_watches_nothing_and_knows_its_output_age(
    tmp_path: Path,
) -> None:
    """#26: nothing needs a redirect-only group's bytes, so no file is watched
    (before: an IN_MODIFY watch per file, a supervisor wakeup per write): no
    inotify instance at all while the worker writes 8 MiB. The output age is
    still right: read from the file's mtime on demand."""
    before = _inotify_fds()
    async with aiolaunch.start_processes(
        name="r",
        entrypoint=sys.executable,
        args={0: ("-c", STAGED, str(tmp_path / "go"))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
    ) as ctx:
        log = Path(ctx.stdouts[0])
        await _until(lambda: log.stat().st_size >= 8 << 20, "the 8 MiB")
        assert not _inotify_fds() - before and _inotify_watches(before) == 0
        age = ctx._logs.last_output(0)
        assert age is not None and 0 <= age < 30
        await asyncio.sleep(0.3)
        later = ctx._logs.last_output(0)
        assert later is not None and later >= age + 0.2
        (tmp_path / "go").touch()
        await _until(lambda: log.stat().st_size > 8 << 20, "the late lines")
        fresh = ctx._logs.last_output(0)
        assert fresh is not None and fresh < later
        assert _inotify_watches(before) == 0
        await ctx.close(timeout=5)


async def test_a_late_lines_consumer_watches_only_while_it_listens(tmp_path: Path) -> None:
    """An ``events(lines=True)`` consumer that arrives later starts the watch
    and gets the lines written from then on; once it stops, the next write
    ends the watch."""
    before = _inotify_fds()
    async with aiolaunch.start_processes(
        name="l",
        entrypoint=sys.executable,
        args={0: ("-c", STAGED, str(tmp_path / "go"))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.OUT,
    ) as ctx:
        log = Path(ctx.stdouts[0])
        await _until(lambda: log.stat().st_size >= 8 << 20, "the 8 MiB")
        assert _inotify_watches(before) == 0
        events = ctx.events(lines=True)
        got: list[str] = []
        async for event in events:
            if not isinstance(event, aiolaunch.LogLine):
                if _inotify_watches(before) == 1 and not (tmp_path / "go").exists():
                    (tmp_path / "go").touch()  # watched now: let the worker go on
                continue
            if event.text.startswith("late"):
                got.append(event.text)
                if len(got) == 2:
                    break
        assert got == ["late 1", "late 2"]
        await events.aclose()  # type: ignore[attr-defined]
        assert _inotify_watches(before) == 1  # no write since: the watch ends at the next one
        await ctx.close(timeout=5)


PROBED = """
import os, sys, time
def after(name):
    while not os.path.exists(name):
        time.sleep(0.01)
after(sys.argv[1] + "/go")
print("server listening on 1234", flush=True)
after(sys.argv[1] + "/more")
print("more output", flush=True)
time.sleep(60)
"""


async def test_a_waiting_probe_watches_its_log_file_until_ready(tmp_path: Path) -> None:
    """A ``ReadyLine`` on a redirected stream: the file is watched while the
    probe waits (it sees its line), and not once it is ready."""
    before = _inotify_fds()
    async with aiolaunch.start_processes(
        name="p",
        entrypoint=sys.executable,
        args={0: ("-c", PROBED, str(tmp_path))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
        ready=aiolaunch.ReadyLine(r"listening on \d+", stream="stdout"),
    ) as ctx:
        # stdout, for the probe, once its first tick found it quiet (a file
        # begins unwatched: _follow's streaming); stderr: nobody
        await _until(lambda: _inotify_watches(before) == 1, "the watch")
        (tmp_path / "go").touch()
        await ctx.wait_ready(timeout=30)
        (tmp_path / "more").touch()
        log = Path(ctx.stdouts[0])
        await _until(lambda: log.read_bytes().endswith(b"more output\n"), "the second line")
        # Ended at the latest by that write (nobody wants the bytes); maybe
        # earlier: print() wrote the first line in two write()s, which can
        # look like a streaming file, whose tick ends when nobody wants it.
        await _until(lambda: _inotify_watches(before) == 0, "the watch to end")
        await ctx.close(timeout=5)
    assert log.read_text() == "server listening on 1234\nmore output\n"


@pytest.mark.parametrize(
    ("redirect", "log"),
    [
        # `>` reopens /proc/self/fd/1 - the log file itself - with O_TRUNC, as
        # under torchrun or `cmd > file` in a shell: a documented limit
        (">", "second\nthird\n"),
        # `>>` appends (the README's advice): nothing is lost
        (">>", "first\nsecond\nthird\n"),
    ],
)
async def test_echo_to_dev_stdout_in_a_redirected_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redirect: str, log: str
) -> None:
    """#27.9: ``echo ... > /dev/stdout`` in a worker truncates its log file (a
    limit of the worker writing its file directly, README *Known limits*);
    the tee goes on after the truncation instead of falling silent."""
    script = (
        f"echo first; while [ ! -e {tmp_path}/go ]; do sleep 0.01; done; "
        f"echo second {redirect} /dev/stdout; echo third"
    )
    async with aiolaunch.start_processes(
        name="t",
        entrypoint="/bin/sh",
        args={0: ("-c", script)},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        tee=Std.OUT,
    ) as ctx:
        await _until(lambda: "first" in capsys.readouterr().out, "the first line on the console")
        (tmp_path / "go").touch()
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    assert Path(result.stdouts[0]).read_text() == log
    assert capsys.readouterr().out.splitlines()[-2:] == ["[t0]:second", "[t0]:third"]


# Writes "i" lines, one write() each, until STOP exists; then "quiet N" and sleeps.
STREAMING = """
import os, sys, time
i = 0
while not os.path.exists(sys.argv[1]):
    for _ in range(100):
        os.write(1, b"%d\\n" % i)
        i += 1
os.write(1, b"quiet %d\\n" % i)
time.sleep(60)
"""


async def test_a_streaming_tee_is_read_without_its_watch_and_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#26: a worker that writes a line per ``write()`` would queue an inotify
    event per write (a cost to the writer, in the kernel): while its file
    keeps growing, the watch is off and the group's tick reads it; once the
    file is quiet, the watch is back. The console has every line in order."""
    before = _inotify_fds()
    stop = tmp_path / "stop"
    async with aiolaunch.start_processes(
        name="s",
        entrypoint=sys.executable,
        args={0: ("-c", STREAMING, str(stop))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        tee=Std.OUT,
    ) as ctx:
        log = Path(ctx.stdouts[0])
        await _until(lambda: log.stat().st_size > 1 << 20, "a MiB of lines")
        await _until(lambda: _inotify_watches(before) == 0, "the watch to come off")
        stop.touch()
        await _until(lambda: b"quiet" in log.read_bytes()[-32:], "the last line")
        await _until(lambda: _inotify_watches(before) == 1, "the watch to come back")
        await ctx.close(timeout=5)
    text = log.read_text().splitlines()
    n = int(text[-1].split()[1])
    assert text == [str(i) for i in range(n)] + [f"quiet {n}"]
    console = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[s0]:")]
    assert console == [f"[s0]:{line}" for line in text]


async def test_many_streaming_writers_at_once_lose_no_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """16 workers writing a line per ``write()`` from their first instant
    (the later spawns hold the loop meanwhile): every line of each reaches
    its file and, in its order, the console."""
    code = "import os\nfor i in range(20000):\n    os.write(1, b'%d\\n' % i)\n"
    async with aiolaunch.start_processes(
        name="m",
        entrypoint=sys.executable,
        args={r: ("-c", code) for r in range(16)},
        envs={r: {} for r in range(16)},
        log_dir=str(tmp_path / "logs"),
        tee=Std.OUT,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    want = [str(i) for i in range(20000)]
    out = capsys.readouterr().out.splitlines()
    for r in range(16):
        assert Path(result.stdouts[r]).read_text().splitlines() == want
        prefix = f"[m{r}]:"
        assert [line[len(prefix) :] for line in out if line.startswith(prefix)] == want
