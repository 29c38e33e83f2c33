"""Binary workers: start, exit detection, fail-fast, logs, env, close."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import aiolaunch
from _helpers import alive, driver
from aiolaunch import Std

if TYPE_CHECKING:
    from collections.abc import Sequence

SH = "/bin/sh"


def sh(n: int, script: str) -> dict[int, tuple[str, ...]]:
    return {r: ("-c", script) for r in range(n)}


def no_env(n: int) -> dict[int, dict[str, str]]:
    return {r: {} for r in range(n)}


async def test_success_returns_none_values_and_logs(tmp_path: Path) -> None:
    ctx = await aiolaunch.start_processes(
        name="t",
        entrypoint=SH,
        args=sh(3, 'echo "out $RANK"; echo "err $RANK" >&2'),
        envs={r: {"RANK": str(r)} for r in range(3)},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
    )
    assert isinstance(ctx, aiolaunch.SubprocessContext)
    assert sorted(ctx.pids()) == [0, 1, 2]
    result = await ctx.wait()
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: None, 1: None, 2: None}
    for r in range(3):
        assert Path(result.stdouts[r]).read_bytes() == f"out {r}\n".encode()
        assert Path(result.stderrs[r]).read_bytes() == f"err {r}\n".encode()
        assert result.stdouts[r] == str(tmp_path / "logs" / str(r) / "stdout.log")
    await ctx.close()  # a no-op after a result


async def test_args_are_cast_with_str_and_env_has_error_file(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="t",
        entrypoint=sys.executable,
        args={
            0: (
                "-c",
                "import os,sys; print(sys.argv[1:], os.environ['TORCHELASTIC_ERROR_FILE'], os.environ['X'], os.environ.get('HOME') is not None)",
                7,
                2.5,
            )
        },
        envs={0: {"X": "y"}},
        log_dir=str(tmp_path),
        redirects=Std.OUT,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    out = Path(result.stdouts[0]).read_text()
    assert out == f"['7', '2.5'] {tmp_path / '0' / 'error.json'} y True\n"


async def test_exit_noticed_although_grandchild_holds_pipe(tmp_path: Path) -> None:
    # gh-119710: asyncio's Process.wait() waits for pipe EOF; we must not.
    script = "sleep 30 & echo started; exit 0"
    t0 = time.monotonic()
    async with aiolaunch.start_processes(
        name="t",
        entrypoint=SH,
        args=sh(1, script),
        envs=no_env(1),
        log_dir=str(tmp_path),
        redirects=Std.ALL,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 10)
    assert time.monotonic() - t0 < 5, "wait() waited for the grandchild's pipe"
    assert result is not None and not result.is_failed()
    assert Path(result.stdouts[0]).read_text() == "started\n"


async def test_first_failure_stops_the_others(tmp_path: Path) -> None:
    args = {0: ("-c", "exit 3"), 1: ("-c", "exec sleep 60"), 2: ("-c", "exec sleep 60")}
    ctx = await aiolaunch.start_processes(
        name="t",
        entrypoint=SH,
        args=args,
        envs=no_env(3),
        log_dir=str(tmp_path),
        shutdown_timeout=5,
    )
    t0 = time.monotonic()
    result = await asyncio.wait_for(ctx.wait(), 20)
    assert time.monotonic() - t0 < 5
    assert result is not None and result.is_failed()
    assert list(result.failures) == [0], "workers stopped on purpose are not failures"
    failure = result.failures[0]
    assert failure.exitcode == 3 and failure.local_rank == 0
    assert failure.pid == ctx.pids()[0]
    for pid in ctx.pids().values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_killed_by_signal_is_negative_exitcode(tmp_path: Path) -> None:
    ctx = await aiolaunch.start_processes(
        name="t",
        entrypoint=SH,
        args=sh(1, "kill -SEGV $$"),
        envs=no_env(1),
        log_dir=str(tmp_path),
    )
    result = await asyncio.wait_for(ctx.wait(), 10)
    assert result is not None
    failure = result.failures[0]
    assert failure.exitcode == -signal.SIGSEGV
    assert failure.signal_name() == "SIGSEGV"
    assert "SIGSEGV" in failure.message


async def test_wait_timeout_and_poll(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="t",
        entrypoint=SH,
        args=sh(2, "exec sleep 60"),
        envs=no_env(2),
        log_dir=str(tmp_path),
    ) as ctx:
        assert await ctx.wait(0) is None
        t0 = time.monotonic()
        assert await ctx.wait(timeout=0.2, period=5) is None
        assert 0.15 < time.monotonic() - t0 < 3
        assert all(alive(p) for p in ctx.pids().values())


async def test_cancelling_wait_stops_waiting_only(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="t",
        entrypoint=SH,
        args=sh(2, "exec sleep 60"),
        envs=no_env(2),
        log_dir=str(tmp_path),
    ) as ctx:
        task = asyncio.ensure_future(ctx.wait())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(alive(p) for p in ctx.pids().values())
    assert not any(alive(p) for p in ctx.pids().values())


async def test_leaving_async_with_by_exception_closes(tmp_path: Path) -> None:
    pids: dict[int, int] = {}
    with pytest.raises(RuntimeError, match="boom"):  # noqa: PT012 - the block is the subject
        async with aiolaunch.start_processes(
            name="t",
            entrypoint=SH,
            args=sh(2, "exec sleep 60"),
            envs=no_env(2),
            log_dir=str(tmp_path),
        ) as ctx:
            pids = ctx.pids()
            raise RuntimeError("boom")
    assert pids and not any(alive(p) for p in pids.values())


async def test_leaving_async_with_by_cancellation_closes(tmp_path: Path) -> None:
    pids: dict[int, int] = {}
    started = asyncio.Event()

    async def body() -> None:
        nonlocal pids
        async with aiolaunch.start_processes(
            name="t",
            entrypoint=SH,
            args=sh(2, "exec sleep 60"),
            envs=no_env(2),
            log_dir=str(tmp_path),
        ) as ctx:
            pids = ctx.pids()
            started.set()
            await ctx.wait()

    task = asyncio.ensure_future(body())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pids and not any(alive(p) for p in pids.values())


async def test_close_escalates_to_sigkill_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = "trap '' TERM; echo ready; while :; do sleep 1; done"
    ctx = await aiolaunch.start_processes(
        name="t",
        entrypoint=SH,
        args=sh(1, script),
        envs=no_env(1),
        log_dir=str(tmp_path),
        redirects=Std.OUT,
    )
    await _wait_for_file(Path(ctx.stdouts[0]), b"ready\n")
    pid = ctx.pids()[0]
    caplog.set_level(logging.WARNING, logger="aiolaunch")
    t0 = time.monotonic()
    await ctx.close(timeout=0.3)
    assert time.monotonic() - t0 < 5
    assert not alive(pid)
    assert any(
        f"pid {pid}" in r.getMessage() and "SIGKILL" in r.getMessage() for r in caplog.records
    )
    await ctx.close()  # idempotent


async def test_close_kills_grandchildren_in_other_sessions(tmp_path: Path) -> None:
    # The grandchild calls setsid(): it leaves the worker's process group, but
    # is still a descendant when close() looks.
    code = (
        "import os, subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    ctx = await aiolaunch.start_processes(
        name="t",
        entrypoint=sys.executable,
        args={0: ("-c", code)},
        envs=no_env(1),
        log_dir=str(tmp_path),
        redirects=Std.OUT,
    )
    data = await _wait_for_file(Path(ctx.stdouts[0]), b"\n")
    grandchild = int(data.split()[0])
    assert alive(grandchild)
    await ctx.close(timeout=2)
    assert not alive(grandchild)


async def test_log_files_hold_exact_bytes(tmp_path: Path) -> None:
    payload = b"\xff\xfe bad utf8 \x00 nul\r\nprogress 1\rprogress 2\rlast line no newline"
    code = f"import sys; sys.stdout.buffer.write({payload!r}); sys.stderr.buffer.write({payload!r})"
    async with aiolaunch.start_processes(
        name="t",
        entrypoint=sys.executable,
        args={0: ("-c", code)},
        envs=no_env(1),
        log_dir=str(tmp_path),
        redirects=Std.ALL,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    assert Path(result.stdouts[0]).read_bytes() == payload
    assert Path(result.stderrs[0]).read_bytes() == payload


async def test_big_output_is_complete(tmp_path: Path) -> None:
    # 8 MB on one line plus many small lines: nothing lost, nothing reordered.
    code = (
        "import sys\n"
        "sys.stdout.write('x' * (8 << 20) + '\\n')\n"
        "for i in range(20000): sys.stdout.write(f'line {i}\\n')\n"
    )
    async with aiolaunch.start_processes(
        name="t",
        entrypoint=sys.executable,
        args={0: ("-c", code)},
        envs=no_env(1),
        log_dir=str(tmp_path),
        redirects=Std.OUT,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    expected = "x" * (8 << 20) + "\n" + "".join(f"line {i}\n" for i in range(20000))
    assert Path(result.stdouts[0]).read_text() == expected


async def test_tee_prefixes_whole_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = (
        "import sys, time\n"
        "sys.stdout.write('first ha'); sys.stdout.flush(); time.sleep(0.05)\n"
        "sys.stdout.write('lf\\nsecond\\n'); sys.stdout.flush()\n"
        "sys.stderr.write('to err\\n')\n"
        "sys.stdout.write('tail')\n"
    )
    async with aiolaunch.start_processes(
        name="trainer",
        entrypoint=sys.executable,
        args={0: ("-c", code), 1: ("-c", code)},
        envs=no_env(2),
        log_dir=str(tmp_path),
        tee={0: Std.ALL, 1: Std.OUT},
        log_line_prefixes={1: "<one> "},
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert sorted(lines) == sorted(
        [
            "[trainer0]:first half",
            "[trainer0]:second",
            "[trainer0]:tail",
            "<one> first half",
            "<one> second",
            "<one> tail",
        ]
    )
    assert "[trainer0]:to err\n" in err
    assert Path(result.stdouts[0]).read_bytes() == b"first half\nsecond\ntail"
    assert result.stderrs[1] == "", "rank 1's stderr is not redirected"
    assert "to err\n" in err.replace("[trainer0]:to err\n", "")


async def _wait_for_file(path: Path, needle: bytes, timeout: float = 10) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            data = path.read_bytes()
            if needle in data:
                return data
        await asyncio.sleep(0.01)
    pytest.fail(f"{path} never contained {needle!r}")


async def test_instant_failures_are_never_missed(tmp_path: Path) -> None:
    # Regression: a worker that exits while the context is still wiring its
    # pipes must still count (the exit callback is attached after the spawn).
    for attempt in range(5):
        async with aiolaunch.start_processes(
            name="t",
            entrypoint="/bin/false",
            args={r: () for r in range(8)},
            envs={r: {} for r in range(8)},
            log_dir=str(tmp_path / str(attempt)),
            redirects=Std.ALL,
        ) as ctx:
            result = await asyncio.wait_for(ctx.wait(), 10)
        assert result is not None and result.is_failed()
        assert all(f.exitcode == 1 for f in result.failures.values())


async def test_a_killed_guardian_is_replaced(tmp_path: Path) -> None:
    from aiolaunch._workers import _guardian

    async with aiolaunch.start_processes(
        name="t",
        entrypoint=SH,
        args=sh(1, "exit 0"),
        envs=no_env(1),
        log_dir=str(tmp_path / "a"),
    ) as ctx:
        await ctx.wait()
    guard = _guardian.guardian()
    assert guard is not None
    old = guard.pid
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive(old) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    async with aiolaunch.start_processes(
        name="t",
        entrypoint=SH,
        args=sh(1, "exit 0"),
        envs=no_env(1),
        log_dir=str(tmp_path / "b"),
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    # The group's lines go out in one batch, WATCH_DELAY after the first:
    # that write finds the pipe broken and starts a new guardian.
    deadline = time.monotonic() + 5
    while guard.pid == old and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert guard.pid != old and alive(guard.pid), "a new guardian took over"
    with pytest.raises(ChildProcessError):
        os.waitpid(old, os.WNOHANG)  # the old one was reaped, not left a zombie


GUARDIAN_BATCHES = """
import asyncio
from aiolaunch._workers import _guardian as G

