"""Hangs of real jobs (issue #22): spin detection, sampling overhead, stragglers.

    python benchmarks/bench_hangs.py [--quick] [--only NAME,...] [--json OUT]
    python benchmarks/bench_hangs.py --only balanced --balanced-minutes 10

- ``spin``: a rank stamps ``time.monotonic()`` and spins (100 % CPU, no
  output, its stack still) while three others keep printing; the time from
  that moment until ``wait()`` returns its stall failure, minus
  ``stall_after=3``. Stacks are sampled once a second (the period for
  ``stall_after <= 10``), from the first busy, quiet interval: expected 1-2 s.
- ``sampling``: what stack sampling costs at N = 4, 16, 64 ranks, once a
  second (``stall_after=10``), in % of one core. Every rank computes without
  output (a moving stack: the worst case, each is sampled every period).
  Supervisor: its CPU with the watchdog minus without, same workers. Workers:
  what answering costs them - their CPU (``schedstat``, every thread) while
  idle ranks are sampled once a second, minus while they are not, per dump -
  times N dumps a second.
- ``straggler`` (torch): 4 gloo ranks whose data loader sleeps 0.1 s, rank 3's
  0.2 s, ``Watchdog(stragglers=0.5)``: seconds from the first collective
  (every rank printed ``joined``) to ``WorkerStraggling``; also that no other
  rank was named.
- ``balanced`` (torch): the same job with every loader at a random 0.05-0.15 s
  per step, for ``--balanced-minutes`` (default 1; the issue's check is 10):
  ``WorkerStraggling`` and ``WorkerStalled`` events (both should be 0).

Report the host's load (printed) with any number: the host is shared.
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
from typing import Any

import aiolaunch

SPINNER = (
    "import sys, time\nprint('up', flush=True)\ntime.sleep(float(sys.argv[1]))\n"
    "print('spin', time.monotonic(), flush=True)\nwhile True:\n    pass\n"
)
TALKER = (
    "import time\nprint('up', flush=True)\n"
    "while True:\n    print('x', flush=True)\n    time.sleep(0.2)\n"
)
COMPUTE = (
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "print('up', flush=True)\nwhile True:\n    fib(18)\n"
)
SLEEPER = "import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(3600)\n"
TRAIN = """
import os, random, sys, time
import torch
import torch.distributed as dist

def load_batch(seconds):
    time.sleep(seconds)

dist.init_process_group("gloo")
rank = dist.get_rank()
print("joined", time.monotonic(), flush=True)
rng = random.Random(rank)
t = torch.ones(16)
while True:
    if sys.argv[1] == "straggler":
        load_batch(0.2 if rank == 3 else 0.1)
    else:
        load_batch(rng.uniform(0.05, 0.15))
    dist.all_reduce(t)
