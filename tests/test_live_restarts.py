"""The live view is true across the agent's restarts (#46 items 14, 15).

A job of the CLI restarts its whole group (``--max-restarts``): each attempt
is a new group. The live view must count those restarts as it counts a
restart policy's (``status``, ``/metrics``, ``events``), and the metrics
address a scraper is pointed at must live as long as the job: a port taken
by another process between two attempts must not end the job.
"""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import subprocess
import textwrap
import threading
import urllib.request
from typing import TYPE_CHECKING, Any

from _helpers import cli_argv as _cli
from _helpers import cli_env as _env
from _helpers import driver, wait_until

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import os, pathlib, sys, time
    here = pathlib.Path(sys.argv[1])
    rank = int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"up {attempt}", flush=True)
    if attempt < 2:
        while not (here / f"fail{attempt}").exists():
            time.sleep(0.05)
        if rank == 1:
            sys.exit(1)
        time.sleep(3600)
    while not (here / "done").exists():
        time.sleep(0.05)
    """
)


def _until(what: str, check: Callable[[], object], timeout: float = 60.0) -> Any:
    return wait_until(what, check, timeout, period=0.05)


@contextlib.contextmanager
def _intruder(port: int) -> Iterator[tuple[list[int], Callable[[], None]]]:
    """Another process's socket trying to take ``port`` every 10 ms meanwhile;
    yields the list of its successes (a bind that took the port, then let go)
    and the call that stops it (before the job ends and lets the port go)."""
    took: list[int] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                    s.listen(1)
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE:
                        raise
                else:
                    took.append(port)
                    # Held a while, as a real process would (the next attempt's
                    # start then finds it taken).
                    stop.wait(2.0)
            stop.wait(0.01)

    def halt() -> None:
        stop.set()
        t.join(10)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield took, halt
    finally:
        halt()


def _scrape(url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_restarts_of_the_job_are_counted_and_the_metrics_address_outlives_attempts(
    tmp_path: Path,
) -> None:
    from aiolaunch import free_port

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    argv = _cli(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--metrics-port",
        str(port),
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        str(script),
        str(tmp_path),
    )

    def sockets(attempt: int) -> list[Path]:
        return list(logs.glob(f"*/attempt_{attempt}/control.sock"))

    def up(attempt: int) -> bool:
        outs = list(logs.glob(f"*/attempt_{attempt}/*/stdout.log"))
        return len(outs) == 2 and all(f"up {attempt}" in p.read_text() for p in outs)

    with driver(argv, env=_env(), stdout=subprocess.DEVNULL) as job:
        _until("attempt 0's control socket", lambda: sockets(0) and up(0))
        # From now on another process tries to take the port (the job holds it).
        events_cmd = _cli("events", str(logs), "--json")
        with (
            _intruder(port) as (took, halt),
            driver(events_cmd, env=_env(), stderr=None) as events,
        ):
            assert events.stdout is not None
            lines = [events.stdout.readline()]  # the stream is open: attempt 0's history
            for attempt in (1, 2):
                (tmp_path / f"fail{attempt - 1}").write_text("")

                def next_up(attempt: int = attempt) -> bool:
                    return bool(sockets(attempt)) and up(attempt)

                _until(f"attempt {attempt}", next_up)
            assert job.poll() is None, "the job ended between two attempts"
            fams = _until("metrics of attempt 2", lambda: _scrape(url))
            restarts = {
                s.labels["rank"]: s.value for s in fams["aiolaunch_worker_restarts"].samples
            }
            assert restarts == {"0": 2.0, "1": 2.0}
            assert fams["aiolaunch_group_restarts"].samples[0].value == 4
            status = subprocess.run(
                _cli("status", str(logs), "--json"),
                env=_env(),
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            assert [w["restarts"] for w in json.loads(status.stdout)["workers"]] == [2, 2]
            halt()  # the job ends now, and the port is free again
            (tmp_path / "done").write_text("")
            assert job.wait(timeout=120) == 0
            lines += events.stdout.readlines()
            assert events.wait(timeout=60) == 0
    assert took == [], "another process took the metrics port between two attempts"
    msgs = [json.loads(line) for line in lines if line.strip()]
    started = [(m["rank"], m["attempt"]) for m in msgs if m["event"] == "started"]
    assert sorted(started) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)], [
        m for m in msgs if m["event"] == "started"
    ]
    restarting = sorted((m["rank"], m["attempt"]) for m in msgs if m["event"] == "restarting")
    assert restarting == [(0, 1), (0, 2), (1, 1), (1, 2)], msgs


def test_a_metrics_port_in_use_is_an_error_before_anything_starts(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    logs = tmp_path / "logs"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        argv = _cli(
            "--nproc-per-node", "2", "--metrics-port", str(port), "--log-dir", str(logs),
            str(script),
        )  # fmt: skip
        r = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr
    assert "--metrics-port" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "job.py.ran").exists(), "a worker ran"
    assert not list(logs.glob("*/attempt_*")), "an attempt's folder was made"
