"""An application's own signal handling beside ``wait()``; a second signal escalates.

Real supervisors (a tiny service script, the CLI) get real signals; workers
are ``/bin/sh`` loops. Signals go to processes we start, never to the runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import anyio
import pytest

from _helpers import alive, driver, start, wait_dead

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

# A service: it may install its own SIGTERM handler (mode), waits on a group
# in a background task, and reports what happened as one JSON line.
SERVICE = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys, time
    import aiolaunch

    async def main():
        mode, logdir, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
        loop = asyncio.get_running_loop()
        graceful = asyncio.Event()
        calls = []

        def signalled(pid):
            # The worker blocks SIGTERM: once sent, it shows as pending in
            # /proc until the worker sees it and exits (then it is gone or a
            # zombie). Either way: it was signalled.
            try:
                with open(f"/proc/{pid}/status") as f:
                    status = dict(line.split(":", 1) for line in f)
            except OSError:
                return True
            if status["State"].split()[0] in ("Z", "X"):
                return True
            pending = int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)
            return bool(pending >> (signal.SIGTERM - 1) & 1)

        def workers_signalled():
            return all(signalled(pid) for pid in ctx.pids().values())

        def on_loop_term():
            calls.append(["loop", workers_signalled()])
            graceful.set()

        def on_python_term(signum, frame):
            calls.append([f"python:{signum}", workers_signalled()])
            graceful.set()

        if mode == "loop":
            loop.add_signal_handler(signal.SIGTERM, on_loop_term)
        elif mode == "python":
            signal.signal(signal.SIGTERM, on_python_term)
        elif mode == "ignore":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        entrypoint = "/bin/sh"
        if mode == "stubborn":
            # Survives SIGINT and SIGTERM, noting them (the test's handshake).
            argv = ("-c", f"trap 'echo x >> {logdir}.sig' INT TERM; while :; do sleep 0.05; done")
        elif mode in ("loop", "python"):
            # Blocks SIGTERM/SIGINT and exits once one is pending (see signalled()).
            entrypoint, argv = sys.executable, ("-c", (
                "import signal, time\\n"
                "stop = {signal.SIGTERM, signal.SIGINT}\\n"
                "signal.pthread_sigmask(signal.SIG_BLOCK, stop)\\n"
                "while not signal.sigpending() & stop:\\n"
                "    time.sleep(0.01)\\n"
            ))
        else:
            argv = ("-c", "trap 'exit 0' INT TERM; while :; do sleep 0.05; done")
        before_int = signal.getsignal(signal.SIGINT)
        ctx = await aiolaunch.start_processes(
            name="s", entrypoint=entrypoint, args={0: argv, 1: argv},
            envs={0: {}, 1: {}}, log_dir=logdir, shutdown_timeout=grace)
        outcome = {}

        async def waiter():
            try:
                await ctx.wait()
                outcome["wait"] = "returned"
            except aiolaunch.SignalException as exc:
                outcome["wait"] = exc.sigval.name

        task = asyncio.ensure_future(waiter())
        # Handshake: wait() has taken the signals over before the test sends any.
        deadline = time.monotonic() + 30
        while signal.getsignal(signal.SIGINT) is before_int:
            assert time.monotonic() < deadline and not task.done(), "wait() took no signals"
            await asyncio.sleep(0.001)
        print(json.dumps({"pids": list(ctx.pids().values())}), flush=True)
        t0 = time.monotonic()
        if mode in ("loop", "python"):
            await asyncio.wait_for(graceful.wait(), 60)
        await task
        if mode == "loop":
            handle = loop._signal_handlers[signal.SIGTERM]
            restored = handle._callback is on_loop_term
        elif mode == "python":
            restored = signal.getsignal(signal.SIGTERM) is on_python_term
        else:
            restored = signal.getsignal(signal.SIGTERM) in (signal.SIG_IGN, signal.SIG_DFL)
        print(json.dumps({
            "calls": calls, "restored": restored, "elapsed": time.monotonic() - t0,
            "term_ignored": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, **outcome,
        }), flush=True)

    asyncio.run(main())
    """
)


@contextlib.contextmanager
def _service(
    tmp_path: Path, mode: str, grace: float
) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    script = tmp_path / "service.py"
    script.write_text(SERVICE)
    argv = [sys.executable, str(script), mode, str(tmp_path / "logs"), str(grace)]
    with driver(argv) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            _, err = proc.communicate()
            pytest.fail(f"service died early: {err}")
        yield proc, json.loads(line)["pids"]


