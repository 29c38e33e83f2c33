"""Hang forensics: stall detection latency, stack-dump time, idle CPU of the watchdog.

    python benchmarks/bench_forensics.py [--quick] [--json OUT]

- ``detect_s``: a worker stamps ``time.monotonic()`` and goes quiet (sleeps);
  the time from that moment until ``wait()`` returns the stall failure (stacks
  of every rank dumped, group stopped), *minus* ``stall_after``. The watchdog
  samples /proc once per period (1 s for ``stall_after`` <= 10 s), so the
  expected value is between 1 and 2 periods plus the dump and the shutdown.
- ``dump_ms[N]``: ``await ctx.dump_stacks()`` over N idle Python workers
  (every rank signalled at once, files written), median of several dumps.
- ``idle_cpu_ms_per_s``: supervisor CPU (user+system, this process) per
  second of wall time while 64 workers sleep, with no watchdog and with a
  watchdog sampling once a second (``stall_after=10``), and at the default
  ``stall_after=600`` (one sample every 30 s).

Target (issue #14): idle CPU with the watchdog <= 1 CPU-ms/s at 64 workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import aiolaunch

SLEEPER = "import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(3600)\n"
# Idle, yet never stalled: a write to /dev/null every 3 s (wchar advances) costs
# the supervisor nothing to observe.
TICKER = (
    "import os, time\nprint('up', flush=True)\nnull = os.open(os.devnull, os.O_WRONLY)\n"
    "while True:\n    os.write(null, b'x')\n    time.sleep(3)\n"
)
QUIET_AFTER = (
    "import sys, time\nprint('up', flush=True)\ntime.sleep(float(sys.argv[1]))\n"
    "print('quiet', time.monotonic(), flush=True)\nwhile True:\n    time.sleep(3600)\n"
)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _up(ctx: aiolaunch.PContext, n: int, timeout: float = 300) -> None:
    # Every worker printed "up" (a readiness probe on the line).
    await ctx.wait_ready(timeout=timeout)
    del n


def _script(tmp: str, name: str, text: str) -> str:
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def _boot(script: str, *args: str) -> tuple[str, ...]:
    return ("-m", "aiolaunch._child._bootstrap", script, *args)


async def detection(tmp: str, trials: int, stall_after: float) -> list[float]:
    script = _script(tmp, "quiet.py", QUIET_AFTER)
    out: list[float] = []
    for t in range(trials):
        log_dir = os.path.join(tmp, f"detect{t}")
        n = 4
        # Rank 0 goes quiet 1 s after start; the others keep printing.
        talk = "import time\nwhile True:\n    print('x', flush=True)\n    time.sleep(0.2)\n"
        talker = _script(tmp, "talk.py", talk)
        args = {0: _boot(script, "1.0"), **{r: _boot(talker) for r in range(1, n)}}
        async with aiolaunch.start_processes(
            "det",
            sys.executable,
            args,
            {r: {} for r in range(n)},
            log_dir=log_dir,
            redirects=aiolaunch.Std.ALL,
            watchdog=aiolaunch.Watchdog(stall_after=stall_after, action="fail"),
        ) as ctx:
            result = await ctx.wait()
            end = time.monotonic()
        assert result is not None and list(result.failures) == [0], result
        with open(os.path.join(log_dir, "0", "stdout.log")) as f:
            quiet = float(next(line for line in f if line.startswith("quiet")).split()[1])
        out.append(end - quiet - stall_after)
    return out


async def dump_time(tmp: str, n: int, repeats: int) -> list[float]:
    script = _script(tmp, "sleeper.py", SLEEPER)
    out: list[float] = []
    async with aiolaunch.start_processes(
        f"dump{n}",
        sys.executable,
        {r: _boot(script) for r in range(n)},
        {r: {} for r in range(n)},
        log_dir=os.path.join(tmp, f"dump{n}"),
        redirects=aiolaunch.Std.ALL,
        ready=aiolaunch.ReadyLine("up"),
    ) as ctx:
        await _up(ctx, n)
        for _ in range(repeats):
            t0 = time.perf_counter()
            dumps = await ctx.dump_stacks()
            out.append(time.perf_counter() - t0)
            assert all("time.sleep" in d or "<module>" in d for d in dumps.values()), dumps
    return out


async def idle_cpu(tmp: str, n: int, seconds: float, watchdog: aiolaunch.Watchdog | None) -> float:
    script = _script(tmp, "ticker.py", TICKER)
    tag = "none" if watchdog is None else f"{watchdog.stall_after:g}"
    async with aiolaunch.start_processes(
        "idle",
        sys.executable,
        {r: _boot(script) for r in range(n)},
        {r: {} for r in range(n)},
        log_dir=os.path.join(tmp, f"idle-{tag}"),
        redirects=aiolaunch.Std.ALL,
        ready=aiolaunch.ReadyLine("up"),
        watchdog=watchdog,
    ) as ctx:
        await _up(ctx, n)
        c0, t0 = _cpu(), time.monotonic()
        await asyncio.sleep(seconds)  # allowed: measuring idle CPU over a window
        c1, t1 = _cpu(), time.monotonic()
        assert await ctx.wait(timeout=0) is None  # no stall in the window
    return 1000 * (c1 - c0) / (t1 - t0)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    trials, repeats, window = (2, 3, 5.0) if args.quick else (5, 7, 9.0)
    res: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="bench_forensics_") as tmp:
        det = await detection(tmp, trials, stall_after=2.0)
        res["detect_s"] = {"median": statistics.median(det), "max": max(det), "n": len(det)}
        print(
            f"detection beyond stall_after=2: median {statistics.median(det):.2f} s, "
            f"max {max(det):.2f} s over {len(det)}"
        )
        dumps: dict[str, float] = {}
        for n in (4, 16, 64):
            ts = await dump_time(tmp, n, repeats)
            dumps[str(n)] = 1000 * statistics.median(ts)
            print(f"dump_stacks() of {n} ranks: median {dumps[str(n)]:.1f} ms")
        res["dump_ms"] = dumps
        idle: dict[str, float] = {}
        for label, wd in (
            ("none", None),
            ("stall_after=10 (1 sample/s)", aiolaunch.Watchdog(stall_after=10)),
            ("stall_after=600 (default)", aiolaunch.Watchdog()),
        ):
            idle[label] = await idle_cpu(tmp, 64, window, wd)
            print(f"idle supervisor CPU, 64 workers, watchdog {label}: {idle[label]:.2f} CPU-ms/s")
        res["idle_cpu_ms_per_s"] = idle
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
