"""Signals sent to a real supervisor subprocess: forwarded, escalated, restored.

Signals go to a supervisor we start, never to the test runner.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from _helpers import alive, driver, wait_dead

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Iterator

SUPERVISOR = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys, time
    import aiolaunch

    SIGS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

    def sleeper(path):
        import subprocess, time
        p = subprocess.Popen(["sleep", "60"])
        with open(path + ".tmp", "w") as f:
            f.write(str(p.pid))
        os.replace(path + ".tmp", path)  # atomic: never read empty
        time.sleep(60)

    async def main():
        kind, grace, logdir = sys.argv[1], float(sys.argv[2]), sys.argv[3]
        before = {s: signal.getsignal(s) for s in SIGS}
        if kind == "binary":
            os.makedirs(logdir, exist_ok=True)
            # Exits cleanly on any forwarded signal (a background child of a
            # non-interactive sh ignores SIGINT/SIGQUIT, so stop it explicitly).
            default = (
                "trap 'kill $c; exit 0' INT QUIT HUP TERM; "
                f"sleep 60 & c=$!; echo $c > {logdir}/gc$RANK.tmp; mv {logdir}/gc$RANK.tmp {logdir}/gc$RANK; wait"
            )
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
        # Handshake: wait() has taken SIGTERM over (its handler is installed)
        # before the test is told to signal us.
        deadline = time.monotonic() + 30
        while signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]:
            assert time.monotonic() < deadline and not task.done(), "wait() took no signals"
            await asyncio.sleep(0.001)
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


@contextlib.contextmanager
def _start(
    tmp_path: Path, *argv: str, ignore_hup: bool = False
) -> Iterator[tuple[subprocess.Popen[str], dict[str, int]]]:
    """The supervisor script as a driver: default dispositions, killed and reaped at the end.

    ``ignore_hup``: start it with SIGHUP ignored, as ``nohup`` does.
    With the default worker script (no 5th argument) it yields only once every
    worker's grandchild runs ``sleep`` (see :func:`_grandchildren`).
    """
    script = tmp_path / "supervisor.py"
    script.write_text(SUPERVISOR)
    ignore = (signal.SIGHUP,) if ignore_hup else ()
    with driver([sys.executable, str(script), *argv], ignore=ignore) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            _, err = proc.communicate()
            pytest.fail(f"supervisor died early: {err}")
        if len(argv) == 3:
            _grandchildren(Path(argv[2]))
        yield proc, {k: int(v) for k, v in json.loads(line)["pids"].items()}


def _grandchildren(logdir: Path) -> list[int]:
    """The pids of both workers' ``sleep`` children, once each has exec'd.

    A signal must not reach a grandchild between /bin/sh's fork and its exec:
    the forked copy still runs the shell's trap handler, which swallows the
    signal, and the ``sleep`` it becomes then never got it - the group then
    waits out the whole grace period (seen in CI: 1 in ~150 runs).
    """
    deadline = time.monotonic() + 30
    while True:
        # pid files are renamed into place: a gc<rank> file is never empty
        pids = [int(p.read_text()) for p in sorted(logdir.glob("gc[0-9]"))]
        if len(pids) == 2 and all(_comm(p) == "sleep" for p in pids):
            return pids
        assert time.monotonic() < deadline, f"grandchildren not started: {pids}"
        time.sleep(0.005)


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_signal_is_forwarded_then_raised(tmp_path: Path, sig: signal.Signals) -> None:
    # A grace far above the communicate() bound: the workers must stop on the
    # forwarded signal itself, not on the SIGKILL that ends the grace.
    with _start(tmp_path, "binary", "300", str(tmp_path / "logs")) as (proc, pids):
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {
        "outcome": "signal",
        "sigval": sig.name,
        "restored": True,
        "hup_ignored": False,
    }, err
    assert proc.returncode == 0
    assert "SIGKILL" not in err, err
    assert not any(alive(p) for p in pids.values())


def test_signal_ignoring_workers_get_sigkill_after_grace(tmp_path: Path) -> None:
    # `ready$RANK` once SIGTERM is ignored: one sent before would kill the shell.
    script = f"trap '' TERM; : > {tmp_path}/ready$RANK; while :; do sleep 0.05; done"
    with _start(tmp_path, "binary", "0.3", str(tmp_path / "logs"), script) as (proc, pids):
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "workers never ready"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        # Bounded by the 0.3 s grace, not by the workers (they ignore SIGTERM).
        out, err = proc.communicate(timeout=30)
    assert json.loads(out.strip().splitlines()[-1])["sigval"] == "SIGTERM"
    assert "SIGKILL" in err
    assert not any(alive(p) for p in pids.values())


def test_inherited_sig_ign_stays_ignored(tmp_path: Path) -> None:
    logs = str(tmp_path / "logs")
    with _start(tmp_path, "binary", "5", logs, ignore_hup=True) as (proc, pids):
        proc.send_signal(signal.SIGHUP)  # ignored, as nohup asked: workers keep running
        # No event marks "a signal was ignored"; the SIGTERM below is the real
        # check (a handled SIGHUP, delivered first, would be the reported one).
        time.sleep(0.3)
        assert proc.poll() is None and all(alive(p) for p in pids.values())
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
    with _start(tmp_path, kind, "5", str(tmp_path / "w")) as (proc, pids):
        grandchildren = _grandchildren(tmp_path / "w")
        proc.kill()
        proc.communicate(timeout=30)
    assert not wait_dead([*pids.values(), *grandchildren])


async def test_application_loop_signal_handler_is_restored(tmp_path: Path) -> None:
    # An orchestration service that handles SIGHUP itself keeps its handler
    # after a wait() borrowed the signal (no signal is sent here).
    import asyncio

    import aiolaunch

    loop = asyncio.get_running_loop()
    calls: list[str] = []
    before = signal.getsignal(signal.SIGHUP)  # SIG_IGN under nohup

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
        signal.signal(signal.SIGHUP, before)
