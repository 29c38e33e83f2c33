"""torch's ``test/distributed/elastic/multiprocessing/redirects_test.py``, ported.

torch redirects a process's own fd 1/2 with ``redirect_stdout``/``redirect_stderr``
context managers; aiolaunch does it for a function worker (``redirects=``).
Each scenario runs its prints - from Python, from C (``libc.printf``) and from
a shell command - inside a function worker and checks the log file holds
exactly those lines. "Before" and "after" the redirect (torch's extra prints)
have no counterpart: a worker is redirected for its whole life. C's stdio
buffer is flushed when the worker's function returns, as torch's redirect
flushes it when its block ends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import TYPE_CHECKING

import pytest

import aiolaunch
from aiolaunch import Std

if TYPE_CHECKING:
    from pathlib import Path


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _c_stderr(libc: ctypes.CDLL) -> ctypes.c_void_p:
    return ctypes.c_void_p.in_dll(libc, "stderr")


def print_stdout() -> None:
    libc = _libc()
    print("foo from python", flush=True)
    libc.printf(b"foo from c\n")
    os.system("echo foo from cmd")


def print_stderr() -> None:
    libc = _libc()
    print("bar from python", file=sys.stderr, flush=True)
    libc.fprintf(_c_stderr(libc), b"bar from c\n")
    os.system("echo bar from cmd 1>&2")


def print_both() -> None:
    libc = _libc()
    print("redir stdout from python", flush=True)
    print("redir stderr from python", file=sys.stderr, flush=True)
    libc.printf(b"redir stdout from c\n")
    libc.fprintf(_c_stderr(libc), b"redir stderr from c\n")


def print_large_py(num_lines: int) -> None:
    for i in range(num_lines):
        print(f"py:{i}")


def print_large_c(num_lines: int) -> None:
    libc = _libc()
    for i in range(num_lines):
        libc.printf(f"c:{i}\n".encode())


async def _run(tmp_path: Path, fn: object, *args: object) -> None:
    async with aiolaunch.start_processes(
        name="redir",
        entrypoint=fn,  # type: ignore[arg-type]
        args={0: args},
        envs={0: {}},
        log_dir=tmp_path,
        redirects=Std.ALL,
        start_method="fork",
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()


def _lines(path: Path) -> set[str]:
    with open(path) as f:
        return set(f.readlines())


def test_redirect_invalid_std() -> None:
    # torch: redirect("stdfoo", ...) raises ValueError; aiolaunch's streams
    # are named by Std, and a bad one is refused the same way
    with pytest.raises(ValueError, match="stdfoo"):
        Std.from_str("stdfoo")


async def test_redirect_stdout(tmp_path: Path) -> None:
    await _run(tmp_path, print_stdout)
    # python, C and a child command write independently: compare as sets
    assert _lines(tmp_path / "0" / "stdout.log") == {
        "foo from python\n",
        "foo from c\n",
        "foo from cmd\n",
    }


async def test_redirect_stderr(tmp_path: Path) -> None:
    await _run(tmp_path, print_stderr)
    assert _lines(tmp_path / "0" / "stderr.log") == {
        "bar from python\n",
        "bar from c\n",
        "bar from cmd\n",
    }


async def test_redirect_both(tmp_path: Path) -> None:
    await _run(tmp_path, print_both)
    assert _lines(tmp_path / "0" / "stdout.log") == {
        "redir stdout from python\n",
        "redir stdout from c\n",
    }
    assert _lines(tmp_path / "0" / "stderr.log") == {
        "redir stderr from python\n",
        "redir stderr from c\n",
    }


@pytest.mark.parametrize("fn", [print_large_py, print_large_c], ids=["py", "c"])
async def test_redirect_large_buffer(tmp_path: Path, fn: object) -> None:
    num_lines = 500_000
    await _run(tmp_path, fn, num_lines)
    with open(tmp_path / "0" / "stdout.log") as fp:
        actual = {int(line.split(":")[1]) for line in fp}
    assert actual == set(range(num_lines))