def _report(proc: subprocess.Popen[str]) -> tuple[dict[str, object], str]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.parametrize("mode", ["loop", "python"])
def test_application_sigterm_handler_runs_after_workers_are_signalled(
    tmp_path: Path, mode: str
) -> None:
    # The service's own SIGTERM handler runs (once) after every worker was
    # sent SIGTERM, the group waited on in the background is stopped and its
    # wait() raises, and the service keeps running with its handler back.
    with _service(tmp_path, mode, 300) as (proc, pids):
        proc.send_signal(signal.SIGTERM)
        report, err = _report(proc)
    expected = [["loop", True]] if mode == "loop" else [[f"python:{int(signal.SIGTERM)}", True]]
    assert report["calls"] == expected, err
    assert report["wait"] == "SIGTERM"
    assert report["restored"] is True
    assert not wait_dead(pids)


def test_application_sig_ign_keeps_sigterm_ignored(tmp_path: Path) -> None:
    # SIGTERM ignored by the application stays ignored while wait() runs: it
    # neither stops the group nor reaches the workers; SIGINT still does.
    with _service(tmp_path, "ignore", 300) as (proc, pids):
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        report, err = _report(proc)
    assert report["wait"] == "SIGINT", err
    assert report["term_ignored"] is True
    assert not wait_dead(pids)


def test_second_sigint_escalates_to_sigkill(tmp_path: Path) -> None:
    # Workers survive SIGINT and SIGTERM; the grace is 300 s. The second SIGINT
    # ends it at once, with a one-line note.
    with _service(tmp_path, "stubborn", 300) as (proc, pids):
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        # The first one reached the workers (two pending SIGINTs would merge into one).
        marker = tmp_path / "logs.sig"
        while not marker.exists():
            assert time.monotonic() - t0 < 30, "SIGINT never forwarded"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        report, err = _report(proc)
        assert time.monotonic() - t0 < 30
    assert report["wait"] == "SIGINT"
    assert "second SIGINT during shutdown; sending SIGKILL" in err
    assert not wait_dead(pids)


