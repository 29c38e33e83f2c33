"""Signals sent to a real supervisor subprocess: forwarded, escalated, restored.

Signals go to a supervisor we start, never to the test runner.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pathlib import Path

SUPERVISOR = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys, time
    import aiolaunch

    SIGS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

    def sleeper(path):
        import subprocess, time
        p = subprocess.Popen(["sleep", "60"])
        with open(path, "w") as f:
            f.write(str(p.pid))
        time.sleep(60)

    async def main():
        kind, grace, logdir = sys.argv[1], float(sys.argv[2]), sys.argv[3]
        before = {s: signal.getsignal(s) for s in SIGS}
        if kind == "binary":
            os.makedirs(logdir, exist_ok=True)
            default = f"sleep 60 & echo $! > {logdir}/gc$RANK; wait"
            script = sys.argv[4] if len(sys.argv) > 4 else default
            ctx = await aiolaunch.start_processes(
                name="s", entrypoint="/bin/sh", args={0: ("-c", script), 1: ("-c", script)},
                envs={0: {"RANK": "0"}, 1: {"RANK": "1"}}, log_dir=logdir + "/logs",
                shutdown_timeout=grace)
        else:
            os.makedirs(logdir, exist_ok=True)
            ctx = await aiolaunch.start_processes(
                name="s", entrypoint=sleeper,
                args={0: (logdir + "/gc0",), 1: (logdir + "/gc1",)},
                envs={0: {}, 1: {}}, log_dir=logdir + "/logs", shutdown_timeout=grace)
        task = asyncio.ensure_future(ctx.wait())
        for _ in range(3):
            await asyncio.sleep(0)
        print(json.dumps({"pids": ctx.pids()}), flush=True)
        try:
            await task
            print(json.dumps({"outcome": "returned"}), flush=True)
        except aiolaunch.SignalException as exc:
            after = {s: signal.getsignal(s) for s in SIGS}
            print(json.dumps({
                "outcome": "signal", "sigval": exc.sigval.name,
                "restored": after == before,
                "hup_ignored": after[signal.SIGHUP] == signal.SIG_IGN,
            }), flush=True)

    asyncio.run(main())
    """
)


def _start(
    tmp_path: Path, *argv: str, ignore_hup: bool = False
) -> tuple[subprocess.Popen[str], dict[str, int]]:
    script = tmp_path / "supervisor.py"
    script.write_text(SUPERVISOR)

    def preexec() -> None:
        if ignore_hup:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen(
        [sys.executable, str(script), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate()
        pytest.fail(f"supervisor died early: {err}")
    return proc, {k: int(v) for k, v in json.loads(line)["pids"].items()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_dead(pids: list[int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return
        time.sleep(0.01)
    pytest.fail(f"processes still alive: {[p for p in pids if _alive(p)]}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_signal_is_forwarded_then_raised(tmp_path: Path, sig: signal.Signals) -> None:
    proc, pids = _start(tmp_path, "binary", "5", str(tmp_path / "logs"))
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {
        "outcome": "signal",
        "sigval": sig.name,
        "restored": True,
        "hup_ignored": False,
    }, err
    assert proc.returncode == 0
    assert not any(_alive(p) for p in pids.values())


def test_signal_ignoring_workers_get_sigkill_after_grace(tmp_path: Path) -> None:
    script = "trap '' TERM; while :; do sleep 0.05; done"
    proc, pids = _start(tmp_path, "binary", "0.3", str(tmp_path / "logs"), script)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 10
    assert json.loads(out.strip().splitlines()[-1])["sigval"] == "SIGTERM"
    assert "SIGKILL" in err
    assert not any(_alive(p) for p in pids.values())


def test_inherited_sig_ign_stays_ignored(tmp_path: Path) -> None:
    proc, pids = _start(tmp_path, "binary", "5", str(tmp_path / "logs"), ignore_hup=True)
    proc.send_signal(signal.SIGHUP)  # ignored, as nohup asked: workers keep running
    time.sleep(0.3)
    assert proc.poll() is None and all(_alive(p) for p in pids.values())
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["sigval"] == "SIGTERM" and report["restored"] and report["hup_ignored"]


@pytest.mark.parametrize("kind", ["binary", "function"])
def test_workers_die_with_a_sigkilled_supervisor(tmp_path: Path, kind: str) -> None:
    """Workers *and their children* die with a SIGKILLed supervisor.

    Binary workers: the guardian kills their process groups; function workers:
    the lifeline thread does. Both reach grandchildren in the worker's group.
    """
    proc, pids = _start(tmp_path, kind, "5", str(tmp_path / "w"))
    grandchildren: list[int] = []
    deadline = time.monotonic() + 30
    while len(grandchildren) < 2 and time.monotonic() < deadline:
        grandchildren = [
            int(p.read_text()) for p in (tmp_path / "w").glob("gc*") if p.read_text().strip()
        ]
        time.sleep(0.02)
    assert len(grandchildren) == 2
    proc.kill()
    proc.communicate(timeout=30)
    _wait_dead([*pids.values(), *grandchildren])


async def test_application_loop_signal_handler_is_restored(tmp_path: Path) -> None:
    # An orchestration service that handles SIGHUP itself keeps its handler
    # after a wait() borrowed the signal (no signal is sent here).
    import asyncio

    import aiolaunch

    loop = asyncio.get_running_loop()
    calls: list[str] = []

    def on_hup() -> None:
        calls.append("hup")

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    try:
        async with aiolaunch.start_processes(
            name="s",
            entrypoint="/bin/true",
            args={0: ()},
            envs={0: {}},
            log_dir=str(tmp_path),
        ) as ctx:
            await ctx.wait()
        handle = loop._signal_handlers[signal.SIGHUP]  # type: ignore[attr-defined]
        assert handle._callback is on_hup
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