g = G.guardian()
sent = []
send = g._send
g._send = lambda text: (sent.append(text), send(text))


async def first():
    g.watch(32769)  # above pid_max: never a real group


asyncio.run(first())  # ends before WATCH_DELAY: the line is still queued
assert sent == [] and g._pending, (sent, g._pending)


async def second():
    g.unwatch(32769)
    assert sent == [], f"sent on the path of the start that queued a line: {sent}"
    await asyncio.sleep(G.WATCH_DELAY * 5)
    assert sent == ["+32769\\n-32769\\n"], sent


asyncio.run(second())


async def third():
    g.watch(32770)


asyncio.run(third())
assert g._pending
G._flush_at_exit(g)  # what atexit runs: before the pipe's EOF
assert sent[-1] == "+32770\\n" and not g._pending, (sent, g._pending)
g.unwatch(32770)
print("ok", flush=True)
"""


def test_guardian_lines_of_an_ended_loop_go_with_the_next_batch_or_at_exit() -> None:
    """Lines still queued when an ``asyncio.run()`` ended are sent with the
    next loop's batch - not at once, on the path of the start that queues the
    next line - and whatever is queued at exit goes before the pipe's EOF."""
    with driver([sys.executable, "-c", GUARDIAN_BATCHES]) as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "ok"


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd on this platform")
async def test_binaries_are_reaped_through_pidfds_not_a_thread_each() -> None:
    """32 binaries: no reaper thread per child (asyncio's ThreadedChildWatcher
    names them ``asyncio-waitpid-N``), each exit code still right, and every child reaped.
    """
    import threading

    n = 32
    before = threading.active_count()
    async with aiolaunch.start_processes(
        name="p",
        entrypoint=SH,
        args={r: ("-c", f"sleep 0.5; exit {r % 2}") for r in range(n)},
        envs=no_env(n),
    ) as ctx:
        waiters = [t.name for t in threading.enumerate() if "waitpid" in t.name]
        assert waiters == []
        assert threading.active_count() < before + 4
        pids = ctx.pids()
        result = await ctx.wait()
    assert result is not None and result.is_failed()
    assert {f.exitcode for f in result.failures.values()} <= {1}
    for pid in pids.values():
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # already reaped: not our child any more


