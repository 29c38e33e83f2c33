"""The runnable examples: the orchestration service recipe, end to end."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_readme_command_1_trains_without_warnings(tmp_path: Path) -> None:
    # README's first command installs '.[torch]' and launches the DDP example.
    # torch warns "Failed to initialize NumPy" at import where numpy is
    # missing (its CPU wheel does not require it): the torch extra brings it
    # (issue #27 item 9).
    from importlib.metadata import requires

    extra = [r for r in requires("aiolaunch") or [] if 'extra == "torch"' in r.replace("'", '"')]
    assert any(r.startswith("numpy") for r in extra), extra
    pytest.importorskip("torch")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiolaunch",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "ddp_train.py"),
            "--steps",
            "40",
            "--log-every",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NumPy" not in out.stdout + out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
