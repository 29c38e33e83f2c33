"""An orchestration service: HTTP servers, readiness, a load-client group, Ctrl-C.

    python examples/service.py [--servers 4] [--clients 2] [--requests 200]

1. Start ``--servers`` HTTP servers (binary workers: ``python -m http.server``),
   each restarted on failure within a budget.
2. Wait until every port accepts connections (``ReadyPort``).
3. Run a group of function workers that load the servers, tee'd to the console.
4. Print the result. Ctrl-C (or SIGTERM) at any point stops both groups
   gracefully: the clients' ``wait()`` forwards the signal and raises
   ``SignalException``; leaving the servers' ``async with`` closes them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiolaunch


def load_client(ports: list[int], requests: int) -> int:
    """GET each server in turn ``requests`` times; return how many answered 200."""
    import os
    import urllib.request

    ok = 0
    rank = int(os.environ["CLIENT_RANK"])
    for i in range(requests):
        port = ports[(i + rank) % len(ports)]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
            ok += resp.status == 200
        if (i + 1) % max(1, requests // 4) == 0:
            print(f"{i + 1}/{requests} requests", flush=True)
    return ok


async def main(servers: int, clients: int, requests: int) -> int:
    ports = [aiolaunch.free_port() for _ in range(servers)]
    async with aiolaunch.start_processes(
        name="server",
        entrypoint=sys.executable,
        args={r: ("-m", "http.server", ports[r], "--bind", "127.0.0.1") for r in range(servers)},
        envs={r: {} for r in range(servers)},
        redirects=aiolaunch.Std.ALL,  # access logs go to files, not the console
        ready=aiolaunch.ReadyPort(lambda rank: ports[rank]),
        restart=aiolaunch.RestartPolicy("on-failure", max_restarts=3, window=60),
        shutdown_timeout=5,
    ) as server_group:
        await server_group.wait_ready(timeout=30)
        print(f"servers ready on ports {ports}", flush=True)
        async with aiolaunch.start_processes(
            name="client",
            entrypoint=load_client,
            args={r: (ports, requests) for r in range(clients)},
            envs={r: {"CLIENT_RANK": str(r)} for r in range(clients)},
            tee=aiolaunch.Std.ALL,
            shutdown_timeout=5,
        ) as client_group:
            waiting = asyncio.ensure_future(client_group.wait())
            # wait() takes SIGINT/SIGTERM before its first suspension: after
            # one loop turn a Ctrl-C is forwarded to the clients, so say so.
            await asyncio.sleep(0)
            print(f"{clients} clients started", flush=True)
            try:
                result = await waiting
            except aiolaunch.SignalException as exc:
                print(f"got {exc.sigval.name}: stopping servers and clients", flush=True)
                return 130
        assert result is not None
        if result.is_failed():
            print(aiolaunch.ChildFailedError("client", result.failures).format_msg())
            return 1
        total = sum(result.return_values.values())
        print(f"{clients} clients made {total} successful requests", flush=True)
        return 0 if total == clients * requests else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="HTTP servers + load clients under aiolaunch")
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200)
    ns = parser.parse_args()
    sys.exit(asyncio.run(main(ns.servers, ns.clients, ns.requests)))