async def test_each_start_sees_the_supervisors_environment_of_that_moment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The parent environment's copy is reused between spawns; a change made in
    # between must still reach the next worker (and a removed variable leave).
    seen = []
    for value in ("one", "two", None):
        if value is None:
            monkeypatch.delenv("AIOLAUNCH_T_ENV")
        else:
            monkeypatch.setenv("AIOLAUNCH_T_ENV", value)
        log_dir = tmp_path / str(value)
        log_dir.mkdir()
        ctx = await aiolaunch.start_processes(
            name="t",
            entrypoint=SH,
            args=sh(2, 'printf %s "${AIOLAUNCH_T_ENV-unset}"'),
            envs=no_env(2),
            log_dir=str(log_dir),
            redirects=Std.OUT,
        )
        result = await ctx.wait()
        assert result is not None and not result.is_failed()
        seen.append([Path(result.stdouts[r]).read_text() for r in range(2)])
    assert seen == [["one", "one"], ["two", "two"], ["unset", "unset"]]


async def test_environment_bytes_reach_the_worker_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The environment is handed to the spawn encoded: a parent variable that is
    # not UTF-8 arrives byte for byte, and envs[rank] (non-ASCII included)
    # overrides a parent variable of the same name.
    os.environb[b"AIOLAUNCH_T_RAW"] = b"caf\xe9\xff"
    monkeypatch.setenv("AIOLAUNCH_T_OVER", "parent")
    try:
        ctx = await aiolaunch.start_processes(
            name="t",
            entrypoint=SH,
            args=sh(2, 'printf "%s|%s" "$AIOLAUNCH_T_RAW" "$AIOLAUNCH_T_OVER"'),
            envs={r: {"AIOLAUNCH_T_OVER": f"r\u00e9{r}"} for r in range(2)},
            log_dir=str(tmp_path / "logs"),
            redirects=Std.OUT,
        )
        result = await ctx.wait()
    finally:
        del os.environb[b"AIOLAUNCH_T_RAW"]
    assert result is not None and not result.is_failed()
    for r in range(2):
        assert Path(result.stdouts[r]).read_bytes() == b"caf\xe9\xff|r\xc3\xa9" + str(r).encode()


