"""aiolaunch under async test harnesses: pytest-asyncio (auto, strict) and anyio's plugin.

Each case writes a small test suite to ``tmp_path`` with its own ini file and
runs it in a fresh ``python -m pytest`` (so the project's own configuration is
left alone). The inner suites use a new event loop per test, treat every
warning as an error, run asyncio in debug mode and collect garbage after each
test, so "Event loop is closed", "unclosed transport" and "Task was destroyed
but it is pending" surface as failures - here checked both by the inner
outcome and by scanning its whole output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, cast

import pytest

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

pytest.importorskip("pytest_asyncio")
pytest.importorskip("anyio")

# Shared by every inner suite: the recipes' fixture, and after-test garbage
# collection so a leaked transport warns *inside* the test that leaked it.
CONFTEST = """
import gc
import sys

import pytest

import aiolaunch
from aiolaunch import Std


def square(x):
    print(f"square {x}", flush=True)
    return x * x


def boom(x):
    raise ValueError(f"boom {x}")


@pytest.fixture(autouse=True)
def _collect_garbage():
    yield
    gc.collect()
"""

# Body of the tests; `MARK` and `FIXTURE` are filled in per harness.
TESTS = '''
import asyncio
import signal

import pytest

import aiolaunch
from aiolaunch import Std
from conftest import boom, square

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


{FIXTURE_DECORATOR}
async def squares(tmp_path):
    """The recipe: a started group, closed after the test, in the test's loop."""
    async with aiolaunch.start_processes(
        name="sq", entrypoint=square, args={{0: (2,), 1: (3,)}}, envs={{0: {{}}, 1: {{}}}},
        log_dir=tmp_path / "logs", tee=Std.OUT,
    ) as ctx:
        yield ctx


{MARK}
async def test_fixture_group(squares, capsys):
    result = await squares.wait()
    assert result.return_values == {{0: 4, 1: 9}}
    out = capsys.readouterr().out
    assert "[sq0]:square 2\\n" in out and "[sq1]:square 3\\n" in out


{MARK}
async def test_fixture_group_again(squares):
    # A fresh loop, a fresh group: nothing left over from the test before.
    assert (await squares.wait()).return_values == {{0: 4, 1: 9}}


{MARK}
async def test_binary_with_tee_and_failure(tmp_path, capsys):
    before = {{s: signal.getsignal(s) for s in SIGNALS}}
    ctx = await aiolaunch.start_processes(
        name="b", entrypoint="sh", args={{0: ("-c", "echo out; echo err >&2; exit 3")}},
        envs={{0: {{}}}}, log_dir=tmp_path / "b", tee=Std.ALL,
    )
    result = await ctx.wait()
    assert result.failures[0].exitcode == 3
    assert {{s: signal.getsignal(s) for s in SIGNALS}} == before
    captured = capsys.readouterr()
    assert "[b0]:out\\n" in captured.out and "[b0]:err\\n" in captured.err


{MARK}
async def test_function_failure_stops_the_rest(tmp_path):
    ctx = await aiolaunch.start_processes(
        name="f", entrypoint=boom, args={{0: (0,)}}, envs={{0: {{}}}}, log_dir=tmp_path / "f",
        redirects=Std.ALL,
    )
    result = await ctx.wait()
    assert result.is_failed()
    assert "boom 0" in result.failures[0].error_message


{MARK}
async def test_close_without_wait(tmp_path):
    async with aiolaunch.start_processes(
        name="s", entrypoint="sleep", args={{0: ("60",), 1: ("60",)}}, envs={{0: {{}}, 1: {{}}}},
        log_dir=tmp_path / "s", redirects=Std.ALL,
    ) as ctx:
        assert await ctx.wait(timeout=0) is None
    # leaving the block stopped both; wait() after close returns the result at once
    assert (await ctx.wait()).return_values == {{}}


{MARK}
async def test_cancelled_wait_then_close(tmp_path):
    async with aiolaunch.start_processes(
        name="c", entrypoint="sleep", args={{0: ("60",)}}, envs={{0: {{}}}},
    ) as ctx:
        task = asyncio.ensure_future(ctx.wait())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # still running (not a zombie): cancelling only stopped the waiting
        with open(f"/proc/{{ctx.pids()[0]}}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
'''

PYTEST_ASYNCIO_AUTO: dict[str, object] = dict(
    ini="asyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n",
    FIXTURE_DECORATOR="@pytest.fixture",
    MARK="",
    opts=["-p", "no:anyio"],
)
PYTEST_ASYNCIO_STRICT: dict[str, object] = dict(
    ini="asyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n",
    FIXTURE_DECORATOR="@pytest_asyncio.fixture",
    MARK="@pytest.mark.asyncio",
    opts=["-p", "no:anyio"],
)
ANYIO_PLUGIN: dict[str, object] = dict(
    # pytest-asyncio stays loaded (strict: it leaves anyio's tests alone), as in
    # a project that has both installed.
    ini="asyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n",
    FIXTURE_DECORATOR="@pytest.fixture",
    MARK="@pytest.mark.anyio",
    opts=[],
    extra_conftest="""

@pytest.fixture
def anyio_backend():
    return ("asyncio", {"debug": True})
""",
)

BAD_OUTPUT = re.compile(
    r"Event loop is closed|unclosed transport|unclosed <socket|was destroyed but it is pending"
    r"|Exception ignored|ResourceWarning|never awaited",
    re.IGNORECASE,
)


def _run_suite(tmp_path: Path, harness: Mapping[str, object]) -> str:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text(
        "[pytest]\n"
        + str(harness["ini"])
        + "filterwarnings =\n    error\n"
        + "addopts = -p no:cacheprovider\n"
    )
    (suite / "conftest.py").write_text(CONFTEST + str(harness.get("extra_conftest", "")))
    strict_fixture = "pytest_asyncio" in str(harness["FIXTURE_DECORATOR"])
    header = "import pytest_asyncio\n" if strict_fixture else ""
    body = TESTS.format(FIXTURE_DECORATOR=harness["FIXTURE_DECORATOR"], MARK=harness["MARK"])
    (suite / "test_inner.py").write_text(header + textwrap.dedent(body))
    env = {
        **os.environ,
        "PYTHONASYNCIODEBUG": "1",  # pytest-asyncio's loops in debug mode too
        "PYTHONDEVMODE": "1",
        "PYTHONWARNINGS": "error",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-W",
            "error",
            "--rootdir",
            str(suite),
            *cast("list[str]", harness["opts"]),
            str(suite),
        ],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "6 passed" in output, output
    assert "warning" not in output.lower(), output
    bad = BAD_OUTPUT.search(output)
    assert bad is None, f"{bad.group(0)!r} in:\n{output}"
    return output


def test_pytest_asyncio_auto_mode(tmp_path: Path) -> None:
    _run_suite(tmp_path, PYTEST_ASYNCIO_AUTO)


def test_pytest_asyncio_strict_mode(tmp_path: Path) -> None:
    _run_suite(tmp_path, PYTEST_ASYNCIO_STRICT)


def test_anyio_pytest_plugin_asyncio_backend(tmp_path: Path) -> None:
    _run_suite(tmp_path, ANYIO_PLUGIN)


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The checks above are not vacuous: a suite that leaks a resource fails them."""
    leaky = dict(PYTEST_ASYNCIO_AUTO)
    leaky["extra_conftest"] = """

import os

@pytest.fixture(autouse=True)
async def _leak_a_file():
    leaked = open(os.devnull)  # never closed: ResourceWarning when collected
    yield
"""
    with pytest.raises(AssertionError, match=r"ResourceWarning"):
        _run_suite(tmp_path, leaky)
