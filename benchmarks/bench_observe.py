"""Live observability: what ``aiolaunch top`` and a Prometheus scrape cost the supervisor.

    python benchmarks/bench_observe.py [--quick] [--ranks 64] [--json OUT]

A supervisor process runs N ranks (64 idle ``sleep`` binaries, log files,
``metrics_port`` set, no watchdog: ``status`` then reads ``/proc`` itself on
every request, its dearest case). This script measures that process's CPU
(``/proc/<pid>/stat`` utime+stime) in windows, interleaved round by round:

- ``idle``: nobody asks anything;
- ``top``: the real ``aiolaunch top LOG_DIR`` in an 80x24 tmux window,
  refreshing once a second (without tmux: the same 1 Hz ``status`` requests
  on one connection, from here);
- ``scrape_1hz``: ``GET /metrics`` once a second (Prometheus scrapes every
  15-60 s: 1 Hz is 15x the usual load).

Reported: CPU-ms per second of each window and the added cost over ``idle``
as % of one core (target, issue #25: top < 1 % of one core at 64 ranks),
plus the CPU of one ``status`` request and one scrape, from 200 back-to-back
requests each (less noise than the 1 Hz windows on a shared machine).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

SUPERVISOR = """
import asyncio, sys
import aiolaunch

async def main() -> None:
    n, log_dir, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    async with aiolaunch.start_processes(
        "bench", "sleep", {r: ("100000",) for r in range(n)}, {r: {} for r in range(n)},
        log_dir=log_dir, redirects=aiolaunch.Std.ALL, metrics_port=port,
    ) as ctx:
        print("ready", flush=True)
        await ctx.wait()

try:
    asyncio.run(main())
except aiolaunch.SignalException:
    pass
"""

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _socket_of(log_dir: str) -> str:
    path = os.path.join(log_dir, "control.sock")
    return os.readlink(path) if os.path.islink(path) else path


class _Status:
    """1 Hz status requests on one connection (what top does), without a terminal."""

    def __init__(self, log_dir: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(_socket_of(log_dir))
        self.buf = b""

    def ask(self) -> dict[str, Any]:
        self.sock.sendall(b'{"cmd": "status"}\n')
        while b"\n" not in self.buf:
            self.buf += self.sock.recv(1 << 20)
        line, _, self.buf = self.buf.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        self.sock.close()


def _window(pid: int, seconds: float, tick: Any = None) -> float:
    """Supervisor CPU-ms per second over ``seconds``; ``tick()`` once a second meanwhile."""
    c0, t0 = _cpu(pid), time.monotonic()
    n = 0
    while (left := t0 + seconds - time.monotonic()) > 0:
        if tick is not None:
            tick()
            n += 1
        time.sleep(min(1.0, left))  # allowed: a benchmark's fixed rate
    return 1000 * (_cpu(pid) - c0) / (time.monotonic() - t0)


def _top_window(pid: int, log_dir: str, seconds: float) -> float:
    if shutil.which("tmux") is None:
        client = _Status(log_dir)
        try:
            return _window(pid, seconds, client.ask)
        finally:
            client.close()
    name = f"bench-observe-{uuid.uuid4().hex[:8]}"
    cmd = shlex.join([sys.executable, "-m", "aiolaunch", "top", log_dir])
    tmux = ["tmux", "-L", name]
    subprocess.run(
        [
            *tmux,
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-x",
            "80",
            "-y",
            "24",
            f"env TERM=xterm PYTHONPATH={shlex.quote(_env()['PYTHONPATH'])} {cmd}",
        ],
        check=True,
    )
    try:
        time.sleep(1.5)  # allowed: top's start (an interpreter) is not the cost measured
        return _window(pid, seconds)
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, capture_output=True)


def _scraper(port: int) -> tuple[http.client.HTTPConnection, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def scrape() -> None:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read()
        assert b"aiolaunch_worker_up" in body

    return conn, scrape


def _per_request(pid: int, idle_ms_s: float, count: int, fn: Any) -> float:
    c0, t0 = _cpu(pid), time.monotonic()
    for _ in range(count):
        fn()
    elapsed = time.monotonic() - t0
    return (1000 * (_cpu(pid) - c0) - idle_ms_s * elapsed) / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rounds, window = (1, 5.0) if args.quick else (3, 20.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res: dict[str, Any] = {"ranks": args.ranks, "load": os.getloadavg(), "nproc": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench_observe_") as tmp:
        script = os.path.join(tmp, "supervisor.py")
        with open(script, "w") as f:
            f.write(SUPERVISOR)
        log_dir = os.path.join(tmp, "logs")
        sup = subprocess.Popen(
            [sys.executable, script, str(args.ranks), log_dir, str(port)],
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        try:
            assert sup.stdout is not None and sup.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(log_dir, "control.sock")):
                assert time.monotonic() < deadline, "no control socket"
                time.sleep(0.05)  # allowed: waiting for another process's socket
            time.sleep(2)  # allowed: let the start-up settle before measuring
            conn, scrape = _scraper(port)
            samples: dict[str, list[float]] = {"idle": [], "top": [], "scrape_1hz": []}
            for _ in range(rounds):
                samples["idle"].append(_window(sup.pid, window))
                samples["top"].append(_top_window(sup.pid, log_dir, window))
                samples["scrape_1hz"].append(_window(sup.pid, window, scrape))
            idle = statistics.median(samples["idle"])
            client = _Status(log_dir)
            status_ms = _per_request(sup.pid, idle, 200, client.ask)
            client.close()
            scrape_ms = _per_request(sup.pid, idle, 200, scrape)
            conn.close()
        finally:
            sup.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                sup.communicate(timeout=60)
            if sup.poll() is None:
                sup.kill()
                sup.communicate()
    res["cpu_ms_per_s"] = {k: statistics.median(v) for k, v in samples.items()}
    res["added_percent_of_one_core"] = {
        k: (statistics.median(v) - idle) / 10 for k, v in samples.items() if k != "idle"
    }
    res["cpu_ms_per_status_request"] = status_ms
    res["cpu_ms_per_scrape"] = scrape_ms
    res["samples"] = samples
    print(
        f"{args.ranks} ranks, {rounds} x {window:g} s windows, load {res['load'][0]:.1f} "
        f"on {res['nproc']} cores"
    )
    for k, v in res["cpu_ms_per_s"].items():
        extra = (
            "" if k == "idle" else f"  (+{res['added_percent_of_one_core'][k]:.3f} % of one core)"
        )
        print(f"  {k:<11} {v:7.2f} CPU-ms/s{extra}")
    print(f"  one status request: {status_ms:.2f} CPU-ms; one scrape: {scrape_ms:.2f} CPU-ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