"""


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _workers_cpu(pids: list[int]) -> float:
    """Seconds on a CPU of every thread of ``pids`` (schedstat, ns)."""
    total = 0
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
        except OSError:
            pass
    return total / 1e9


def _script(tmp: str, name: str, text: str) -> str:
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def _boot(script: str, *args: str) -> tuple[str, ...]:
    return ("-m", "aiolaunch._child._bootstrap", script, *args)


async def spin(tmp: str, trials: int) -> list[float]:
    spinner, talker = _script(tmp, "spin.py", SPINNER), _script(tmp, "talk.py", TALKER)
    out: list[float] = []
    for t in range(trials):
        log_dir = os.path.join(tmp, f"spin{t}")
        args = {0: _boot(spinner, "1.0"), **{r: _boot(talker) for r in range(1, 4)}}
        async with aiolaunch.start_processes(
            "spin",
            sys.executable,
            args,
            {r: {} for r in range(4)},
            log_dir=log_dir,
            redirects=aiolaunch.Std.ALL,
            watchdog=aiolaunch.Watchdog(stall_after=3.0),
        ) as ctx:
            result = await ctx.wait()
            end = time.monotonic()
        assert result is not None and list(result.failures) == [0], result
        assert "spinning" in str(result.failures[0].message), result.failures[0].message
        with open(os.path.join(log_dir, "0", "stdout.log")) as f:
            began = float(next(line for line in f if line.startswith("spin")).split()[1])
        out.append(end - began - 3.0)
    return out


async def _window_cpu(
    tmp: str, n: int, seconds: float, script: str, wd: aiolaunch.Watchdog | None, sample: bool
) -> tuple[float, float]:
    """(supervisor CPU-ms/s, workers CPU-ms/s) over ``seconds`` with ``n`` ranks."""
    tag = f"{n}-{wd is not None}-{sample}-{os.path.basename(script)}"
    async with aiolaunch.start_processes(
        "cpu",
        sys.executable,
        {r: _boot(script) for r in range(n)},
        {r: {} for r in range(n)},
        log_dir=os.path.join(tmp, tag),
        redirects=aiolaunch.Std.ALL,
        ready=aiolaunch.ReadyLine("up"),
        watchdog=wd,
    ) as ctx:
        await ctx.wait_ready(timeout=300)
        pids = list(ctx.pids().values())
        stacks = ctx._hangs.stacks  # the sampler the watchdog uses
        await asyncio.sleep(2.0)  # allowed: let the start settle before measuring
        c0, w0, t0 = _cpu(), _workers_cpu(pids), time.monotonic()
        while time.monotonic() - t0 < seconds:
            await asyncio.sleep(1.0)  # allowed: one sample a second, as the watchdog
            if sample:
                await stacks.sample(ctx.pids(), 2.0)
        c1, w1, t1 = _cpu(), _workers_cpu(pids), time.monotonic()
        assert await ctx.wait(timeout=0) is None
    return 1000 * (c1 - c0) / (t1 - t0), 1000 * (w1 - w0) / (t1 - t0)


async def sampling(tmp: str, seconds: float) -> dict[str, Any]:
    compute = _script(tmp, "compute.py", COMPUTE)
    sleeper = _script(tmp, "sleep.py", SLEEPER)
    out: dict[str, Any] = {}
    for n in (4, 16, 64):
        # Interleaved, so the host's load hits both alike.
        base, _ = await _window_cpu(tmp, n, seconds, compute, None, False)
        watch = aiolaunch.Watchdog(stall_after=10)
        wd, _ = await _window_cpu(tmp, n, seconds, compute, watch, False)
        _, idle = await _window_cpu(tmp, n, seconds, sleeper, None, False)
        _, dumped = await _window_cpu(tmp, n, seconds, sleeper, None, True)
        per_dump_us = 1000 * (dumped - idle) / n  # CPU-ms/s over n dumps/s -> us per dump
        sup = wd - base
        total = sup + (dumped - idle)
        out[str(n)] = {
            "supervisor_ms_per_s": round(sup, 3),
            "worker_us_per_dump": round(per_dump_us, 1),
            "total_percent_of_a_core": round(total / 10, 3),
        }
        print(
            f"sampling, {n} ranks, 1 sample/s: supervisor +{sup:.2f} CPU-ms/s, workers "
            f"{per_dump_us:.0f} us per dump: {total / 10:.2f} % of one core",
            flush=True,
        )
    return out


async def _gloo(tmp: str, mode: str, seconds: float | None, trial: int = 0) -> dict[str, Any]:
    train = _script(tmp, "train.py", TRAIN)
    log_dir = os.path.join(tmp, f"{mode}{trial}")
    port = aiolaunch.free_port()
    envs = {
        r: {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(r),
        }
        for r in range(4)
    }
    wd = aiolaunch.Watchdog(stall_after=60, action="observe", stragglers=0.5)
    async with aiolaunch.start_processes(
        mode,
        sys.executable,
        {r: _boot(train, mode) for r in range(4)},
        envs,
        log_dir=log_dir,
        redirects=aiolaunch.Std.ALL,
        ready=aiolaunch.ReadyLine("joined"),
        watchdog=wd,
    ) as ctx:
        await ctx.wait_ready(timeout=300)
        joined = time.monotonic()
        limit = seconds if seconds is not None else 120.0
        named: list[aiolaunch.WorkerStraggling] = []
        while time.monotonic() - joined < limit:
            await asyncio.sleep(0.2)  # allowed: polling the event history
            named = [e for e in ctx._bus.history if isinstance(e, aiolaunch.WorkerStraggling)]
            if seconds is None and named:
                break
        stalls = [e for e in ctx._bus.history if isinstance(e, aiolaunch.WorkerStalled)]
        await ctx.close()
    return {
        "named": [(e.rank, e.wait_share, e.peers_wait_share) for e in named],
        "first_s": round(named[0].time - joined, 1) if named else None,
        "stalls": len(stalls),
        "ran_s": round(time.monotonic() - joined, 1),
    }


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="spin,sampling,straggler,balanced")
    p.add_argument("--balanced-minutes", type=float, default=1.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    only = set(args.only.split(","))
    res: dict[str, Any] = {"load_before": _load()}
    print("load average:", res["load_before"], flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_hangs_") as tmp:
        if "spin" in only:
            det = await spin(tmp, 2 if args.quick else 5)
            res["spin_detect_s"] = {"median": statistics.median(det), "max": max(det)}
            print(
                f"spinning hang detected {statistics.median(det):.2f} s (median; max "
                f"{max(det):.2f} s) after stall_after=3",
                flush=True,
            )
        if "sampling" in only:
            res["sampling"] = await sampling(tmp, 5.0 if args.quick else 15.0)
        torch_ok = True
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            torch_ok = False
        if "straggler" in only and torch_ok:
            trials = []
            for i in range(1 if args.quick else 3):
                t = await _gloo(tmp, "straggler", None, i)
                trials.append(t)
                print(
                    f"straggler: named {t['named']} {t['first_s']} s after the first collective",
                    flush=True,
                )
            res["straggler"] = trials
        if "balanced" in only and torch_ok:
            b = await _gloo(tmp, "balanced", 60 * args.balanced_minutes)
            res["balanced"] = b
            print(
                f"balanced run of {b['ran_s']} s: {len(b['named'])} stragglers named, "
                f"{b['stalls']} stalls",
                flush=True,
            )
    res["load_after"] = _load()
    print("load average:", res["load_after"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
