"""The console side of tee: line atomicity, progress bars, slow consoles."""

from __future__ import annotations

import asyncio
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import aiolaunch
from _helpers import exited
from aiolaunch import Std


class Terminal:
    """A tiny terminal model: enough of \\r, \\n and ESC[K to see what a user sees."""

    def __init__(self) -> None:
        self.lines: list[list[str]] = [[]]
        self.col = 0

    def feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            ch = text[i]
            if text.startswith("\x1b[K", i):
                del self.lines[-1][self.col :]
                i += 3
                continue
            if ch == "\r":
                self.col = 0
            elif ch == "\n":
                self.lines.append([])
                self.col = 0
            else:
                line = self.lines[-1]
                if self.col < len(line):
                    line[self.col] = ch
                else:
                    line.append(ch)
                self.col += 1
            i += 1

    def screen(self) -> list[str]:
        return ["".join(line).rstrip(" ") for line in self.lines]  # trailing blanks are invisible


class FakeTTY(io.StringIO):
    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.delay = delay

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if self.delay:
            time.sleep(self.delay)
        self.writes.append(s)
        return super().write(s)


PROGRESS = (
    "import sys, time\n"
    "for i in range(300):\n"
    "    sys.stdout.write(f'\\rstep {i:3d}/300'); sys.stdout.flush()\n"
    "    time.sleep(0.001)\n"
    "sys.stdout.write('\\rstep 300/300 done\\n')\n"
    "print('after the bar')\n"
)


async def _run(code: str, tmp_path: Path, n: int = 1, **kw: object) -> aiolaunch.RunProcsResult:
    async with aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args={r: ("-c", code) for r in range(n)},
        envs={r: {} for r in range(n)},
        log_dir=str(tmp_path / "logs"),
        **kw,  # type: ignore[arg-type]
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    return result


async def test_progress_bar_is_not_one_line_per_update(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = await _run(PROGRESS, tmp_path, tee=Std.OUT)
    out = capsys.readouterr().out
    assert out == "[w0]:step 300/300 done\n[w0]:after the bar\n"
    assert Path(result.stdouts[0]).read_bytes().count(b"\r") == 301, "the file keeps every update"


async def test_progress_bar_drawn_in_place_on_a_tty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stdout", tty)
    await _run(PROGRESS, tmp_path, tee=Std.OUT)
    monkeypatch.undo()
    term = Terminal()
    term.feed(tty.getvalue())
    assert [l for l in term.screen() if l] == ["[w0]:step 300/300 done", "[w0]:after the bar"]
    assert len(tty.writes) < 100, f"{len(tty.writes)} writes for 300 updates: not rate-limited"


async def test_worker_lines_do_not_garble_a_parent_tqdm_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tqdm = pytest.importorskip("tqdm")
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stdout", tty)
    code = "for i in range(20): print(f'worker line {i}')"
    bar = tqdm.tqdm(total=10, file=tty, desc="parent", mininterval=0, ascii=True)
    try:
        bar.update(3)
        await _run(code, tmp_path, n=2, tee=Std.OUT)
        bar.update(1)
    finally:
        bar.close()
        monkeypatch.undo()
    term = Terminal()
    term.feed(tty.getvalue())
    lines = [l for l in term.screen() if l]
    worker_lines = [l for l in lines if "worker line" in l]
    assert len(worker_lines) == 40
    assert all(re.fullmatch(r"\[w[01]\]:worker line \d+", l) for l in worker_lines), worker_lines
    assert lines[-1].startswith("parent:"), "the bar is redrawn below the worker lines"


async def test_lines_of_different_workers_never_mix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each worker writes lines in two halves with a pause between: the prefix
    # must never land mid-line and halves of different workers must not mix.
    code = (
        "import sys, time\n"
        "for i in range(30):\n"
        "    sys.stdout.write(f'begin-{i}-'); sys.stdout.flush(); time.sleep(0.001)\n"
        "    sys.stdout.write(f'end-{i}\\n'); sys.stdout.flush()\n"
    )
    await _run(code, tmp_path, n=4, tee=Std.OUT)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 120
    for line in lines:
        assert re.fullmatch(r"\[w[0-3]\]:begin-(\d+)-end-\1", line), line


async def test_slow_console_does_not_stall_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = FakeTTY(delay=0.05)
    monkeypatch.setattr(sys, "stdout", slow)
    code = "import sys\nfor i in range(3000): print(f'line {i}')"
    async with aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args={0: ("-c", code)},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        tee=Std.OUT,
    ) as ctx:
        t0 = time.monotonic()
        await asyncio.wait_for(exited(ctx, 0), 10)
        worker_time = time.monotonic() - t0
        result = await ctx.wait()
    monkeypatch.undo()
    assert result is not None
    assert worker_time < 5, "the worker was throttled by the console"
    expected = "".join(f"line {i}\n" for i in range(3000))
    assert Path(result.stdouts[0]).read_text() == expected
    term = Terminal()
    term.feed(slow.getvalue())
    assert [l for l in term.screen() if l] == [f"[w0]:line {i}" for i in range(3000)]


