"""Orchestration: lifecycle events, readiness probes, restart policies, several groups."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest

import aiolaunch
from _helpers import driver
from aiolaunch import (
    EventsDropped,
    GroupStopped,
    LogLine,
    ReadyFile,
    ReadyLine,
    ReadyPort,
    RestartPolicy,
    WorkerExited,
    WorkerReady,
    WorkerRestarting,
    WorkerStarted,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

SH = "/bin/sh"


async def collect(ctx: aiolaunch.PContext, **kw: object) -> list[aiolaunch.Event]:
    return [e async for e in ctx.events(**kw)]  # type: ignore[arg-type]


async def test_events_in_order_and_replayed(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="e",
        entrypoint=SH,
        args={0: ("-c", "exit 0"), 1: ("-c", "exit 0")},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path),
    ) as ctx:
        live = asyncio.ensure_future(collect(ctx))
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    events = await asyncio.wait_for(live, 5)
    late = await collect(ctx)  # a consumer that starts after the end gets the history
    assert [type(e) for e in late] == [type(e) for e in events]
    kinds = [(type(e).__name__, e.rank) for e in events]
    assert kinds[-1] == ("GroupStopped", None)
    for rank in (0, 1):
        started = kinds.index(("WorkerStarted", rank))
        assert started < kinds.index(("WorkerReady", rank)) < kinds.index(("WorkerExited", rank))
    exits = [e for e in events if isinstance(e, WorkerExited)]
    assert all(e.exitcode == 0 and e.signal is None and not e.stopped for e in exits)
    assert {e.pid for e in exits} == set(ctx.pids().values())
    times = [e.time for e in events]
    assert times == sorted(times)
    stopped = events[-1]
    assert isinstance(stopped, GroupStopped) and not stopped.failed


async def test_exit_by_signal_and_stopped_flag(tmp_path: Path) -> None:
    ctx = await aiolaunch.start_processes(
        name="e",
        entrypoint=SH,
        args={0: ("-c", "kill -KILL $$"), 1: ("-c", "exec sleep 60")},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path),
    )
    result = await ctx.wait()
    assert result is not None and result.is_failed()
    exits = {e.rank: e for e in await collect(ctx) if isinstance(e, WorkerExited)}
    assert exits[0].signal == "SIGKILL" and exits[0].exitcode == -9 and not exits[0].stopped
    assert exits[1].signal == "SIGTERM" and exits[1].stopped


async def test_log_lines_are_opt_in_events(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="e",
        entrypoint=SH,
        args={0: ("-c", "sleep 0.3; echo one; echo two >&2; echo three")},
        envs={0: {}},
        log_dir=str(tmp_path),
        redirects=aiolaunch.Std.ALL,
    ) as ctx:
        with_lines = asyncio.ensure_future(collect(ctx, lines=True))
        without = asyncio.ensure_future(collect(ctx))
        await asyncio.sleep(0)
        await ctx.wait()
    lines = [(e.stream, e.text) for e in await with_lines if isinstance(e, LogLine)]
    assert sorted(lines) == [("stderr", "two"), ("stdout", "one"), ("stdout", "three")]
    assert not [e for e in await without if isinstance(e, LogLine)]


@pytest.mark.parametrize("lines_first", [False, True])
async def test_slow_consumer_is_told_what_it_lost(tmp_path: Path, lines_first: bool) -> None:
    # The worker's 50 lines come after the consumer's first read, or (on a
    # loaded machine, here on purpose) before it: either way the history is
    # replayed whole first, then one EventsDropped and the newest events.
    go = tmp_path / "go"
    code = (
        "import os, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "for i in range(50): print(i)\n"
    )
    log = tmp_path / "logs" / "0" / "stdout.log"
    async with aiolaunch.start_processes(
        name="e",
        entrypoint=sys.executable,
        args={0: ("-c", code)},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=aiolaunch.Std.OUT,
    ) as ctx:
        it = ctx.events(lines=True, maxsize=5).__aiter__()
        if lines_first:
            go.touch()
            with anyio.fail_after(30):
                while not (log.exists() and log.read_text().count("\n") == 50):
                    await asyncio.sleep(0.01)
        first = await it.__anext__()  # subscribe, then fall behind
        go.touch()
        await ctx.wait()
        rest = [e async for e in it]
    assert isinstance(first, WorkerStarted)
    drops = [i for i, e in enumerate(rest) if isinstance(e, EventsDropped)]
    assert len(drops) == 1, rest
    replayed, after = rest[: drops[0]], rest[drops[0] + 1 :]
    # the rest of the history, whole: lifecycle events only
    assert all(isinstance(e, WorkerReady | WorkerExited) for e in replayed), replayed
    assert rest[drops[0]].count > 0  # type: ignore[attr-defined]
    assert len(after) <= 5 and isinstance(after[-1], GroupStopped), after


async def test_wait_ready_on_a_log_line(tmp_path: Path) -> None:
    code = "import time; time.sleep(0.2); print('server listening on 1234', flush=True); time.sleep(60)"
    async with aiolaunch.start_processes(
        name="s",
        entrypoint=sys.executable,
        args={0: ("-c", code), 1: ("-c", code)},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path),
        ready=ReadyLine(r"listening on \d+"),
    ) as ctx:
        with pytest.raises(TimeoutError):
            await ctx.wait_ready(timeout=0.05)
        await ctx.wait_ready(timeout=20)
        ready = [e for e in await _history(ctx) if isinstance(e, WorkerReady)]
        assert sorted(e.rank or 0 for e in ready) == [0, 1]


async def test_wait_ready_on_a_port_and_a_file(tmp_path: Path) -> None:
    port = aiolaunch.free_port()
    server = f"import http.server as h; h.HTTPServer(('127.0.0.1', {port}), h.BaseHTTPRequestHandler).serve_forever()"
    flag = tmp_path / "flag"
    toucher = f"import time, pathlib; time.sleep(0.1); pathlib.Path({str(flag)!r}).touch(); time.sleep(60)"
    async with aiolaunch.start_processes(
        name="s",
        entrypoint=sys.executable,
        args={0: ("-c", server), 1: ("-c", toucher)},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path / "logs"),
        ready={0: ReadyPort(port), 1: ReadyFile(flag)},
    ) as ctx:
        await ctx.wait_ready(timeout=20)
        assert flag.exists()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await writer.wait_closed()


async def test_dying_before_ready_fails_the_wait(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="s",
        entrypoint=SH,
        args={0: ("-c", "echo starting; exit 4")},
        envs={0: {}},
        log_dir=str(tmp_path),
        ready=ReadyLine("never printed"),
    ) as ctx:
        with pytest.raises(aiolaunch.ChildFailedError) as info:
            await ctx.wait_ready(timeout=20)
    assert info.value.failures[0].exitcode == 4


class _BrokenProbe(aiolaunch.ReadinessProbe):
    async def wait_ready(self, rank: int, lines: object = None) -> None:
        raise OSError(f"probe of rank {rank} is broken")


def _no_port(rank: int) -> int:
    raise LookupError(f"no port for rank {rank}")


@pytest.mark.parametrize("timeout", [None, 30.0])
async def test_a_probe_that_raises_fails_wait_ready_with_its_error(
    tmp_path: Path, timeout: float | None
) -> None:
    # Rank 0's probe raises at once, rank 1's (a port callable) on its first
    # call: wait_ready() raises the first probe error as the cause, long before
    # the timeout - not a hang, and not "not ready".
    async with aiolaunch.start_processes(
        name="p",
        entrypoint=SH,
        args={0: ("-c", "sleep 60"), 1: ("-c", "sleep 60")},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path),
        ready={0: _BrokenProbe(), 1: ReadyPort(_no_port)},
    ) as ctx:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(RuntimeError, match="readiness probe") as info:
            await asyncio.wait_for(ctx.wait_ready(timeout=timeout), 20)
        assert loop.time() - began < 10  # generous: it must not wait out the timeout
        assert isinstance(info.value.__cause__, (OSError, LookupError))
        assert "of rank" in str(info.value)


class _RejectsFirstLine(aiolaunch.ReadinessProbe):
    """A custom probe that reads stdout: the extension point ReadyLine uses."""

    def reads(self, stream: str) -> bool:
        return stream == "stdout"

    async def wait_ready(self, rank: int, lines: AsyncIterator[str] | None = None) -> None:
        assert lines is not None
        async for line in lines:
            raise ValueError(f"unexpected first line {line!r}")


async def test_a_custom_line_probe_gets_lines_and_its_error_ends_the_feed(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="p",
        entrypoint=SH,
        args={0: ("-c", "echo hello; exec sleep 60")},
        envs={0: {}},
        log_dir=str(tmp_path),
        ready=_RejectsFirstLine(),
    ) as ctx:
        with pytest.raises(RuntimeError) as info:
            await asyncio.wait_for(ctx.wait_ready(), 20)
        assert isinstance(info.value.__cause__, ValueError)
        assert "'hello'" in str(info.value.__cause__)
        # The failed probe is no longer fed: the worker's later lines are not queued.
        assert not ctx._readiness.listening(0)


async def test_ready_line_is_a_probe_fed_by_lines() -> None:
    async def lines() -> AsyncIterator[str]:
        for line in ("starting", "still starting", "listening on 80", "never read"):
            yield line

    probe = ReadyLine(r"listening on \d+")
    assert probe.reads("stdout") and probe.reads("stderr")
    assert ReadyLine("x", stream="stderr").reads("stderr")
    assert not ReadyLine("x", stream="stderr").reads("stdout")
    await asyncio.wait_for(probe.wait_ready(0, lines()), 5)
    with pytest.raises(TypeError):
        await probe.wait_ready(0)


async def test_on_failure_restart_with_count_in_env(tmp_path: Path) -> None:
    # Fails on its first two attempts, succeeds on the third.
    code = "import os, sys; n = int(os.environ['AIOLAUNCH_RESTART_COUNT']); print(n); sys.exit(0 if n >= 2 else 3)"
    policy = RestartPolicy("on-failure", max_restarts=5, backoff=0.01)
    async with aiolaunch.start_processes(
        name="r",
        entrypoint=sys.executable,
        args={0: ("-c", code), 1: ("-c", "pass")},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path),
        redirects=aiolaunch.Std.OUT,
        restart={0: policy},
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 30)
    assert result is not None and not result.is_failed(), result
    assert Path(result.stdouts[0]).read_text() == "0\n1\n2\n", "every attempt appends to the log"
    events = await _history(ctx)
    restarts = [e for e in events if isinstance(e, WorkerRestarting)]
    assert [(e.rank, e.attempt) for e in restarts] == [(0, 1), (0, 2)]
    assert [e.attempt for e in events if isinstance(e, WorkerStarted) and e.rank == 0] == [0, 1, 2]


async def test_restart_budget_exhausted_fails_the_group(tmp_path: Path) -> None:
    policy = RestartPolicy("always", max_restarts=2, window=60, backoff=0.01)
    async with aiolaunch.start_processes(
        name="r",
        entrypoint=SH,
        args={0: ("-c", "exit 5"), 1: ("-c", "exec sleep 60")},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path),
        restart=policy,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 30)
    assert result is not None and list(result.failures) == [0]
    assert result.failures[0].exitcode == 5
    starts = [e for e in await _history(ctx) if isinstance(e, WorkerStarted) and e.rank == 0]
    assert len(starts) == 3


def test_restart_policy_validates() -> None:
    with pytest.raises(ValueError, match="mode='sometimes'"):
        RestartPolicy("sometimes")
    with pytest.raises(TypeError, match=r"restart\[0\] must be a RestartPolicy"):
        aiolaunch.start_processes(
            name="r",
            entrypoint=SH,
            args={0: ()},
            envs={0: {}},
            restart={0: "always"},  # type: ignore[dict-item]
        )


def test_a_signal_reaches_every_waiting_group(tmp_path: Path) -> None:
    script = tmp_path / "two.py"
    script.write_text(
        textwrap.dedent(
            """
        import asyncio, json, signal, aiolaunch
        waiting = {"server": asyncio.Event(), "client": asyncio.Event()}
        async def group(name):
            ctx = await aiolaunch.start_processes(
                name=name, entrypoint="/bin/sh", args={0: ("-c", "exec sleep 60")}, envs={0: {}})
            try:
                # wait() takes the signals before its first suspension, and
                # nothing suspends between set() and it: once main() sees the
                # event, this group is in the signal race.
                waiting[name].set()
                await ctx.wait()
                return "returned"
            except aiolaunch.SignalException as exc:
                return exc.sigval.name
        async def main():
            before = signal.getsignal(signal.SIGTERM)
            tasks = [asyncio.ensure_future(group(n)) for n in ("server", "client")]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in waiting.values())), 60)
            print("ready", flush=True)
            results = await asyncio.gather(*tasks)
            print(json.dumps({"results": results, "restored": signal.getsignal(signal.SIGTERM) == before}))
        asyncio.run(main())
        """
        )
    )
    with driver([sys.executable, str(script)], stderr=None) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert json.loads(out) == {"results": ["SIGTERM", "SIGTERM"], "restored": True}


async def _history(ctx: aiolaunch.PContext) -> list[aiolaunch.Event]:
    return list(ctx._bus.history)
