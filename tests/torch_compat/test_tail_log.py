"""torch's ``test/distributed/elastic/multiprocessing/tail_log_test.py``, ported.

torch tails each worker's log file with a thread (``TailLog``) into a
destination stream; aiolaunch reads the workers' pipes on the event loop and
writes prefixed lines to ``sys.stdout`` (``tee``). The scenarios carry over with
real workers in place of writer threads, and ``capsys`` as the destination:
every line of every writer arrives, with its rank's header or custom prefix.

Not ported: ``test_tail_logfile_error_in_tail_fn`` (a log path that is a
directory makes torch's tail thread log an error; aiolaunch has no tail thread
and refuses such a ``log_dir`` before start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiolaunch
from aiolaunch import Std

if TYPE_CHECKING:
    from pathlib import Path

    import pytest

# writer(): one number per line, 0..MAX-1
WRITER = 'i=0; while [ $i -lt "$MAX" ]; do echo $i; i=$((i+1)); done'


async def _run_writers(
    tmp_path: Path, nprocs: int, count: int, prefixes: dict[int, str] | None = None
) -> None:
    async with aiolaunch.start_processes(
        name="writer",
        entrypoint="/bin/sh",
        args={r: ("-c", WRITER) for r in range(nprocs)},
        envs={r: {"MAX": str(count)} for r in range(nprocs)},
        log_dir=tmp_path,
        tee=Std.OUT,
        log_line_prefixes=prefixes,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()


async def test_tail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nprocs, count = 32, 1000
    await _run_writers(tmp_path, nprocs, count)
    actual: dict[str, set[int]] = {}
    for line in capsys.readouterr().out.splitlines():
        header, num = line.split(":")
        actual.setdefault(header, set()).add(int(num))
    assert len(actual) == nprocs
    assert actual == {f"[writer{i}]": set(range(count)) for i in range(nprocs)}


async def test_tail_with_custom_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nprocs, count = 3, 10
    prefixes = {n: f"[worker{n}][{n}]:" for n in range(nprocs)}
    await _run_writers(tmp_path, nprocs, count, prefixes)
    headers = {line.split(":")[0] for line in capsys.readouterr().out.splitlines()}
    assert len(headers) == nprocs
    for i in range(nprocs):
        assert f"[worker{i}][{i}]" in headers


async def test_tail_no_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # nothing tee'd: nothing on the console, and the group still ends cleanly
    async with aiolaunch.start_processes(
        name="writer",
        entrypoint="/bin/sh",
        args={0: ("-c", WRITER)},
        envs={0: {"MAX": "5"}},
        log_dir=tmp_path,
        redirects=Std.ALL,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    assert capsys.readouterr().out == ""
    assert (tmp_path / "0" / "stdout.log").read_text() == "0\n1\n2\n3\n4\n"


async def test_tail_logfile_never_generates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a tee'd worker that never writes: close() returns, nothing is shown
    ctx = await aiolaunch.start_processes(
        name="writer",
        entrypoint="/bin/sleep",
        args={0: ("30",)},
        envs={0: {}},
        log_dir=tmp_path,
        tee=Std.ALL,
    )
    await ctx.close(timeout=5)
    assert capsys.readouterr().out == ""
    assert (tmp_path / "0" / "stdout.log").read_text() == ""
