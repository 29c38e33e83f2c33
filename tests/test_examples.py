"""The runnable examples: the orchestration service recipe, end to end."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from _helpers import driver

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_service_serves_then_exits_cleanly() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "service.py"), "--requests", "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "servers ready on ports" in out.stdout
    assert "2 clients made 40 successful requests" in out.stdout
    assert "[client0]:20/20 requests" in out.stdout  # tee'd, prefixed client lines


def test_service_stops_everything_on_ctrl_c() -> None:
    argv = [sys.executable, str(EXAMPLES / "service.py"), "--requests", "1000000"]
    with driver(argv) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("servers ready"), line
        # Handshake: the client group is up and its wait() races signals.
        while not line.endswith("clients started\n"):
            line = proc.stdout.readline()
            assert line, "service exited before its clients started"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "got SIGINT: stopping servers and clients" in out
    # every server and client is gone: the autouse leak check verifies it