def test_guardian_kills_only_the_groups_still_registered_after_many_changes() -> None:
    # The guardian script itself, fed as the supervisor feeds it: 300 groups
    # registered and unregistered (its list is compacted on the way), one
    # live group left registered and one live group unregistered. At EOF the
    # first is SIGKILLed, the second left alone.
    import subprocess

    from aiolaunch._workers._guardian import _SCRIPT

    kept = subprocess.Popen(["sleep", "60"], start_new_session=True)
    freed = subprocess.Popen(["sleep", "60"], start_new_session=True)
    guard = subprocess.Popen(
        ["/bin/sh", "-c", _SCRIPT, "t", "no-such-token"], stdin=subprocess.PIPE
    )
    try:
        fake = range(4_000_000, 4_000_300)  # above pid_max's default: never real
        lines = [f"+{p}\n" for p in fake] + [f"+{kept.pid}\n", f"+{freed.pid}\n"]
        lines += [f"-{p}\n" for p in fake] + [f"-{freed.pid}\n"]
        assert guard.stdin is not None
        guard.stdin.write("".join(lines).encode())
        guard.stdin.close()  # EOF: the supervisor "died"
        assert kept.wait(timeout=30) == -signal.SIGKILL
        guard.wait(timeout=30)
        assert freed.poll() is None
    finally:
        for p in (kept, freed, guard):
            if p.poll() is None:
                p.kill()
            p.wait()


