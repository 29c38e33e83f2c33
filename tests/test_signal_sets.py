"""Which signals stop a group (``signals_to_handle``) and which are only forwarded.

Real supervisors get real signals; workers are ``/bin/sh`` loops whose traps
leave marks in files (the tests' handshakes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from _helpers import driver, wait_dead
from aiolaunch._signals._plan import parse_signals

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Iterator
    from pathlib import Path

# argv: marks folder, JSON of extra start_processes keywords. Each worker notes
# SIGUSR1/SIGUSR2 in marks/<sig>.<rank> and, on SIGTERM, copies its stop
# deadline and shutdown timeout to marks/term.<rank>, then exits 0.
SUPERVISOR = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys, time
    import aiolaunch

    async def main():
        marks, extra = sys.argv[1], json.loads(sys.argv[2])
        script = (
            f"trap 'echo x >> {marks}/USR1.$RANK' USR1; "
            f"trap 'echo x >> {marks}/USR2.$RANK' USR2; "
            "trap 'echo \\"$(cat $AIOLAUNCH_STOP_DEADLINE_FILE) $AIOLAUNCH_SHUTDOWN_TIMEOUT "
            f"$AIOLAUNCH_STOP_DEADLINE_FILE\\" > {marks}/term.$RANK.tmp; "
            f"mv {marks}/term.$RANK.tmp {marks}/term.$RANK; exit 0' TERM INT; "
            "while :; do sleep 0.05; done"
        )
        before = signal.getsignal(signal.SIGTERM)
        ctx = await aiolaunch.start_processes(
            name="s", entrypoint="/bin/sh", args={0: ("-c", script), 1: ("-c", script)},
            envs={0: {"RANK": "0"}, 1: {"RANK": "1"}}, log_dir=marks + "/logs", **extra)
        task = asyncio.ensure_future(ctx.wait())
        deadline = time.monotonic() + 30
        while signal.getsignal(signal.SIGTERM) == before:
            assert time.monotonic() < deadline and not task.done(), "wait() took no signals"
            await asyncio.sleep(0.001)
        print(json.dumps({"pids": list(ctx.pids().values()), "t": time.time()}), flush=True)
        try:
            await task
            print(json.dumps({"outcome": "returned"}), flush=True)
        except aiolaunch.SignalException as exc:
            print(json.dumps({"outcome": exc.sigval.name}), flush=True)

    asyncio.run(main())
    """
)


