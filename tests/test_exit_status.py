"""Every exit status of the table (aiolaunch._cli._exit, docs/schedulers.md) from
the real command, and the termination message that goes with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import pytest

from _helpers import driver, wait_dead
from aiolaunch._cli._exit import (
    EXIT_DO_NOT_RETRY,
    EXIT_FAILED,
    TERMINATION_LOG_LIMIT,
    _clip,
    failure_exit_status,
    signal_exit_status,
    termination_log_path,
)
from aiolaunch._results import ProcessFailure

if TYPE_CHECKING:
    from pathlib import Path

AIOLAUNCH = [sys.executable, "-m", "aiolaunch"]

FAIL = textwrap.dedent(
    """
    import os, sys, time
    from aiolaunch import record

    @record  # the error file: the traceback reaches the termination message
    def main():
        if os.environ["LOCAL_RANK"] == "1":
            mode = sys.argv[1]
            if mode == "kill":
                os.kill(os.getpid(), 9)
            if mode == "raise":
                raise RuntimeError("boom " + "x" * int(sys.argv[2]) + " the end")
            sys.exit(int(mode))
        time.sleep(60)

    main()
    """
)

SERVE = textwrap.dedent(
    """
    import os, sys, time
    d = sys.argv[1]
    with open(os.path.join(d, os.environ["LOCAL_RANK"] + ".tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(d, os.environ["LOCAL_RANK"] + ".tmp"),
               os.path.join(d, os.environ["LOCAL_RANK"] + ".pid"))
    while True:
        time.sleep(0.1)
    """
)


def _run(tmp_path: Path, argv: list[str], **env: str) -> tuple[int, str, str | None]:
    """(status, stderr, termination message or None) of ``aiolaunch argv``."""
    log = tmp_path / "termination-log"
    full_env = {**os.environ, "AIOLAUNCH_TERMINATION_LOG": str(log), **env}
    proc = subprocess.run(
        [*AIOLAUNCH, *argv], capture_output=True, text=True, timeout=120, env=full_env
    )
    message = log.read_text() if log.exists() else None
    return proc.returncode, proc.stderr, message


def test_success_is_0_and_writes_no_message(tmp_path: Path) -> None:
    status, err, message = _run(tmp_path, ["--nproc-per-node", "2", "--no-python", "true"])
    assert status == 0, err
    assert message is None


@pytest.mark.parametrize(
    ("mode", "flag", "expected"),
    [
        ("13", "torchrun", EXIT_FAILED),
        ("13", "root-cause", 13),
        ("kill", "torchrun", EXIT_FAILED),
        ("kill", "root-cause", 128 + signal.SIGKILL),
    ],
)
def test_worker_failure(tmp_path: Path, mode: str, flag: str, expected: int) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    argv = ["--nproc-per-node", "2", "--exit-code", flag, str(script), mode]
    status, err, message = _run(tmp_path, argv)
    assert status == expected, err
    assert message is not None
    head = message.splitlines()[0]
    assert head.startswith(f"{script} failed: rank 1 (local_rank 1) on "), message
    assert ("exitcode 13" if mode == "13" else "exitcode -9 (SIGKILL)") in head


def test_exit_code_from_the_environment(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    argv = ["--nproc-per-node", "2", str(script), "7"]
    status, err, _ = _run(tmp_path, argv, PET_EXIT_CODE="root-cause")
    assert status == 7, err


def test_long_traceback_is_clipped_to_4096_bytes(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    status, err, message = _run(tmp_path, ["--nproc-per-node", "2", str(script), "raise", "20000"])
    assert status == EXIT_FAILED, err
    assert message is not None
    assert len(message.encode()) <= TERMINATION_LOG_LIMIT
    assert message.startswith(f"{script} failed: rank 1")
    assert "RuntimeError: boom" in err  # the whole traceback stays on stderr
    assert message.rstrip().endswith("the end")  # the end of the traceback is kept


@pytest.mark.parametrize(
    "argv",
    [
        ["--nnodes", "0", "x.py"],  # bad value
        ["--no-such-flag", "x.py"],  # argparse
        ["/nonexistent/train.py"],  # the script
        ["-m", "no_such_module_anywhere"],  # the module
        ["--no-python", "no-such-program-anywhere"],  # the binary
    ],
)
def test_do_not_retry(tmp_path: Path, argv: list[str]) -> None:
    status, err, message = _run(tmp_path, argv)
    assert status == EXIT_DO_NOT_RETRY == 2, err
    assert message is not None and message.strip()
    assert message.strip().splitlines()[-1] in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_stopped_by_a_signal_is_128_plus_it(tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    log = tmp_path / "termination-log"
    env = {**os.environ, "AIOLAUNCH_TERMINATION_LOG": str(log)}
    argv = [*AIOLAUNCH, "--nproc-per-node", "2", "--shutdown-timeout", "5", str(script)]
    with driver([*argv, str(tmp_path)], env=env) as proc:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig == signal_exit_status(sig), err
    assert not wait_dead(pids)
    assert log.read_text() == f"aiolaunch: stopped by {sig.name}; all workers were stopped"


def test_root_cause_status_rules() -> None:
    def failure(code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=0, pid=1, exitcode=code, error_file="")

    assert failure_exit_status(failure(3), "torchrun") == 1
    assert failure_exit_status(failure(3), "root-cause") == 3
    assert failure_exit_status(failure(-15), "root-cause") == 143
    assert failure_exit_status(failure(300), "root-cause") == 1  # not an exit status
    with pytest.raises(ValueError, match="--exit-code"):
        failure_exit_status(failure(3), "nope")


def test_termination_log_path_rules(tmp_path: Path) -> None:
    assert termination_log_path({"AIOLAUNCH_TERMINATION_LOG": "/x/y"}) == "/x/y"
    assert termination_log_path({"AIOLAUNCH_TERMINATION_LOG": ""}) is None  # off
    fallback = termination_log_path({})
    writable = os.path.exists("/dev/termination-log") and os.access("/dev/termination-log", os.W_OK)
    assert fallback == ("/dev/termination-log" if writable else None)


@pytest.mark.parametrize("text", ["short", "é" * 5000, "head\n" + "tail line\n" * 2000])
def test_clip_keeps_utf8_and_the_limit(text: str) -> None:
    out = _clip(text, 100)
    assert len(out) <= 100
    decoded = out.decode("utf-8")  # never cut inside a character
    assert decoded == text or "[...]" in decoded
