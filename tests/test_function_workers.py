"""Function workers: by-value functions, async def, return values, errors, env order."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aiolaunch
from _helpers import exited, start
from aiolaunch import Std

METHODS = ["spawn", "fork", "forkserver"]


def _text(message: object) -> str:
    # As in torch, a structured error file makes ``message`` its JSON object.
    if isinstance(message, dict):
        return str(message["message"])
    return str(message)


def square(x: int) -> int:
    return x * x


async def async_double(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


def fail(msg: str) -> None:
    raise ValueError(msg)


def env_at_import() -> str | None:
    return os.environ.get("AIOLAUNCH_TEST_VAR")


def print_everywhere(tag: str) -> None:
    print(f"py {tag}", flush=True)
    os.write(1, f"fd {tag}\n".encode())
    subprocess.run(["/bin/sh", "-c", f"echo sub {tag}; echo suberr {tag} >&2"], check=True)


def exit_zero_without_return() -> None:
    os._exit(0)


def sys_exit_zero() -> None:
    sys.exit(0)


def big_value(n: int) -> bytes:
    return b"z" * n


def sleep_forever() -> None:
    import time

    time.sleep(600)


@pytest.mark.parametrize("method", METHODS)
async def test_return_values_each_start_method(method: str, tmp_path: Path) -> None:
    offset = 10
    closure = lambda x: x + offset  # noqa: E731 - a lambda closure travels by value
    ctx = await start(tmp_path, closure, (1,), (2,), name="f", start_method=method)
    assert isinstance(ctx, aiolaunch.MultiprocessContext)
    result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None and not result.is_failed(), result
    assert result.return_values == {0: 11, 1: 12}


async def test_async_def_entrypoint(tmp_path: Path) -> None:
    async with start(tmp_path, async_double, (4,), name="f") as ctx:
        result = await ctx.wait()
    assert result is not None and result.return_values == {0: 8}


async def test_exception_becomes_error_file_and_failure(tmp_path: Path) -> None:
    async with start(tmp_path, fail, ("kaput",), ("fine",), name="f", redirects=Std.ERR) as ctx:
        result = await ctx.wait()
    assert result is not None and result.is_failed()
    failure = next(iter(result.failures.values()))
    assert failure.exitcode == 1
    assert "ValueError: " in _text(failure.message)
    data = json.loads(Path(failure.error_file).read_text())
    assert data["message"]["message"].startswith("ValueError: ")
    assert "raise ValueError(msg)" in data["message"]["extraInfo"]["py_callstack"]
    assert "Traceback" in Path(result.stderrs[failure.local_rank]).read_text()


async def test_env_applied_before_unpickling(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="f",
        entrypoint=env_at_import,
        args={0: ()},
        envs={0: {"AIOLAUNCH_TEST_VAR": "set"}},
        log_dir=str(tmp_path),
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and result.return_values == {0: "set"}


async def test_output_captured_at_fd_level(tmp_path: Path) -> None:
    async with start(tmp_path, print_everywhere, ("a",), name="f", redirects=Std.ALL) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    assert Path(result.stdouts[0]).read_text() == "py a\nfd a\nsub a\n"
    assert Path(result.stderrs[0]).read_text() == "suberr a\n"


async def test_exit_zero_without_value_is_a_failure(tmp_path: Path) -> None:
    async with start(tmp_path, exit_zero_without_return, name="f") as ctx:
        result = await asyncio.wait_for(ctx.wait(), 30)
    assert result is not None and result.is_failed()
    assert "without returning" in _text(result.failures[0].message)


async def test_sys_exit_zero_returns_none(tmp_path: Path) -> None:
    async with start(tmp_path, sys_exit_zero, name="f") as ctx:
        result = await ctx.wait()
    assert result is not None and result.return_values == {0: None}


async def test_large_return_value(tmp_path: Path) -> None:
    n = 40 << 20
    async with start(tmp_path, big_value, (n,), (n,), name="f") as ctx:
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None
    assert result.return_values[0] == b"z" * n and result.return_values[1] == b"z" * n


async def test_returned_worker_exits_without_waiting_for_others(tmp_path: Path) -> None:
    async with start(tmp_path, square, (3,), name="f") as ctx:
        pass
    async with aiolaunch.start_processes(
        name="f",
        entrypoint=lambda r: r if r == 0 else __import__("time").sleep(60),
        args={0: (0,), 1: (1,)},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path / "b"),
    ) as ctx:
        assert await ctx.wait(timeout=0.1) is None
        event = await asyncio.wait_for(exited(ctx, 0), 30)  # rank 1 sleeps on
        assert event.exitcode == 0
        assert await ctx.wait(timeout=0) is None  # rank 0's exit decided nothing
    assert ctx.pids()


def test_main_function_under_spawn_in_python_c(tmp_path: Path) -> None:
    # A function defined in __main__ of a `python -c` supervisor works under spawn.
    code = textwrap.dedent(
        """
        import asyncio, aiolaunch
        def work(x):
            return x * 3
        async def main():
            ctx = await aiolaunch.start_processes(
                name="m", entrypoint=work, args={0: (5,), 1: (6,)}, envs={0: {}, 1: {}},
                start_method="spawn")
            res = await ctx.wait()
            print(res.return_values)
        asyncio.run(main())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "{0: 15, 1: 18}"


async def test_unpicklable_argument_is_rejected_before_start() -> None:
    import threading

    with pytest.raises(TypeError, match=r"args\[1\]\[0\]") as info:
        aiolaunch.start_processes(
            name="f",
            entrypoint=square,
            args={0: (1,), 1: (threading.Lock(),)},
            envs={0: {}, 1: {}},
        )
    assert info.value.__cause__ is not None


async def test_close_stops_function_workers(tmp_path: Path) -> None:
    ctx = await start(tmp_path, sleep_forever, n=2, name="f")
    pids = ctx.pids()
    await ctx.close(timeout=5)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    result = await ctx.wait()
    assert result is not None and not result.is_failed()
