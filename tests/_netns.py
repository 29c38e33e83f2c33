"""Two machines for real: two network namespaces joined by a veth pair.

Each "host" has its own network stack and address (10.x.y.1 and 10.x.y.2);
nothing but the veth link connects them, so the rendezvous, the TCP store
and gloo's all_reduce really cross hosts. One agent per host runs
``--nnodes 2``; :func:`scenario` SIGKILLs the worker of the second host
mid-run and the group must come back through a new rendezvous
(``--max-restarts 1``) and finish.

The scenario has one race that no launcher can close: if the surviving
worker is slower to die than the other host is to re-join (a loaded machine:
seen once in CI), its agent restarts as a membership change without counting a
failure - torch's agent as aiolaunch's - and the hosts' restart counts differ.
The survivor exits the moment its collective fails, which makes that rare; the
workers therefore name their round by a count both hosts share (a claim file
per rank and round in the shared output folder), not by their restart count,
and :func:`restarts_ok` accepts either outcome of the race.

Used by tests/agent/test_two_hosts.py (c10d, torchrun side by side) and
tests/engines/ (etcd-v3, c10d without is_host). Needs root (``ip netns``),
iproute2 and torch; the ``hosts`` fixture skips with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    RdzvFlags = Callable[["Hosts", int, str, int], list[str]]

__all__ = [
    "EXPECTED",
    "PORT",
    "Hosts",
    "Outcome",
    "c10d_flags",
    "hosts",
    "restarts_ok",
    "scenario",
    "view",
]

PORT = 29400  # each namespace has its own port space: no clash with the host

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = sys.argv[1]
    # The round, the same on both hosts: each rank claims the first free
    # round in the shared output folder (one worker per rank per round). Not
    # TORCHELASTIC_RESTART_COUNT: a membership change restarts without
    # counting, and the hosts' counts may then differ (the module docstring).
    rank = int(os.environ["RANK"])
    attempt = 0
    while True:
        try:
            os.close(os.open(os.path.join(out, f".round{attempt}-rank{rank}"),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            attempt += 1
    # The agent's store outlives a restart (torch's as aiolaunch's): keys of
    # the previous attempt's process group are still there, and a worker that
    # reads its peer's old address before the peer rewrote it fails to
    # connect. A per-round prefix keeps the rounds apart.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt{attempt}", store),
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
            "TORCHELASTIC_RESTART_COUNT", "NODE_ADDR")
    rec = {k: os.environ[k] for k in keys}
    rec["sum"] = t.item()
    rec["pid"] = os.getpid()
    path = os.path.join(out, f"a{attempt}-n{os.environ['NODE_ADDR']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)
    if attempt == 0:
        # Keep talking until the test kills a worker: the survivor's next
        # collective fails, as in a real job that loses a node's process.
        # Exit at once on that failure: a survivor slow to die would let its
        # agent see the other host re-join first and restart without counting
        # a failure, and the hosts' restart counts (the workers' store
        # prefixes) would then differ - with torchrun as with aiolaunch.
        deadline = time.monotonic() + 240
        try:
            while time.monotonic() < deadline:
                dist.barrier()
                time.sleep(0.05)
        except RuntimeError:
            os._exit(1)
        sys.exit("nobody killed a worker")
    dist.destroy_process_group()
    """
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    """Two namespaces ``names[i]`` with interface ``ifaces[i]`` and address ``addrs[i]``."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{uuid.uuid4().hex[:4]}"
        net = 1 + os.getpid() % 250
        self.names = (f"alA{tag}", f"alB{tag}")
        self.ifaces = (f"va{tag}"[:15], f"vb{tag}"[:15])
        self.addrs = (f"10.213.{net}.1", f"10.213.{net}.2")

    def create(self) -> None:
        for ns in self.names:
            _ip("netns", "add", ns)
        _ip("link", "add", self.ifaces[0], "type", "veth", "peer", "name", self.ifaces[1])
        for ns, iface, addr in zip(self.names, self.ifaces, self.addrs, strict=True):
            _ip("link", "set", iface, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            _ip("-n", ns, "link", "set", iface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        for ns in self.names:  # deleting a namespace deletes its veth end
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    h = Hosts()
    try:
        h.create()
    except (subprocess.CalledProcessError, OSError) as exc:
        h.remove()
        detail = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"cannot make network namespaces here: {exc} {detail.decode(errors='replace')}")
    try:
        yield h
    finally:
        h.remove()


def c10d_flags(hosts: Hosts, i: int, launcher: str, attempt: int) -> list[str]:
    """c10d on host A, the store's host told (not guessed from the hostname)."""
    return [
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={hosts.addrs[0]}:{PORT + attempt}",
        f"--rdzv-id=netns-{launcher}-{attempt}",
        f"--rdzv-conf=join_timeout=60,is_host={1 if i == 0 else 0}",
    ]


