"""Collective forensics of real gloo jobs (issue #44): collection, overhead, verdicts, stragglers.

    python benchmarks/bench_collectives.py [--quick] [--only NAME,...] [--json OUT]
    python benchmarks/bench_collectives.py --only balanced --balanced-minutes 10

- ``collect``: N = 4, 16, 64 gloo ranks of one world (forked from a zygote
  that imported torch), each with a full record (64 entries, the default),
  all but rank 0 blocked in an all_reduce; the wall time of one pull of every
  rank's record *and* its parsing (what a stall's verdict waits for), 20
  times; beside it, the supervisor's own CPU in that time (the rest is the
  ranks' server threads answering, and waiting for a core to run them).
  Target: 16 ranks <= 20 ms, 64 ranks <= 100 ms.
- ``overhead``: 4 ranks of a training-like loop (a ~20 ms matmul step, four
  256 KiB all_reduces), rank 0's median step time with recording off
  (``TORCH_FR_BUFFER_SIZE=0``, no watchdog), recording on (a watchdog: the
  record server armed, no pulls), and with the straggler watch pulling every
  rank's record once a second and four times a second; one round of each,
  back to back, three rounds, each compared with its own round's "off" (the
  median of the three). Beside it, what each costs in isolation: a
  collective with recording off, at torch's default (2000 entries, recorded
  by torch 2.13 with no variable set) and at aiolaunch's (64), one rank,
  4000 all_reduces; the CPU one pull costs a rank (its record server's
  thread, ``schedstat``). Target: recording and the periodic pull <= 1 % of
  step time.
- ``verdict``: the five hangs of the issue (a rank that skips an all_reduce,
  calls another op, computes while the others wait, misses a subgroup's
  collective, exits before one), 4 ranks under the CLI with
  ``--stall-timeout 5``, one after the other: the verdict (must be right) and
  for the stalls the time from the hang to the records' folder, minus the
  stall time. Target: right in 5 of 5, within the stall time + 2 s.
- ``straggler``: 4 DDP ranks, rank 3 made 0.1 s late inside ``backward()``
  (a gradient hook), ``stragglers=1``: seconds of training until
  ``WorkerStraggling(source="collectives")``, its ``lateness_s``. Target:
  named within 60 s, ``lateness_s`` within ±20 %.
- ``balanced``: the same DDP job, every rank's data loader at 0.1 s ± 10 %,
  no one late, for ``--balanced-minutes``: ``WorkerStraggling`` and
  ``WorkerStalled`` events (both must be 0; the issue's check is 10 minutes).

Report the host's load (printed) with any number: the host is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import aiolaunch

STALL = 5


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# -- collect ------------------------------------------------------------------------------


def blocked_rank(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    t = torch.ones(64)
    for _ in range(200):  # more than the record keeps: it is full
        dist.all_reduce(t)
    print("blocked", flush=True)
    if rank == 0:
        time.sleep(3600)
    dist.all_reduce(t)


async def collect(tmp: str, ranks: list[int], trials: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in ranks:
        port = aiolaunch.free_port()
        async with aiolaunch.start_processes(
            f"collect{n}", blocked_rank, {r: (r, n, port) for r in range(n)},
            {r: {} for r in range(n)}, log_dir=os.path.join(tmp, f"collect{n}"),
            redirects=aiolaunch.Std.ALL, preload=("torch",), ready=aiolaunch.ReadyLine("blocked"),
            watchdog=aiolaunch.Watchdog(stall_after=3600, action="observe"),
        ) as ctx:  # fmt: skip
            await ctx.wait_ready(timeout=600)
            c = ctx._hangs.collectives
            assert c is not None
            await asyncio.sleep(5.0)  # allowed: the last ones block, the zygote settles
            times, cpu, sizes = [], [], 0
            for _ in range(trials):
                t0, c0 = time.perf_counter(), time.process_time()
                pulled = await c.pull()
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                assert all(p.status == "ok" for p in pulled.values()), pulled
                sizes = sum(len(d) for p in pulled.values() for d in p.dumps)
            look = await c.look(lambda r: False)
            assert look is not None and look.verdict.verdict == "missing", look
            assert look.verdict.ranks == (0,), look.verdict
            await ctx.close()
        times.sort()
        out[str(n)] = {
            "median_ms": round(1000 * statistics.median(times), 2),
            "p90_ms": round(1000 * times[int(0.9 * (len(times) - 1))], 2),
            "bytes": sizes,
            "supervisor_cpu_ms": round(1000 * statistics.median(cpu), 2),
        }
        print(
            f"collect, {n} ranks: {out[str(n)]['median_ms']} ms median, "
            f"{out[str(n)]['p90_ms']} ms p90, of which the supervisor's CPU "
            f"{out[str(n)]['supervisor_cpu_ms']} ms (load {_load()}; "
            f"{sizes / n / 1024:.0f} KiB per rank); "
            f"verdict: {look.verdict.text}",
            flush=True,
        )
    return out


# -- overhead -----------------------------------------------------------------------------


def training_rank(rank: int, world: int, port: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    a = torch.randn(384, 384)
    grads = [torch.randn(64 * 1024) for _ in range(4)]  # 256 KiB each
    times = []
    for step in range(steps + 20):
        t0 = time.perf_counter()
        for _ in range(4):
            a = torch.tanh(a @ a)
        for g in grads:
            dist.all_reduce(g)
        if step >= 20:  # the first steps warm up
            times.append(time.perf_counter() - t0)
    if rank == 0:
        print("steps", json.dumps(times), flush=True)
    dist.destroy_process_group()


async def _steps(tmp: str, tag: str, config: str, steps: int) -> float:
    port = aiolaunch.free_port()
    envs: dict[int, dict[str, str]] = {r: {} for r in range(4)}
    wd = None
    if config == "off":
        envs = {r: {"TORCH_FR_BUFFER_SIZE": "0"} for r in range(4)}
    elif config == "record":
        wd = aiolaunch.Watchdog(stall_after=3600, action="observe")
    else:
        period = {"pull 1/s": 1.0, "pull 4/s": 0.25}[config]
        wd = aiolaunch.Watchdog(stall_after=3600, action="observe", stragglers=period)
    log_dir = os.path.join(tmp, tag)
    async with aiolaunch.start_processes(
        tag, training_rank, {r: (r, 4, port, steps) for r in range(4)}, envs, log_dir=log_dir,
        redirects=aiolaunch.Std.ALL, preload=("torch",), watchdog=wd,
    ) as ctx:  # fmt: skip
        result = await ctx.wait()
    assert result is not None and not result.is_failed(), result
    with open(os.path.join(log_dir, "0", "stdout.log")) as f:
        times = json.loads(next(line for line in f if line.startswith("steps"))[6:])
    return statistics.median(times)


ISOLATED = textwrap.dedent(
    """
    import json, os, socket, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
    t = torch.ones(64)
    for _ in range(500):
        dist.all_reduce(t)
    t0 = time.perf_counter()
    for _ in range(4000):
        dist.all_reduce(t)
    per = (time.perf_counter() - t0) / 4000
    pull = None
    if os.environ.get("AIOLAUNCH_COLLECTIVES") == "1":
        from aiolaunch._child import _record_server as rs
        path = os.path.join(os.environ["AIOLAUNCH_STACKS_DIR"], rs.socket_name(os.getpid()))
        def server_cpu():
            total = 0
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != "pt_workerserver":
                        continue
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            return total
        c0 = server_cpu()
        for _ in range(200):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(b"POST /handler/fr_trace_json HTTP/1.1\\r\\nHost: x\\r\\n"
                      b"Content-Length: 0\\r\\nConnection: close\\r\\n\\r\\n")
            while s.recv(1 << 20):
                pass
            s.close()
        pull = (server_cpu() - c0) / 200 / 1e9
    print(json.dumps({"collective_s": per, "pull_cpu_s": pull}), flush=True)
    dist.destroy_process_group()
    """
)


def _isolated(tmp: str, config: str) -> dict[str, Any]:
    """One rank alone: a collective's time with recording off (``off``),
    torch's default (2000 entries, no aiolaunch), and aiolaunch's (64 entries,
    the record server armed: also what one pull costs the rank)."""
    script = os.path.join(tmp, "isolated.py")
    with open(script, "w") as f:
        f.write(ISOLATED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    if config == "aiolaunch":
        env.update(AIOLAUNCH_COLLECTIVES="1", AIOLAUNCH_STACKS_DIR=os.path.join(tmp, "iso"))
    elif config == "off":
        env["TORCH_FR_BUFFER_SIZE"] = "0"
    init = f"file://{os.path.join(tmp, f'store-{random.getrandbits(64):x}')}"
    proc = subprocess.run(
        [sys.executable, "-m", "aiolaunch._child._bootstrap", script, init],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if not proc.stdout.strip():  # its numbers come first: an abort at exit loses none
        raise RuntimeError(f"isolated rank failed ({proc.returncode}): {proc.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return data


async def overhead(tmp: str, trials: int, steps: int) -> dict[str, Any]:
    configs = ("off", "record", "pull 1/s", "pull 4/s")
    ratios: dict[str, list[float]] = {c: [] for c in configs[1:]}
    steps_ms: dict[str, list[float]] = {c: [] for c in configs}
    for t in range(trials):
        # One round of every configuration, back to back: the host's load
        # changes less within a round than across the run; each is compared
        # with its own round's "off".
        got = {}
        for c in configs:
            tag = f"oh{t}-{c.replace(' ', '').replace('/', '')}"
            got[c] = await _steps(tmp, tag, c, steps)
            steps_ms[c].append(1000 * got[c])
        for c in configs[1:]:
            ratios[c].append(100 * (got[c] - got["off"]) / got["off"])
        print(f"overhead round {t} (load {_load()}): " + ", ".join(
            f"{c} {1000 * got[c]:.2f} ms" for c in configs), flush=True)  # fmt: skip
    out: dict[str, Any] = {
        "step_ms": {c: round(statistics.median(v), 3) for c, v in steps_ms.items()},
        "overhead_percent": {c: round(statistics.median(v), 2) for c, v in ratios.items()},
    }
    iso: dict[str, list[dict[str, Any]]] = {"off": [], "torch": [], "aiolaunch": []}
    for _ in range(3):
        for c in iso:
            iso[c].append(_isolated(tmp, c))
    per = {c: statistics.median(d["collective_s"] for d in v) for c, v in iso.items()}
    pull = statistics.median(d["pull_cpu_s"] for d in iso["aiolaunch"])
    step = statistics.median(steps_ms["off"]) / 1000
    out["isolated"] = {
        "collective_us": {c: round(1e6 * v, 2) for c, v in per.items()},
        "pull_cpu_us": round(1e6 * pull, 1),
        # 4 collectives a step; one pull a second (four) of each rank's record
        "recording_percent_of_step": round(100 * 4 * (per["aiolaunch"] - per["off"]) / step, 3),
        "pull_1s_percent": round(100 * pull, 3),
        "pull_4s_percent": round(400 * pull, 3),
    }
    i = out["isolated"]
    print(
        f"overhead (4 ranks, median step {1000 * step:.1f} ms): "
        + ", ".join(f"{c} {v:+.2f} %" for c, v in out["overhead_percent"].items())
        + f" (median of {trials} rounds); in isolation: a collective "
        + ", ".join(f"{c} {v:.1f} us" for c, v in i["collective_us"].items())
        + f" -> recording {i['recording_percent_of_step']:.3f} % of this step; a pull costs "
        f"a rank {1e6 * pull:.0f} us of CPU: {i['pull_1s_percent']:.3f} % at 1/s, "
        f"{i['pull_4s_percent']:.3f} % at 4/s",
        flush=True,
    )
    return out


# -- verdict ------------------------------------------------------------------------------


async def verdict(tmp: str) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_collectives import EXPECTED, FIRST_FAILURES, HANG

    script = os.path.join(tmp, "hang.py")
    with open(script, "w") as f:
        f.write(HANG)
    out: dict[str, Any] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for mode, expected in EXPECTED.items():
        log_dir = os.path.join(tmp, f"verdict-{mode}")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiolaunch", "--standalone", "--nproc-per-node", "4",
            "--stall-timeout", str(STALL), "--log-dir", log_dir, script, mode,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        )  # fmt: skip
        raw, _ = await proc.communicate()
        text = raw.decode(errors="replace")
        report = next(
            os.path.join(root, "report.json")
            for root, _, files in os.walk(log_dir)
            if "report.json" in files
        )
        with open(report) as f:
            c = json.load(f)["collective"]
        got = (c["verdict"], c["ranks"], c["pg"], c["op"], c["seq"], c["waiting"])
        late = None
        if mode not in FIRST_FAILURES:
            ready = max(float(x.split()[1]) for x in text.splitlines() if x.startswith("ready"))
            late = round(os.stat(c["dumps"]).st_mtime - ready - STALL, 2)
        out[mode] = {"right": got == expected, "after_stall_s": late, "text": c["text"]}
        print(
            f"verdict, {mode}: {'right' if got == expected else f'WRONG {got}'}"
            + ("" if late is None else f", {late:+.2f} s after the stall time")
            + f": {c['text']}",
            flush=True,
        )
    return out


# -- stragglers ---------------------------------------------------------------------------


def ddp_rank(rank: int, world: int, port: int, late: int | None, seconds: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = DistributedDataParallel(torch.nn.Linear(32, 32))
    if rank == late:

        def late_grad(grad: Any) -> Any:
            time.sleep(0.1)  # inside DDP's backward: no frame of a collective to sample
            return grad

        model.module.weight.register_hook(late_grad)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    rng = random.Random(rank)
    print("training", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.1 * (rng.uniform(0.9, 1.1) if late is None else 1.0))  # the data loader
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    dist.destroy_process_group()


async def _ddp(tmp: str, tag: str, late: int | None, seconds: float) -> dict[str, Any]:
    port = aiolaunch.free_port()
    log_dir = os.path.join(tmp, tag)
    wd = aiolaunch.Watchdog(stall_after=60, action="observe", stragglers=1.0)
    async with aiolaunch.start_processes(
        tag, ddp_rank, {r: (r, 4, port, late, seconds) for r in range(4)},
        {r: {} for r in range(4)}, log_dir=log_dir, redirects=aiolaunch.Std.ALL,
        preload=("torch",), ready=aiolaunch.ReadyLine("training"), watchdog=wd,
    ) as ctx:  # fmt: skip
        await ctx.wait_ready(timeout=300)
        t0 = time.monotonic()
        named: list[aiolaunch.WorkerStraggling] = []
        while time.monotonic() - t0 < seconds:
            await asyncio.sleep(0.2)  # allowed: polling the event history
            named = [e for e in ctx._bus.history if isinstance(e, aiolaunch.WorkerStraggling)]
            if late is not None and named:
                break
        took = time.monotonic() - t0
        stalls = [e for e in ctx._bus.history if isinstance(e, aiolaunch.WorkerStalled)]
        lateness = [s.lateness_s for s in ctx.status()]
        await ctx.close()
    return {"named": named, "seconds": took, "stalls": stalls, "lateness": lateness}


async def straggler(tmp: str, trials: int) -> dict[str, Any]:
    out: dict[str, Any] = {"trials": []}
    for t in range(trials):
        r = await _ddp(tmp, f"late{t}", 3, 90.0)
        first = r["named"][0] if r["named"] else None
        row = {
            "named_after_s": round(r["seconds"], 1) if first else None,
            "ranks": sorted({e.rank for e in r["named"]}),
            "lateness_s": first.lateness_s if first else None,
            "source": first.source if first else None,
            "peers_lateness_s": r["lateness"][:3],
        }
        out["trials"].append(row)
        print(f"straggler, trial {t} (load {_load()}): {row}", flush=True)
    return out


async def balanced(tmp: str, minutes: float) -> dict[str, Any]:
    r = await _ddp(tmp, "balanced", None, 60.0 * minutes)
    row = {
        "minutes": minutes,
        "stragglers": len(r["named"]),
        "stalls": len(r["stalls"]),
        "lateness_s": r["lateness"],
    }
    print(f"balanced, {minutes:g} min (load {_load()}): {row}", flush=True)
    return row


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="collect,overhead,verdict,straggler,balanced")
    p.add_argument("--balanced-minutes", type=float, default=1.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    only = set(args.only.split(","))
    print(f"load average {_load()} on {os.cpu_count()} CPUs", flush=True)
    res: dict[str, Any] = {"load": _load()}
    with tempfile.TemporaryDirectory() as tmp:
        if "collect" in only:
            res["collect"] = await collect(tmp, [4, 16] if args.quick else [4, 16, 64], 20)
        if "overhead" in only:
            trials, steps = (1, 100) if args.quick else (3, 200)
            res["overhead"] = await overhead(tmp, trials, steps)
        if "verdict" in only:
            res["verdict"] = await verdict(tmp)
        if "straggler" in only:
            res["straggler"] = await straggler(tmp, 1 if args.quick else 3)
        if "balanced" in only:
            res["balanced"] = await balanced(tmp, args.balanced_minutes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)


if __name__ == "__main__":
    asyncio.run(main())
