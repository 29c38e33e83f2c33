"""A restart that starts clean (agent/_clean.py), and the hosts in the live view.

``make_clean`` against real processes that escaped their attempt (a daemon
in a session of its own that ignores SIGTERM, holding a file and a port),
and against a port held by something else (bounded wait, reported). The
``"hosts"`` section of ``status``, ``/metrics``, ``top`` and the report.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from aiolaunch._hangs._report import RunReport
from aiolaunch._live._commands import status_answer
from aiolaunch._live._metrics import render_metrics
from aiolaunch._sections import register_section, sections
from aiolaunch.agent._clean import ATTEMPT_ENV, make_clean
from aiolaunch.agent._hosts import hosts_metrics, hosts_section

if TYPE_CHECKING:
    from pathlib import Path

# Double-forks a daemon (a session of its own, SIGTERM ignored) that holds
# a file open and listens on a port, then prints its pid and port.
DAEMON = textwrap.dedent(
    """
    import os, signal, socket, sys, time
    path = sys.argv[1]
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # let go of the caller's pipes
                os.dup2(null, fd)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            f = open(path, "w")
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            os.write(w, f"{os.getpid()} {s.getsockname()[1]}".encode())
            time.sleep(300)
        os._exit(0)
    print(os.read(r, 100).decode(), flush=True)
    """
)


def _daemon(tmp_path: Path, token: str | None) -> tuple[int, int, Path]:
    held = tmp_path / "held.bin"
    env = dict(os.environ)
    if token is not None:
        env[ATTEMPT_ENV] = token
    out = subprocess.run(
        [sys.executable, "-c", DAEMON, str(held)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1]), held


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


async def test_whatever_carries_the_attempts_marker_is_gone_before_the_restart(
    tmp_path: Path,
) -> None:
    token = f"test-{os.getpid()}-{time.monotonic_ns()}"
    pid, port, held = _daemon(tmp_path, token)
    assert _alive(pid)
    report = await make_clean(token, [], [str(held), f"port:{port}"], bound=10)
    assert pid in report.killed and not _alive(pid)
    assert report.clean and report.held == {} and report.busy_ports == []
    assert f"killed 1 leftover process(es) [{pid}]" in report.describe()
    with socket.socket() as s:  # free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))


async def test_a_resource_held_by_another_job_bounds_the_wait_and_is_reported(
    tmp_path: Path,
) -> None:
    pid, port, _ = _daemon(tmp_path, None)  # not of the attempt: left alone
    try:
        began = time.monotonic()
        report = await make_clean("no-such-attempt", [], [f"port:{port}"], bound=0.5)
        assert 0.5 <= time.monotonic() - began < 5
        assert report.busy_ports == [port] and not report.clean
        assert _alive(pid) and report.killed == []
        assert f"port(s) [{port}] do not bind yet" in report.describe()
    finally:
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.01)


def _state() -> Any:
    return SimpleNamespace(
        round=3,
        participants={"10.0.0.1_7_0": 0, "10.0.0.3_9_0": 1},
        redundancy_list={"10.0.0.4_5_0"},
        wait_list=set(),
    )


def _section() -> dict[str, Any]:
    table = {"quarantine": {"10.0.0.2": {"since": 0.0, "until": 1600.0, "reason": "2 failures"}}}
    return hosts_section(
        state=_state(),
        me="10.0.0.1_7_0",
        host=lambda n: str(n).split("_")[0],
        table=table,
        restarts=2,
        now=1000.0,
    )


def test_the_hosts_section_says_who_runs_who_waits_and_who_is_out() -> None:
    section = _section()
    assert section["members"] == ["10.0.0.1", "10.0.0.3"] and section["spares"] == ["10.0.0.4"]
    assert section["role"] == "running" and section["restarts"] == 2
    assert set(section["quarantine"]) == {"10.0.0.2"}
    assert section["summary"] == (
        "round 3: 2 host(s), 1 spare(s), 2 restart(s), quarantined: 10.0.0.2 (600 s left)"
    )


def test_status_metrics_and_report_carry_a_registered_section(tmp_path: Path) -> None:
    unregister = register_section("hosts", _section, hosts_metrics)
    try:
        target = SimpleNamespace(
            name="g", log_dir=str(tmp_path), started=0.0, metrics_url=None, status=lambda: []
        )
        answer = status_answer(target)
        assert answer["hosts"]["quarantine"]["10.0.0.2"]["until"] == 1600.0
        metrics = render_metrics(answer)
        assert 'aiolaunch_host_quarantined_until_seconds{host="10.0.0.2"} 1600.0' in metrics
        assert 'aiolaunch_job_hosts{role="spare"} 1' in metrics
        assert "aiolaunch_job_restarts_total 2" in metrics
        report = RunReport.build(name="g", log_dir=str(tmp_path), result=None)
        assert report.to_json()["hosts"]["spares"] == ["10.0.0.4"]
        assert "hosts: round 3: 2 host(s)" in report.to_text()
    finally:
        unregister()
    assert "hosts" not in sections()
    assert "aiolaunch_job_round" not in render_metrics({"workers": []})


def test_top_shows_the_hosts_summary() -> None:
    from aiolaunch._cli._top_view import TopState, screen

    unregister = register_section("hosts", _section, hosts_metrics)
    try:
        snapshot = {"name": "g", "log_dir": "/x", "workers": [], **sections()}
    finally:
        unregister()
    lines = screen(snapshot, TopState(), 200, 10)
    assert "hosts: round 3: 2 host(s), 1 spare(s)" in lines[1][0]