async def test_close_scans_for_escaped_daemons_only_where_one_may_have_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token scan (one read of ``/proc/<pid>/environ`` per process born
    since the first worker, machine-wide) runs in ``close()`` only where a
    descendant may have left the workers' trees (#26): not for workers that
    never lost a child, yes once one of them reaped one."""
    from aiolaunch import _terminate

    scans: list[str] = []
    real = _terminate._scan_tagged

    async def spy(token: str, since: int, exclude: Sequence[int]) -> set[int]:
        scans.append(token)
        return await real(token, since, exclude)

    monkeypatch.setattr(_terminate, "_scan_tagged", spy)
    quiet = ("-c", "echo ready; exec sleep 30")
    reaper = ("-c", "sh -c true; echo ready; sleep 30")  # reaps a child, then waits
    for args, scanned in (({0: quiet, 1: quiet}, False), ({0: quiet, 1: reaper}, True)):
        scans.clear()
        async with aiolaunch.start_processes(
            "s",
            "/bin/sh",
            args,
            {0: {}, 1: {}},
            log_dir=tmp_path / str(scanned),
            redirects=Std.OUT,
        ) as ctx:
            for rank in (0, 1):
                await _wait_for_text(ctx.stdouts[rank], "ready")
            pids = ctx.pids()
            await ctx.close(timeout=5)
        assert bool(scans) is scanned, (args, scans)
        assert all(not alive(pid) for pid in pids.values())


async def _wait_for_text(path: str, text: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(path) as f:
            if text in f.read():
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{text!r} never appeared in {path}")


async def test_spawn_gives_the_worker_what_popen_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Binaries start through ``_spawn.spawn`` (#26: Popen's C core without
    Popen's Python), with Popen's semantics: a session of their own,
    SIGPIPE at its default (the supervisor ignores it, as CPython does), an
    inheritable fd of the supervisor closed (``close_fds``), and a bare name
    found on the worker's own ``PATH``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    probe = bindir / "probe-26"
    probe.write_text(
        "#!/bin/sh\n"
        "echo \"sid=$(ps -o sid= -p $$ | tr -d ' ') pid=$$\"\n"
        "grep -E '^SigIgn' /proc/$$/status\n"
        f"ls /proc/$$/fd > {tmp_path}/fds\n"
    )
    probe.chmod(0o755)
    r, w = os.pipe()
    os.set_inheritable(w, True)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ.get('PATH', '')}")
    try:
        async with aiolaunch.start_processes(
            "p", "probe-26", {0: ()}, {0: {}}, log_dir=tmp_path / "logs", redirects=Std.OUT
        ) as ctx:
            result = await ctx.wait()
        assert result is not None and not result.is_failed(), result
        out = Path(result.stdouts[0]).read_text()
    finally:
        os.close(r)
        os.close(w)
    first, sigign = out.splitlines()[:2]
    sid, pid = (int(x.split("=")[1]) for x in first.split())
    assert sid == pid, "the worker leads a session of its own"
    ignored = int(sigign.split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)), "SIGPIPE is back at its default"
    fds = {int(x) for x in (tmp_path / "fds").read_text().split()}
    assert w not in fds, "an inheritable fd of the supervisor reached the worker"
