"""The autouse leak check catches what it should, and only that.

A pytest session in a subprocess (pytester) runs with a copy of our
conftest.py and tests that leak on purpose; we assert which of them fail at
teardown and what the report says. The processes the inner tests leak on
purpose are killed here afterwards.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

CONFTEST = Path(__file__).with_name("conftest.py").read_text(encoding="utf-8")
HELPERS = Path(__file__).with_name("_helpers.py").read_text(encoding="utf-8")

INNER_TESTS = """
import asyncio, multiprocessing, os, signal, subprocess, sys, threading, time
import pytest

PIDS = os.environ["PIDS_DIR"]
KEEP = []  # keeps leaked objects alive, so only the fixture can notice them

def note(name, pid):
    with open(os.path.join(PIDS, name), "w") as f:
        f.write(str(pid))

def test_leaks_child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    KEEP.append(p)
    note("child", p.pid)

def test_leaks_zombie():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    KEEP.append(p)
    note("zombie", p.pid)
    while True:  # wait for the exit without reaping it
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.01)

def test_leaks_orphan():
    code = (
        "import subprocess, sys; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(c.pid, flush=True)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    note("orphan", int(out.stdout))  # its parent is gone: re-parented away from us

def test_leaks_fd():
    r, w = os.pipe()
    KEEP.extend([r, w])

def test_changes_signal_handler():
    signal.signal(signal.SIGHUP, lambda *a: None)

@pytest.mark.leaks_ok
def test_opted_out():
    KEEP.append(os.open(os.devnull, os.O_RDONLY))

@pytest.mark.leaks_ok("fds")
def test_opted_out_of_fds_only():
    KEEP.append(os.open(os.devnull, os.O_RDONLY))
    signal.signal(signal.SIGQUIT, lambda *a: None)

def test_clean_sync():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    with open(__file__) as f:
        f.read()

async def test_clean_async_with_loop_and_subprocess():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "print('hi')", stdout=asyncio.subprocess.PIPE
    )
    assert (await proc.communicate())[0] == b"hi\\n"
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: None)
    loop.remove_signal_handler(signal.SIGTERM)

def _work():
    pass

@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_clean_multiprocessing_helpers_allowed(method):
    p = multiprocessing.get_context(method).Process(target=_work)
    p.start()
    p.join()
    assert p.exitcode == 0

def test_child_reaped_late_is_fine():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p.kill()
    threading.Timer(0.3, p.wait).start()  # reaped after the test returned
"""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:  # ours to reap only if it is still our child; else init reaps it
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.01)


def test_fixture_reports_leaks(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(_helpers=HELPERS)  # the conftest imports it
    pytester.makeini(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makepyfile(test_inner=INNER_TESTS)
    os.environ["PIDS_DIR"] = str(pids_dir)
    os.environ["AIOLAUNCH_LEAKCHECK_SETTLE"] = "0.8"
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rE", timeout=120)
    finally:
        del os.environ["PIDS_DIR"], os.environ["AIOLAUNCH_LEAKCHECK_SETTLE"]
        leaked = {p.name: int(p.read_text()) for p in pids_dir.iterdir()}
        for pid in leaked.values():
            _kill(pid)

    output = result.stdout.str()
    assert set(leaked) == {"child", "zombie", "orphan"}
    errors = {
        line.split("::")[1].split(" ")[0]
        for line in result.stdout.lines
        if line.startswith("ERROR test_inner.py::")
    }
    assert errors == {
        "test_leaks_child",
        "test_leaks_zombie",
        "test_leaks_orphan",
        "test_leaks_fd",
        "test_changes_signal_handler",
        "test_opted_out_of_fds_only",
    }, output
    result.assert_outcomes(passed=12, errors=6)

    def report(test: str) -> str:
        start = output.index(f"test_inner.py::{test} leaked")
        return output[start : output.index("(mark the test", start)]

    child = report("test_leaks_child")
    assert f"process pid {leaked['child']} ppid " in child
    assert "time.sleep(60)" in child  # the cmdline
    zombie = report("test_leaks_zombie")
    assert f"process pid {leaked['zombie']} " in zombie
    assert "state Z (zombie: not reaped)" in zombie
    assert f"process pid {leaked['orphan']} " in report("test_leaks_orphan")
    fd_report = report("test_leaks_fd")
    assert fd_report.count("-> pipe:[") == 2
    # The inner session inherits our SIGHUP disposition: SIG_IGN under nohup.
    inherited = signal.getsignal(signal.SIGHUP)
    if inherited not in (signal.SIG_IGN, signal.SIG_DFL):
        inherited = signal.SIG_DFL
    assert f"signal SIGHUP: handler was {inherited!r}" in report("test_changes_signal_handler")
    partial = report("test_opted_out_of_fds_only")
    assert "signal SIGQUIT" in partial
    assert "fd " not in partial