@contextlib.contextmanager
def _run(
    tmp_path: Path, extra: dict[str, Any], env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """The supervisor as a driver, once ``wait()`` took its signals over."""
    script = tmp_path / "supervisor.py"
    script.write_text(SUPERVISOR)
    marks = tmp_path / "marks"
    marks.mkdir()
    argv = [sys.executable, str(script), str(marks), json.dumps(extra)]
    with driver(argv, env={**os.environ, **(env or {})}) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            _, err = proc.communicate()
            pytest.fail(f"supervisor died early: {err}")
        yield proc, json.loads(line)["pids"]


def _until(path: Path, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"supervisor ended: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def _outcome(proc: subprocess.Popen[str]) -> tuple[str, str]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])["outcome"], err


@pytest.mark.parametrize("how", ["keyword", "env"])
def test_listed_sigusr1_is_forwarded_and_raised(tmp_path: Path, how: str) -> None:
    # As torch with TORCHELASTIC_SIGNALS_TO_HANDLE: a listed SIGUSR1 stops the
    # group and raises SignalException; it does not kill the supervisor.
    listed = "SIGTERM,SIGINT,SIGUSR1"
    extra = {"signals_to_handle": listed} if how == "keyword" else {}
    env = {"TORCHELASTIC_SIGNALS_TO_HANDLE": listed} if how == "env" else {}
    with _run(tmp_path, {**extra, "shutdown_timeout": 2}, env) as (proc, pids):
        proc.send_signal(signal.SIGUSR1)
        outcome, err = _outcome(proc)
    assert outcome == "SIGUSR1", err
    assert (tmp_path / "marks" / "USR1.0").exists() and (tmp_path / "marks" / "USR1.1").exists()
    assert not wait_dead(pids)


def test_forwarded_signals_keep_the_group_running(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    extra = {"forward_signals": ["SIGUSR1", "USR2"], "shutdown_timeout": 7}
    with _run(tmp_path, extra) as (proc, pids):
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            proc.send_signal(sig)
            for rank in (0, 1):
                _until(marks / f"{sig.name[3:]}.{rank}", proc)
        proc.send_signal(signal.SIGUSR1)
        _until(marks / "USR1.0", proc)
        deadline = time.monotonic() + 30
        while (marks / "USR1.0").read_text().count("x") < 2:
            assert time.monotonic() < deadline, "second SIGUSR1 not forwarded"
            time.sleep(0.01)
        # Still running after three forwarded signals; SIGTERM stops it.
        assert proc.poll() is None
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        outcome, err = _outcome(proc)
    assert outcome == "SIGTERM", err
    for rank in (0, 1):
        deadline_s, timeout_s, path = (marks / f"term.{rank}").read_text().split()
        # Written when the supervisor handled SIGTERM (at or after `sent`): + 7 s.
        assert sent + 6.99 < float(deadline_s) < sent + 60
        assert float(timeout_s) == 7.0
        assert not os.path.exists(path)  # removed once the group is gone
        # In the group's own folder: a SIGKILLed supervisor litters no temp folder.
        assert path.startswith(str(marks / "logs") + os.sep), path
    assert not wait_dead(pids)


def test_forward_wins_over_handle_for_a_signal_in_both(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    extra = {"signals_to_handle": "SIGTERM,SIGUSR1", "forward_signals": "SIGUSR1"}
    with _run(tmp_path, extra) as (proc, pids):
        proc.send_signal(signal.SIGUSR1)
        _until(marks / "USR1.0", proc)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        outcome, err = _outcome(proc)
    assert outcome == "SIGTERM", err
    assert not wait_dead(pids)


def test_parse_signals_forms() -> None:
    expected = frozenset({signal.SIGTERM, signal.SIGUSR1})
    assert parse_signals("SIGTERM,SIGUSR1", what="x", strict=True) == expected
    assert parse_signals(" sigterm , USR1 ,", what="x", strict=True) == expected
    assert parse_signals([15, "SIGUSR1"], what="x", strict=True) == expected
    assert parse_signals(int(signal.SIGUSR1), what="x", strict=True) == {signal.SIGUSR1}
    assert parse_signals("", what="x", strict=True) == frozenset()


@pytest.mark.parametrize("bad", ["SIGBOGUS", "SIGKILL,SIGTERM", "SIGSTOP", "CHLD", 0])
def test_bad_signal_keyword_raises_before_anything_starts(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"signals_to_handle: .*SIGKILL, SIGSTOP"):
        aiolaunch.start_processes(
            name="s",
            entrypoint="/bin/true",
            args={0: ()},
            envs={0: {}},
            log_dir=str(tmp_path / "logs"),
            signals_to_handle=bad,
        )
    with pytest.raises(TypeError, match="forward_signals"):
        aiolaunch.start_processes(
            name="s",
            entrypoint="/bin/true",
            args={0: ()},
            envs={0: {}},
            log_dir=str(tmp_path / "logs"),
            forward_signals=3.5,  # type: ignore[arg-type]
        )
    assert not (tmp_path / "logs").exists()


def test_bad_names_in_the_environment_are_skipped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # torch logs a warning for a name it cannot register and goes on.
    with caplog.at_level(logging.WARNING, logger="aiolaunch"):
        found = parse_signals("SIGTERM,SIGBOGUS,SIGKILL", what="$ENV", strict=False)
    assert found == {signal.SIGTERM}
    assert "SIGBOGUS" in caplog.text and "SIGKILL" in caplog.text
