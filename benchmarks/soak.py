"""Soak: N consecutive contexts in one process; fds, threads and RSS must stay flat.

    python benchmarks/soak.py [-n 1000] [--workers 2] [--json out.json]

Each iteration runs one context, alternating function workers (spawn, a
return value, an exception every 7th run) and binary workers (output tee'd to
a log file and the console hook; a crash every 5th run; a SIGTERM-ignoring
worker stopped by ``close()`` every 11th run). After a warm-up (thread pools,
the guardian, the lifeline, multiprocessing's resource tracker are started
once), the process is sampled every ``--every`` iterations:

- open fds (``/proc/self/fd``): must not grow at all past the warm-up;
- threads outside the bounded pools (aiolaunch's log writers, asyncio's
  default executor, which start threads lazily up to a fixed bound): must not
  grow at all; pool threads: never above the pools' bound;
- RSS (``/proc/self/status`` VmRSS): the mean of the last quarter of samples
  may exceed the mean of the first quarter by at most ``--rss-tolerance-mb``
  (default 8 MiB) - allocator noise, not per-iteration growth;
- child processes: none may be left after an iteration.

Exits 0 when flat, 1 otherwise, printing the samples and the verdict (and
writing them as JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

import aiolaunch
from aiolaunch import Std

IGNORE_TERM = "trap '' TERM; echo up; while :; do sleep 0.05; done"


def fn_ok(i: int) -> dict[str, int]:
    print(f"function {i}", flush=True)
    return {"i": i, "pid": os.getpid()}


def fn_fail(i: int) -> None:
    raise RuntimeError(f"planned failure {i}")


# Bounded pools that start threads lazily: aiolaunch's log writers (4) and
# asyncio's default executor (min(32, cpus + 4)).
_POOLS = ("aiolaunch-log", "asyncio_")
POOL_BOUND = 4 + min(32, (os.cpu_count() or 1) + 4)


def _threads() -> tuple[int, int]:
    """(threads outside the bounded pools, threads in them)."""
    names = [t.name for t in threading.enumerate()]
    pooled = sum(1 for n in names if n.startswith(_POOLS))
    return len(names) - pooled, pooled


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _children() -> list[int]:
    me = str(os.getpid())
    found = []
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(b")") + 2 :].split()[1].decode() == me:
            found.append(int(e))
    return found


def _helper_pids() -> set[int]:
    from aiolaunch._workers import long_lived_helpers

    pids = set(long_lived_helpers()[0])  # the guardian
    tracker = getattr(
        sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None
    )
    pid = getattr(tracker, "_pid", None)
    if isinstance(pid, int):
        pids.add(pid)
    return pids


async def one(i: int, workers: int, root: str, lines: list[str]) -> None:
    log_dir = os.path.join(root, f"run{i}")
    kind = i % 2
    if kind == 0:
        fail = i % 14 == 0
        async with aiolaunch.start_processes(
            name="f",
            entrypoint=fn_fail if fail else fn_ok,
            args={r: (i,) for r in range(workers)},
            envs={r: {} for r in range(workers)},
            log_dir=log_dir,
            redirects=Std.ALL,
            tee=Std.OUT,
        ) as ctx:
            result = await ctx.wait()
        assert result is not None
        assert result.is_failed() == fail, (i, result)
        if not fail:
            assert sorted(result.return_values) == list(range(workers))
    else:
        crash = i % 5 == 0
        stubborn = i % 11 == 0
        script = "echo out; echo err >&2; exit 3" if crash else "echo out; echo err >&2"
        args = {r: ("-c", script) for r in range(workers)}
        if stubborn:
            args = {r: ("-c", IGNORE_TERM) for r in range(workers)}
        async with aiolaunch.start_processes(
            name="b",
            entrypoint="/bin/sh",
            args=args,
            envs={r: {} for r in range(workers)},
            log_dir=log_dir,
            redirects=Std.ALL,
            tee=Std.OUT,
            shutdown_timeout=0.2,
        ) as ctx:
            if stubborn:
                assert await ctx.wait(timeout=0.05) is None
                await ctx.close(timeout=0.2)
                result = await ctx.wait()
                assert result is not None and not result.is_failed()
            else:
                result = await ctx.wait()
                assert result is not None and result.is_failed() == crash, (i, result)
    # Keep the disk flat too.
    import shutil

    shutil.rmtree(log_dir, ignore_errors=True)
    if len(lines) > 10_000:
        del lines[:]


async def soak(n: int, workers: int, every: int, warmup: int) -> dict[str, Any]:
    import logging

    logging.getLogger("aiolaunch").setLevel(logging.ERROR)  # SIGKILL escalation is planned
    lines: list[str] = []

    def hook(stream: Any, text: str) -> None:
        lines.append(text)

    aiolaunch.set_console_hook(hook)
    samples: list[dict[str, Any]] = []
    leftovers: list[tuple[int, list[int]]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="aiolaunch-soak-") as root:
        for i in range(n):
            await one(i, workers, root, lines)
            kids = [p for p in _children() if p not in _helper_pids()]
            if kids:
                leftovers.append((i, kids))
            if i >= warmup and (i - warmup) % every == 0:
                samples.append(
                    {
                        "i": i,
                        "fds": _fds(),
                        "threads": _threads()[0],
                        "pool_threads": _threads()[1],
                        "rss_kib": _rss_kib(),
                        "t": round(time.monotonic() - t0, 2),
                    }
                )
    aiolaunch.set_console_hook(None)
    return {"samples": samples, "leftovers": leftovers, "seconds": time.monotonic() - t0}


def _grew(values: list[int]) -> bool:
    base = values[0]
    return values[-1] > base or any(min(a, b) > base for a, b in itertools.pairwise(values))


def verdict(report: dict[str, Any], rss_tolerance_mb: float) -> list[str]:
    problems = []
    samples = report["samples"]
    if len(samples) < 4:
        return [f"too few samples ({len(samples)}): raise -n or lower --every"]
    fds = [s["fds"] for s in samples]
    threads = [s["threads"] for s in samples]
    # A leak stays: the last sample above the first, or two samples in a row
    # above it. One sample above, then back, is a close still in flight (the
    # inotify fd is closed in a thread: the kernel waits an RCU grace period).
    if _grew(fds):
        problems.append(f"fds grew: {fds[0]} -> max {max(fds)} (samples {fds})")
    if _grew(threads):
        problems.append(f"threads grew: {threads[0]} -> max {max(threads)} (samples {threads})")
    pooled = max(s["pool_threads"] for s in samples)
    if pooled > POOL_BOUND:
        problems.append(f"{pooled} pool threads: more than the pools' bound {POOL_BOUND}")
    q = max(1, len(samples) // 4)
    first = sum(s["rss_kib"] for s in samples[:q]) / q
    last = sum(s["rss_kib"] for s in samples[-q:]) / q
    if last - first > rss_tolerance_mb * 1024:
        problems.append(
            f"RSS grew {(last - first) / 1024:.1f} MiB (> {rss_tolerance_mb} MiB): "
            f"{first / 1024:.1f} -> {last / 1024:.1f} MiB"
        )
    if report["leftovers"]:
        problems.append(f"child processes left after iterations: {report['leftovers'][:5]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=1000, help="contexts to run (default 1000)")
    p.add_argument("--workers", type=int, default=2, help="workers per context")
    p.add_argument("--every", type=int, default=0, help="sample period (default n/40)")
    p.add_argument(
        "--warmup", type=int, default=0, help="iterations before sampling (default n/10, >= 6)"
    )
    p.add_argument("--rss-tolerance-mb", type=float, default=8.0)
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    warmup = a.warmup or max(6, a.n // 10)
    every = a.every or max(1, (a.n - warmup) // 40)
    report = asyncio.run(soak(a.n, a.workers, every, warmup))
    problems = verdict(report, a.rss_tolerance_mb)
    report["problems"] = problems
    for s in report["samples"]:
        print(
            f"iter {s['i']:5d}  fds {s['fds']:4d}  threads {s['threads']:3d}  "
            f"rss {s['rss_kib'] / 1024:7.1f} MiB  t {s['t']}s"
        )
    print(f"{a.n} contexts in {report['seconds']:.1f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    if problems:
        print("NOT FLAT:\n  " + "\n  ".join(problems))
        return 1
    print("flat: fds and threads constant, RSS within tolerance, no child left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
