"""Resilience on one machine through the real command line: an end to crash
loops, the health check before every attempt, and the options' checks.

No torch needed: the workers are tiny Python scripts, the rendezvous is the
static one (the job's records are the agent's own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import pytest

from aiolaunch._cli._exit import EXIT_DO_NOT_RETRY, EXIT_FAILED, EXIT_HOST_EXCLUDED

if TYPE_CHECKING:
    from pathlib import Path

AIOLAUNCH = [sys.executable, "-m", "aiolaunch", "--standalone", "--no-preload"]

# Counts its attempts in a file; prints a progress line first when told to.
WORKER = textwrap.dedent(
    """
    import os, sys
    with open(sys.argv[1], "a") as f:
        f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
    if sys.argv[2] == "progress":
        print("step 1 loss 0.5", flush=True)
    sys.exit(3)
    """
)


def _run(tmp_path: Path, *flags: str, mode: str = "crash") -> tuple[int, str, str, list[str]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    attempts = tmp_path / "attempts"
    term = tmp_path / "termination-log"
    env = {**os.environ, "AIOLAUNCH_TERMINATION_LOG": str(term)}
    got = subprocess.run(
        [*AIOLAUNCH, *flags, str(script), str(attempts), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    message = term.read_text() if term.exists() else ""
    seen = attempts.read_text().split() if attempts.exists() else []
    return got.returncode, got.stderr, message, seen


def test_a_crash_loop_stops_after_n_attempts_without_progress(tmp_path: Path) -> None:
    status, err, message, attempts = _run(
        tmp_path,
        "--max-restarts=10",
        "--max-no-progress-restarts=3",
        "--progress-regex=^step ",
    )
    assert status == EXIT_DO_NOT_RETRY == 2, err
    assert attempts == ["0", "1", "2"], err  # three attempts, none made progress
    assert message.startswith("aiolaunch: crash loop: 3 attempt(s) in a row made no progress")
    assert "--max-no-progress-restarts 3" in message and "exitcode 3" in message, message
    assert "crash loop" in err


def test_a_job_that_makes_progress_uses_all_its_restarts(tmp_path: Path) -> None:
    status, err, message, attempts = _run(
        tmp_path,
        "--max-restarts=4",
        "--max-no-progress-restarts=2",
        "--progress-regex=^step ",
        mode="progress",
    )
    assert status == EXIT_FAILED, err
    assert attempts == ["0", "1", "2", "3", "4"], err
    assert "crash loop" not in message and "exitcode 3" in message


def test_the_health_check_runs_before_every_attempt(tmp_path: Path) -> None:
    runs = tmp_path / "checks"
    status, err, _, attempts = _run(
        tmp_path, "--max-restarts=2", f"--health-check=echo x >> {runs}"
    )
    assert status == EXIT_FAILED, err
    assert attempts == ["0", "1", "2"]
    assert runs.read_text().count("x") == 3, err


def test_a_failing_health_check_keeps_the_host_out_with_its_reason(tmp_path: Path) -> None:
    status, err, message, attempts = _run(
        tmp_path, "--health-check=echo 'GPU 3: ECC errors' >&2; exit 7"
    )
    assert status == EXIT_HOST_EXCLUDED == 3, err
    assert attempts == []  # nothing started
    assert "failed its health check" in message and "exit status 7" in message
    assert "GPU 3: ECC errors" in message, message


def test_a_hanging_health_check_is_killed_at_its_timeout(tmp_path: Path) -> None:
    # it also leaves a child behind: killed with its process group
    token = f"{os.getpid() % 97 + 30}.{os.getpid() % 1000}"  # a sleep nobody else runs
    check = f"(sleep {token}) & sleep {token}"
    began = time.monotonic()
    status, _, message, _ = _run(tmp_path, f"--health-check={check}", "--health-check-timeout=0.5")
    # not held up by the child's end (its sleep is 30 s or more)
    assert time.monotonic() - began < 25
    assert status == EXIT_HOST_EXCLUDED
    assert "did not finish within 0.5 s (killed)" in message
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"sleep\0{token}".encode() in f.read():
                    left.append(pid)
        except OSError:
            pass
    assert not left, f"the check's processes {left} outlived it"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--quarantine-after=2"], "--quarantine-after keeps its records in the rendezvous store"),
        (["--quarantine-ttl=60"], "--quarantine-ttl needs --quarantine-after N"),
        (["--max-no-progress-restarts=3"], "--max-no-progress-restarts needs --progress-regex"),
        (["--max-no-progress-restarts=0", "--progress-regex=x"], "must be >= 1"),
        (["--health-check-timeout=5"], "--health-check-timeout needs --health-check CMD"),
        (["--health-check=true", "--health-check-timeout=-1"], "--health-check-timeout=-1"),
        (["--health-check= "], "--health-check='' is empty"),
        (["--restart-resources=dev/nvidia0"], "must be an absolute path or glob"),
        (["--restart-resources=port:99999"], "is not a port; write port:N"),
        (
            ["--max-no-progress-restarts=2", "--progress-regex=("],
            "--progress-regex='(' is not a valid regular expression",
        ),
    ],
)
def test_bad_options_are_named_before_anything_starts(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    status, err, message, attempts = _run(tmp_path, *flags)
    assert status == EXIT_DO_NOT_RETRY, err
    assert says in err and attempts == []
    assert message == f"aiolaunch: error: {err.split('error: ', 1)[1].strip()}"
