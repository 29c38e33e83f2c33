"""aiolaunch as PID 1 of a PID namespace (a pod without an init): orphans of
the workers are reaped, signals still reach the workers, the status is kept.

``unshare -p -f --mount-proc aiolaunch ...`` needs root; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import pytest

from _helpers import driver

if TYPE_CHECKING:
    from pathlib import Path

ORPHANS = 10  # per worker

# Each worker makes ORPHANS orphans (a shell that exits at once, leaving a
# `sleep 0.2` to PID 1), waits until every orphan has exited, then counts the
# zombies left in the namespace (its own /proc: --mount-proc).
WORKER = textwrap.dedent(
    f"""
    import os, subprocess, sys, time

    def states():
        out = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    with open(f"/proc/{{p}}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                out.append((name, stat.rsplit(")", 1)[1].split()[0]))
        return out

    for _ in range({ORPHANS}):
        subprocess.run(["/bin/sh", "-c", "sleep 0.2 & exit 0"], check=True)
    deadline = time.monotonic() + 30
    while any(n == "sleep" and s != "Z" for n, s in states()):
        assert time.monotonic() < deadline, "the orphans did not exit"
        time.sleep(0.05)
    # an init reaps at once; give it a generous while (bounded)
    deadline = time.monotonic() + float(sys.argv[2])
    while any(s == "Z" for _, s in states()) and time.monotonic() < deadline:
        time.sleep(0.05)
    zombies = sum(s == "Z" for _, s in states())
    with open(os.path.join(sys.argv[1], os.environ["LOCAL_RANK"]), "w") as f:
        f.write(str(zombies))
    """
)

SERVE = textwrap.dedent(
    """
    import os, signal, sys, time
    d = sys.argv[1]
    rank = os.environ["LOCAL_RANK"]
    def on_term(signum, frame):
        open(os.path.join(d, f"{rank}.term"), "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(d, f"{rank}.ready"), "w").close()
    while True:
        time.sleep(0.1)
    """
)


@pytest.fixture
def unshare() -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("a PID namespace (unshare -p) needs root")
    if shutil.which("unshare") is None:
        pytest.skip("util-linux's unshare is not installed")
    probe = subprocess.run(
        ["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode(errors='replace')}")
    return ["unshare", "-p", "-f", "--mount-proc", "--kill-child"]


@pytest.mark.parametrize("init", ["on", "off"])
def test_orphans_of_the_workers_are_reaped(unshare: list[str], tmp_path: Path, init: str) -> None:
    script = tmp_path / "orphans.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    # with the init off (AIOLAUNCH_INIT=0: the measurement of issue #24) the
    # zombies stay; a short wait is enough to see them stay
    wait_s = "20" if init == "on" else "2"
    env = {**os.environ, "AIOLAUNCH_INIT": "1" if init == "on" else "0"}
    argv = [*unshare, sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*argv, str(script), str(out), wait_s], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    counts = sorted(int(p.read_text()) for p in out.iterdir())
    if init == "on":
        assert counts == [0, 0], proc.stderr
    else:
        assert counts == [2 * ORPHANS, 2 * ORPHANS], proc.stderr


def _pid1(unshare_pid: int, deadline: float) -> int:
    """The host pid of the namespace's PID 1 (unshare's child)."""
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{unshare_pid}/task/{unshare_pid}/children") as f:
                kids = f.read().split()
        except OSError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise AssertionError("unshare started no child")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_reach_the_workers_and_the_status_is_kept(
    unshare: list[str], tmp_path: Path, sig: signal.Signals
) -> None:
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    argv = [*unshare, sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2"]
    with driver([*argv, str(script), str(tmp_path)]) as proc:
        deadline = time.monotonic() + 60
        init = _pid1(proc.pid, deadline)
        while len(list(tmp_path.glob("*.ready"))) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        os.kill(init, sig)  # as the container runtime does
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    if sig == signal.SIGTERM:
        assert sorted(p.name for p in tmp_path.glob("*.term")) == ["0.term", "1.term"]