def _agent_cmd(
    launcher: str, hosts: Hosts, i: int, script: Path, out: Path, rdzv: list[str]
) -> list[str]:
    module = "aiolaunch" if launcher == "aiolaunch" else "torch.distributed.run"
    return [
        "ip",
        "netns",
        "exec",
        hosts.names[i],
        sys.executable,
        "-m",
        module,
        "--nnodes=2",
        "--nproc-per-node=1",
        *rdzv,
        f"--local-addr={hosts.addrs[i]}",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        str(script),
        str(out),
    ]


@dataclass
class Outcome:
    codes: list[int | None]
    finals: list[dict[str, object]]
    logs: str


def scenario(
    launcher: str, hosts: Hosts, tmp_path: Path, attempt: int, rdzv: RdzvFlags = c10d_flags
) -> Outcome:
    """Run the two agents, kill host B's worker in their first attempt, wait for the end.

    ``rdzv(hosts, i, launcher, attempt)``: the rendezvous flags of host ``i``'s agent.
    """
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    name = f"{launcher}{attempt}"
    out = tmp_path / name
    out.mkdir()
    agents = []
    for i in range(2):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": hosts.ifaces[i],
            "NODE_ADDR": hosts.addrs[i],
            "LOGLEVEL": "WARNING",
        }
        # output to files: a full pipe would block an agent
        with open(tmp_path / f"{name}-agent{i}.log", "w") as log:
            agents.append(
                subprocess.Popen(
                    _agent_cmd(launcher, hosts, i, script, out, rdzv(hosts, i, launcher, attempt)),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    codes: list[int | None] = [None, None]
    try:
        victim = out / f"a0-n{hosts.addrs[1]}.json"
        other = out / f"a0-n{hosts.addrs[0]}.json"
        deadline = time.monotonic() + 150
        while not (victim.exists() and other.exists()):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                break
            time.sleep(0.1)
        if victim.exists():
            os.kill(json.loads(victim.read_text())["pid"], signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                codes = [a.wait(timeout=150) for a in agents]
    finally:
        # a hung agent: SIGTERM first, so that it stops its workers (torchrun's
        # live in sessions of their own and would outlive a SIGKILLed agent)
        for a in agents:
            if a.poll() is None:
                a.terminate()
        for a in agents:
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()
    wait_guardians_gone([a.pid for a in agents])
    finals = [json.loads(p.read_text()) for p in sorted(out.glob("a1-*.json"))]
    logs = "\n----\n".join(
        f"agent {i} rc={codes[i]}\n"
        + (tmp_path / f"{name}-agent{i}.log").read_text(errors="replace")[-5000:]
        for i in range(2)
    )
    return Outcome(codes, finals, logs)


def wait_guardians_gone(agent_pids: list[int], timeout: float = 60.0) -> None:
    """aiolaunch's guardian finishes its /proc sweep after its agent exited; on
    a loaded machine that takes seconds. Wait for it (bounded), so the suite's
    leak check sees the end state."""
    marks = [f"aiolaunch-guardian {pid}-".encode() for pid in agent_pids]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ")
            except OSError:
                continue
            alive = alive or any(m in cmdline for m in marks)
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"guardians of agents {agent_pids} still running after {timeout}s")


def view(rec: dict[str, object]) -> tuple[object, ...]:
    return (rec["RANK"], rec["WORLD_SIZE"], rec["GROUP_WORLD_SIZE"], rec["sum"])


# After the kill: both hosts in a new round and a real all_reduce across them (1 + 2).
EXPECTED = [("0", "2", "2", 3.0), ("1", "2", "2", 3.0)]


def restarts_ok(finals: list[dict[str, object]], hosts: Hosts) -> bool:
    """Host B (its worker killed) used its one restart; host A used it too,
    unless it lost the race of the module docstring and restarted for the
    membership change (then it counted none)."""
    counts = {r["NODE_ADDR"]: r["TORCHELASTIC_RESTART_COUNT"] for r in finals}
    return counts.get(hosts.addrs[1]) == "1" and counts.get(hosts.addrs[0]) in ("0", "1")