NICENESS_PROBE = """
import asyncio, os, sys, threading
import aiolaunch
os.nice(int(sys.argv[1]))  # Linux: this thread's niceness, inherited by threads it starts

async def main():
    async with aiolaunch.start_processes(
        name="n", entrypoint=sys.executable, args={0: ("-c", "print('hi')")}, envs={0: {}},
        tee=aiolaunch.Std.OUT,
    ) as ctx:
        await ctx.wait()
    console = [t for t in threading.enumerate() if t.name == "aiolaunch-console"]
    assert len(console) == 1, console
    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    them = os.getpriority(os.PRIO_PROCESS, console[0].native_id)
    print("niceness", me, them, file=sys.stderr)

asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
@pytest.mark.parametrize(("start", "console"), [(0, 10), (5, 15), (15, 19)])
def test_the_console_thread_runs_nicer_than_the_supervisor(
    tmp_path: Path, start: int, console: int
) -> None:
    """Copying lines to the console yields the CPU to the workers (#26): the
    console thread is 10 nicer than the thread that started it, capped at
    19 - never less nice than the supervisor, also one started under nice."""
    if os.getpriority(os.PRIO_PROCESS, 0) != 0:
        pytest.skip("the test process itself runs under nice")
    p = subprocess.run(
        [sys.executable, "-c", NICENESS_PROBE, str(start)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert "[n0]:hi" in p.stdout
    assert f"niceness {start} {console}" in p.stderr, p.stderr


async def test_unredirected_output_reaches_a_python_level_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Under capsys (as in a notebook) sys.stdout is not fd 1: output must be
    # carried to it, unprefixed and unchanged.
    code = "import sys; sys.stdout.write('plain\\npartial'); sys.stderr.write('e\\n')"
    await _run(code, tmp_path)
    out, err = capsys.readouterr()
    assert out == "plain\npartial"
    assert err == "e\n"


async def test_local_ranks_filter_limits_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = aiolaunch.DefaultLogsSpecs(log_dir=str(tmp_path), tee=Std.OUT, local_ranks_filter={1})
    async with aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args={r: ("-c", f"print('hello from {r}')") for r in range(3)},
        envs={r: {} for r in range(3)},
        logs_specs=specs,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    assert capsys.readouterr().out == "[w1]:hello from 1\n"
    for r in range(3):
        assert Path(result.stdouts[r]).read_text() == f"hello from {r}\n"
        assert re.search(rf"test_run_id_[^/]+/attempt_0/{r}/stdout\.log$", result.stdouts[r])


async def test_overlong_line_goes_out_in_prefixed_pieces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = "print('a' * 200000)"
    await _run(code, tmp_path, tee=Std.OUT)
    lines = capsys.readouterr().out.splitlines()
    assert all(l.startswith("[w0]:") for l in lines)
    assert "".join(l[len("[w0]:") :] for l in lines) == "a" * 200000
    assert len(lines) == 4


async def test_invalid_utf8_replaced_on_console_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = "import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe bytes\\n')"
    result = await _run(code, tmp_path, tee=Std.OUT)
    assert capsys.readouterr().out == "[w0]:ok \ufffd\ufffd bytes\n"
    assert Path(result.stdouts[0]).read_bytes() == b"ok \xff\xfe bytes\n"


async def test_console_dedup_merges_identical_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = (
        "import os, sys\n"
        "r = os.environ['R']\n"
        "print('loading data')\n"
        "print(f'rank {r} shard')\n"
        "print('epoch 1 done')\n"
    )
    async with aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args={r: ("-c", code) for r in range(4)},
        envs={r: {"R": str(r)} for r in range(4)},
        log_dir=str(tmp_path),
        tee=Std.OUT,
        console_dedup=5.0,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    lines = capsys.readouterr().out.splitlines()
    assert lines.count("[w0-3]:loading data") == 1
    assert lines.count("[w0-3]:epoch 1 done") == 1
    assert sorted(l for l in lines if "shard" in l) == [f"[w{r}]:rank {r} shard" for r in range(4)]
    # each rank's own order is kept
    assert lines.index("[w0-3]:loading data") < lines.index("[w0-3]:epoch 1 done")
    for r in range(4):
        assert (
            Path(result.stdouts[r]).read_text() == f"loading data\nrank {r} shard\nepoch 1 done\n"
        )


def test_rank_ranges() -> None:
    from aiolaunch._logs._dedup import rank_ranges as _rank_ranges

    assert _rank_ranges({0, 1, 2, 3, 6}) == "0-3,6"
    assert _rank_ranges({5}) == "5"
    assert _rank_ranges({1, 3, 4}) == "1,3-4"


def test_dedup_keeps_every_line_and_each_ranks_order() -> None:
    # Property: whatever the interleaving, every rank's lines come out complete
    # and in order, and a merged line names each of its ranks once.
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from aiolaunch._logs import _dedup as _sinks

    events = st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(["a", "b", "c", "d"])), max_size=40
    )

    @settings(max_examples=200, deadline=None)
    @given(events)
    def check(seq: list[tuple[int, str]]) -> None:
        written: list[str] = []

        class Capture:
            def write(self, stream: str, text: str, lossless: bool = False) -> None:
                written.append(text)

        async def run() -> None:
            dedup = _sinks.ConsoleDedup("w", 60)
            for rank, line in seq:
                dedup.add("stdout", rank, [line])
            dedup.flush()

        original = _sinks.console  # type: ignore[attr-defined]
        _sinks.console = Capture  # type: ignore[attr-defined,assignment]
        try:
            asyncio.run(run())
        finally:
            _sinks.console = original  # type: ignore[attr-defined]
        seen: dict[int, list[str]] = {r: [] for r in range(4)}
        for text in "".join(written).splitlines():
            head, line = text.split("]:", 1)
            for part in head[len("[w") :].split(","):
                lo, _, hi = part.partition("-")
                for r in range(int(lo), int(hi or lo) + 1):
                    seen[r].append(line)
        for r in range(4):
            assert seen[r] == [line for rank, line in seq if rank == r]

    check()
