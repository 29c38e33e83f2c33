"""``aiolaunch.testing``: the leak-check plugin, run in inner pytest sessions.

Each case writes a small suite and runs it, with the plugin from its entry point, in a
fresh ``python -m pytest`` (pytester's subprocess mode), under pytest-asyncio
and under anyio's plugin. Tests that leak on purpose record what they leaked
in ``$PIDS_DIR``; we kill those processes here afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pathlib import Path

pytest_plugins = ["pytester"]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

INNER = """
import asyncio, os, signal, subprocess, sys
import pytest
import aiolaunch

KEEP = []

def note(pid):
    with open(os.path.join(os.environ["PIDS_DIR"], str(pid)), "w") as f:
        f.write(str(pid))

{marker}
async def test_clean_aiolaunch_run(tmp_path{extra}):
    async with aiolaunch.start_processes(
        name="w", entrypoint=sys.executable, args={{0: ("-c", "print('hi')")}},
        envs={{0: {{}}}}, log_dir=str(tmp_path / "logs"), redirects=aiolaunch.Std.ALL,
    ) as ctx:
        result = await ctx.wait()
    assert not result.is_failed()

{marker}
async def test_leaks_a_child(tmp_path{extra}):
    p = await asyncio.create_subprocess_exec("sleep", "30")
    note(p.pid)
    KEEP.append(p)

{marker}
async def test_leaks_an_fd(tmp_path{extra}):
    KEEP.append(os.pipe())

{marker}
async def test_changes_a_signal_handler(tmp_path{extra}):
    signal.signal(signal.SIGHUP, lambda *a: None)

{marker}
@pytest.mark.leaks_ok
async def test_opted_out(tmp_path{extra}):
    KEEP.append(os.pipe())

{marker}
async def test_clean_again(tmp_path{extra}):
    await asyncio.sleep(0)
"""

ASYNCIO_INI = """
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
aiolaunch_leak_settle = 0.2
{autouse}
"""

ANYIO_CONFTEST = """
import pytest

@pytest.fixture(params=["asyncio"])
def anyio_backend(request):
    return request.param
"""


def _run(
    pytester: pytest.Pytester, tmp_path: Path, *, harness: str, mode: str
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    autouse = "aiolaunch_leak_check = true" if mode == "autouse" else ""
    extra = ", no_leaks" if mode == "fixture" else ""
    if harness == "anyio":
        marker = "@pytest.mark.anyio"
        pytester.makeini(f"[pytest]\naiolaunch_leak_settle = 0.2\n{autouse}\n")
        pytester.makeconftest(ANYIO_CONFTEST)
        plugins = ["-p", "anyio", "-p", "no:asyncio"]
    else:
        marker = ""
        pytester.makeini(ASYNCIO_INI.format(autouse=autouse))
        plugins = ["-p", "no:anyio"]
    pytester.makepyfile(test_inner=INNER.format(marker=marker, extra=extra))
    env = {**os.environ, "PIDS_DIR": str(pids_dir)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *plugins,
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore::pytest.PytestUnraisableExceptionWarning",
        ],
        cwd=pytester.path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    leaked = [int(p.name) for p in pids_dir.iterdir()]
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc, leaked


def _outcomes(output: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in output.splitlines():
        for word in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(word + " ") and "::" in line:
                name = line.split("::", 1)[1].split()[0]
                # a test that passed and then errored at teardown is reported twice
                if found.get(name) != "ERROR":
                    found[name] = word
    return found


EXPECTED = {
    "test_clean_aiolaunch_run": "PASSED",
    "test_leaks_a_child": "ERROR",
    "test_leaks_an_fd": "ERROR",
    "test_changes_a_signal_handler": "ERROR",
    "test_opted_out": "PASSED",
    "test_clean_again": "PASSED",
}


@pytest.mark.parametrize("harness", ["pytest-asyncio", "anyio"])
@pytest.mark.parametrize("mode", ["fixture", "autouse"])
def test_plugin_reports_exactly_the_leaks(
    pytester: pytest.Pytester, tmp_path: Path, harness: str, mode: str
) -> None:
    proc, leaked = _run(pytester, tmp_path, harness=harness, mode=mode)
    out = proc.stdout + proc.stderr
    outcomes = _outcomes(out)
    # anyio ids carry the backend parameter: test_x[asyncio]
    outcomes = {k.split("[")[0]: v for k, v in outcomes.items()}
    assert outcomes == EXPECTED, out
    assert len(leaked) == 1
    assert f"process pid {leaked[0]}" in out and "sleep 30" in out
    assert "fd " in out and "-> pipe:" in out
    assert "signal SIGHUP: handler was" in out


def test_plugin_is_off_unless_asked(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Loaded but not enabled, and no test requests ``no_leaks``: nothing is checked."""
    proc, _ = _run(pytester, tmp_path, harness="pytest-asyncio", mode="off")
    outcomes = _outcomes(proc.stdout)
    assert set(outcomes.values()) == {"PASSED"}, proc.stdout + proc.stderr


def test_plugin_sets_nothing_until_enabled(pytester: pytest.Pytester) -> None:
    """Loaded (entry point) but not enabled: no environment variable appears;
    enabled, the session token is set before the first test runs."""
    pytester.makepyfile(
        test_env=textwrap.dedent(
            """
            import os
            import aiolaunch.testing

            def test_env(pytestconfig):
                assert pytestconfig.pluginmanager.has_plugin("aiolaunch")
                print("TOKEN", os.environ.get(aiolaunch.testing.TOKEN_ENV))
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "AIOLAUNCH_LEAKCHECK_TOKENS"}
    runs = {}
    for mode, extra in (("off", []), ("on", ["--aiolaunch-leak-check"])):
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *extra],
            cwd=pytester.path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[mode] = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKEN")]
    assert runs["off"] == ["TOKEN None"]
    assert len(runs["on"]) == 1 and runs["on"][0] != "TOKEN None"


def test_importing_aiolaunch_does_not_import_pytest() -> None:
    code = textwrap.dedent(
        """
        import sys
        import aiolaunch
        aiolaunch.start_processes, aiolaunch.Std, aiolaunch.record
        print("pytest" in sys.modules, "aiolaunch.testing" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["False", "False"]