def test_single_sigint_waits_for_the_grace_period(tmp_path: Path) -> None:
    # Without the second signal, stubborn workers get the whole grace (1.5 s)
    # before SIGKILL: escalation only happens on a repeat.
    with _service(tmp_path, "stubborn", 1.5) as (proc, pids):
        proc.send_signal(signal.SIGINT)
        report, err = _report(proc)
    assert report["wait"] == "SIGINT"
    assert isinstance(report["elapsed"], float) and report["elapsed"] >= 1.4
    assert "second" not in err
    assert not wait_dead(pids)


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (``SigCgt`` in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_cli_second_sigint_kills_workers_at_once(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    script = (
        f"trap 'echo x >> {ready}/sig' INT TERM; echo $$ > " + str(ready) + "/$LOCAL_RANK.tmp; "
        "mv " + str(ready) + "/$LOCAL_RANK.tmp " + str(ready) + "/$LOCAL_RANK; "
        "while :; do sleep 0.05; done"
    )
    argv = [
        sys.executable,
        "-m",
        "aiolaunch",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "30",
        "--log-dir",
        str(tmp_path / "logs"),
        "--no-python",
        "/bin/sh",
        "-c",
        script,
    ]
    with driver(argv) as proc:
        deadline = time.monotonic() + 60
        while len(list(ready.glob("[01]"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "workers never started"
            time.sleep(0.01)
        pids = [int((ready / r).read_text()) for r in ("0", "1")]
        # Workers run before the agent's wait() takes the signals over: wait
        # until the CLI catches SIGTERM (only wait() installs a handler for it).
        while not _catches(proc.pid, signal.SIGTERM):
            assert proc.poll() is None and time.monotonic() < deadline, "wait() never ran"
            time.sleep(0.01)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        while not (ready / "sig").exists():  # forwarded: the second is a repeat
            if time.monotonic() - t0 > 30:
                proc.kill()
                pytest.fail(f"SIGINT never forwarded: {proc.communicate()[1]}")
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    assert took < 20, err  # far below the 30 s grace
    assert proc.returncode != 0
    assert "sending SIGKILL" in err
    assert not wait_dead(pids)


def _stubborn(tmp_path: Path) -> tuple[str, Path, Path]:
    """A worker that survives SIGTERM, noting each one in a file (a handshake)."""
    up, term = tmp_path / "up", tmp_path / "term"
    script = (
        f"trap 'echo t > {term}' TERM; echo $$ > {up}.tmp; mv {up}.tmp {up}; "
        "while :; do sleep 0.05; done"
    )
    return script, up, term


async def _until(path: Path) -> None:
    with anyio.fail_after(30):
        while not path.exists():
            await asyncio.sleep(0.01)


async def test_second_cancellation_of_close_escalates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script, up, term = _stubborn(tmp_path)
    ctx = await start(tmp_path, "/bin/sh", ("-c", script))
    try:
        await _until(up)
        pid = int(up.read_text())
        closing = asyncio.ensure_future(ctx.close(timeout=300))
        await _until(term)  # close() sent SIGTERM and now waits out the grace
        closing.cancel()
        # The first cancellation is held back: the cleanup goes on (a window
        # in which an escalation would have killed the worker).
        await asyncio.sleep(0.3)
        assert not closing.done() and alive(pid)
        with caplog.at_level(logging.WARNING, logger="aiolaunch"):
            closing.cancel()
            with anyio.fail_after(20), pytest.raises(asyncio.CancelledError):
                await closing
        assert "second cancellation of close() during shutdown" in caplog.text
        assert not alive(pid)
    finally:
        await asyncio.shield(ctx.close(signal.SIGKILL, 0))


async def test_cancelled_async_with_then_one_more_cancel_escalates(tmp_path: Path) -> None:
    # Leaving ``async with`` because of a cancellation is the first; one more
    # cancellation while close() waits out the grace is the second.
    script, up, term = _stubborn(tmp_path)

    entered = asyncio.Event()

    async def service() -> None:
        async with start(tmp_path, "/bin/sh", ("-c", script), shutdown_timeout=300):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.ensure_future(service())
    try:
        with anyio.fail_after(30):
            await entered.wait()  # started: a cancel now leaves the block through close()
        await _until(up)
        pid = int(up.read_text())
        task.cancel()
        await _until(term)  # close() runs, the worker ignored SIGTERM
        assert not task.done() and alive(pid)
        task.cancel()
        with anyio.fail_after(20), pytest.raises(asyncio.CancelledError):
            await task
        assert not alive(pid)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_no_forwarding_outside_the_main_thread_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import aiolaunch._signals._watch

    monkeypatch.setattr(aiolaunch._signals._watch, "_said_degraded", False)

    async def run() -> None:
        async with start(tmp_path, "/bin/true") as ctx:
            await ctx.wait()

    with caplog.at_level(logging.INFO, logger="aiolaunch"):
        thread = threading.Thread(target=lambda: asyncio.run(run()))
        thread.start()
        thread.join(60)
    assert not thread.is_alive()
    notes = [r for r in caplog.records if "not forwarded" in r.getMessage()]
    assert [r.levelno for r in notes] == [logging.WARNING]
    assert "outside the main thread" in notes[0].getMessage()


def test_main_returning_while_wait_runs_gives_sigint_back_to_python(tmp_path: Path) -> None:
    """main() returns while another task still awaits wait(): asyncio.run's
    runner puts default_int_handler back only if its own handler is still
    there when its run ends, and wait() held SIGINT then. The loop's
    teardown cancels that task afterwards (``async with`` closes the group),
    and wait() restored the ended run's handler, which outlived asyncio.run.
    Now it restores what the runner would have."""
    pids: list[int] = []

    async def service() -> None:
        async with start(tmp_path, "/bin/sh", ("-c", "exec sleep 300")) as ctx:
            pids.extend(ctx.pids().values())
            await ctx.wait()

    async def main() -> None:
        runners = signal.getsignal(signal.SIGINT)
        task = asyncio.ensure_future(service())
        deadline = time.monotonic() + 60
        while signal.getsignal(signal.SIGINT) is runners:  # until wait() took SIGINT over
            assert not task.done() and time.monotonic() < deadline
            await asyncio.sleep(0.001)

    # As in an interactive session, also when the suite runs as a background
    # job (SIGINT ignored: neither asyncio.run nor wait() would take it).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        asyncio.run(main())
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert pids and not [pid for pid in pids if alive(pid)]
    finally:
        signal.signal(signal.SIGINT, before)


# No wait(): asyncio.run's own SIGINT handler is in place. The first Ctrl-C
# cancels main() and ``async with`` closes the group with a 300 s grace; the
# second makes asyncio.run raise KeyboardInterrupt and cancel every task -
# close() and the shutdown task included - which must SIGKILL the workers at
# once instead of leaving them to the guardian.
_NO_WAIT = """
import asyncio, sys, aiolaunch

async def main():
    marks, n = sys.argv[1], int(sys.argv[2])
    # `ready<rank>` once the trap is set: a SIGTERM before it would kill the
    # shell. With several workers, rank 0 (signalled first) sends the second
    # Ctrl-C itself, while the supervisor is still signalling the others.
    second = '[ "$0" = 0 ] && kill -INT $PPID; ' if n > 1 else ""
    script = (
        f"trap '{second}echo x >> {marks}/sig' INT TERM; : > {marks}/ready$0;"
        " while :; do sleep 0.05; done"
    )
    async with aiolaunch.start_processes(
        name="s", entrypoint="/bin/sh", args={i: ("-c", script, str(i)) for i in range(n)},
        envs={i: {} for i in range(n)}, log_dir=marks + "/logs", shutdown_timeout=300,
    ) as ctx:
        print(*ctx.pids().values(), flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.run handles SIGINT from 3.11")
@pytest.mark.parametrize("workers", [1, 64])
def test_second_ctrl_c_outside_wait_kills_workers_before_exit(tmp_path: Path, workers: int) -> None:
    """asyncio.run's second Ctrl-C raises KeyboardInterrupt wherever the
    main thread is. Finding the loop waiting, it stops the loop, whose
    teardown cancels the group's ending task (SIGKILL now). Sent while that
    task signals 64 workers' trees (by rank 0, the first signalled), it
    lands inside the task: before the fix no SIGKILL followed, the workers
    were left to the guardian after the exit (7 of 10 trials when the test
    sent it; every round when rank 0 does) - now SIGKILL at once as well."""
    script = tmp_path / "no_wait.py"
    script.write_text(_NO_WAIT)
    err = _second_ctrl_c(script, tmp_path, workers)
    assert "sending SIGKILL to the workers now" in err
    assert "KeyboardInterrupt" in err


def _second_ctrl_c(script: Path, marks: Path, workers: int) -> str:
    """Run the script, Ctrl-C it, and again once the grace period began;
    return its stderr after checking that no worker outlived it."""
    with driver([sys.executable, str(script), str(marks), str(workers)]) as proc:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        # Handshake: the workers' traps are set (a fast spawn returns before the
        # shell ran its first line; close()'s SIGTERM would then kill it).
        deadline = time.monotonic() + 60
        while len(list(marks.glob("ready*"))) < workers:
            assert proc.poll() is None and time.monotonic() < deadline, "workers never ready"
            time.sleep(0.01)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        while not (marks / "sig").exists():  # close() sent SIGTERM: grace running
            assert proc.poll() is None and time.monotonic() - t0 < 30, "first SIGINT lost"
            time.sleep(0.001)
        if workers == 1:  # else rank 0 sent it
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30, err
    # Killed and reaped by the supervisor itself, before it exited.
    assert not [pid for pid in pids if alive(pid)], err
    return str(err)


CLEANUP = textwrap.dedent(
    """
    import os, signal, sys, time
    marks = sys.argv[1]
    def on_term(*_):
        open(os.path.join(marks, f"began.{os.environ['LOCAL_RANK']}"), "w").close()
        time.sleep(6)  # a checkpoint that takes a while
        open(os.path.join(marks, f"done.{os.environ['LOCAL_RANK']}"), "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(marks, f"up.{os.environ['LOCAL_RANK']}"), "w").close()
    while True:
        time.sleep(1)
    """
)


@pytest.mark.parametrize("launcher", ["aiolaunch", "torchrun"])
def test_second_sigterm_cuts_the_cleanup_where_torchrun_waits_it_out(
    tmp_path: Path, launcher: str
) -> None:
    # docs/migration.md: aiolaunch escalates on a second SIGTERM, torchrun
    # does not (it waits for the workers' cleanup). Behaviour, not timing:
    # whether the workers' cleanup got to its end. The times are measured
    # in benchmarks/second_signal.py.
    if launcher == "torchrun":
        pytest.importorskip("torch.distributed.run")
    prog = ["-m", "aiolaunch"] if launcher == "aiolaunch" else ["-m", "torch.distributed.run"]
    script, marks = tmp_path / "w.py", tmp_path / "marks"
    script.write_text(CLEANUP)
    marks.mkdir()
    argv = [sys.executable, *prog, "--nproc-per-node", "2", str(script), str(marks)]
    with driver(argv, stdout=subprocess.DEVNULL) as proc:
        deadline = time.monotonic() + 120
        while len(list(marks.glob("up.*"))) < 2 or not _catches(proc.pid, signal.SIGTERM):
            assert proc.poll() is None and time.monotonic() < deadline, "workers never started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        while len(list(marks.glob("began.*"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "SIGTERM not forwarded"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    done = sorted(p.name for p in marks.glob("done.*"))
    if launcher == "aiolaunch":
        assert done == [], err  # SIGKILLed in the middle of the cleanup
        assert "sending SIGKILL" in err
    else:
        assert done == ["done.0", "done.1"], err  # torchrun waited it out
