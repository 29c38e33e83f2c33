"""Event-delivery latency: a worker's exit -> ``WorkerExited`` consumed by ``ctx.events()``.

Each trial starts a group of binary workers (``sleep``), subscribes a consumer
to ``ctx.events()``, SIGKILLs one worker and measures the time from the kill
(the exit, within microseconds) to the consumer receiving its ``WorkerExited``
event. A restart policy keeps the group alive, so one group serves many trials.

    python benchmarks/bench_events.py [--trials 200] [--workers 4] [--json OUT]

Target (issue #9): p99 <= 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time

import aiolaunch


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


async def measure(trials: int, workers: int) -> dict[str, float]:
    policy = aiolaunch.RestartPolicy(
        "always", max_restarts=trials + 10, window=3600, backoff=0.0, max_backoff=0.0, jitter=0.0
    )
    latencies: list[float] = []
    async with aiolaunch.start_processes(
        name="ev",
        entrypoint="/bin/sh",
        args={r: ("-c", "exec sleep 600") for r in range(workers)},
        envs={r: {} for r in range(workers)},
        restart={0: policy},
    ) as ctx:
        await ctx.wait_ready(timeout=30)
        received: asyncio.Queue[tuple[float, aiolaunch.Event]] = asyncio.Queue()

        async def consume() -> None:
            async for event in ctx.events():
                await received.put((time.monotonic(), event))

        consumer = asyncio.ensure_future(consume())
        try:
            for _ in range(trials):
                # the current incarnation of rank 0
                pid = ctx.pids()[0]
                while not received.empty():
                    received.get_nowait()
                t0 = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                while True:
                    t1, event = await asyncio.wait_for(received.get(), 10)
                    if isinstance(event, aiolaunch.WorkerExited) and event.pid == pid:
                        latencies.append((t1 - t0) * 1000)
                        break
                # wait for the restart before the next trial
                while True:
                    _, event = await asyncio.wait_for(received.get(), 10)
                    if isinstance(event, aiolaunch.WorkerStarted) and event.rank == 0:
                        break
        finally:
            consumer.cancel()
    return {
        "trials": len(latencies),
        "p50_ms": statistics.median(latencies),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies),
        "min_ms": min(latencies),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the result here")
    ns = parser.parse_args()
    result = asyncio.run(measure(ns.trials, ns.workers))
    print(
        f"event delivery (exit -> WorkerExited consumed), {result['trials']} trials, "
        f"{ns.workers} workers: p50 {result['p50_ms']:.3f} ms, p99 {result['p99_ms']:.3f} ms, "
        f"max {result['max_ms']:.3f} ms  [target p99 <= 5 ms: "
        f"{'met' if result['p99_ms'] <= 5 else 'NOT met'}]"
    )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["trials"] == ns.trials else 1


if __name__ == "__main__":
    sys.exit(main())
