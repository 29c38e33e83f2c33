"""Several machines for real: N network namespaces on one bridge.

Each "host" is a network namespace with its own address (10.x.y.i), host
interface and port space, joined by a veth pair to a bridge that lives in a
namespace of its own (the machine's own network is left alone). A host is
"lost" by :meth:`Net.kill` - SIGKILL to every process in its namespace, the
agent and its workers at once, as when a machine dies. ``CLOCK_MONOTONIC`` is
one clock for every namespace, so time stamps of workers on different hosts
compare directly.

:data:`WORKER` is a plain ``env://`` gloo job: it stamps its first
all_reduce (host, rank, world size, restart count, pid, time) as a JSON line
in ``$OUT/stamps``, then keeps reducing until ``$OUT/stop`` exists, and
exits 0. With ``STORE_PREFIX`` set it keys its process group under a prefix
per restart count (what torchrun's workers need to resume). ``FAIL_HOSTS`` (addresses, comma-separated) makes the worker of
those hosts exit 1 right after its first all_reduce (only while the job's
restart count is below ``FAIL_UNTIL``, when set; ``FAIL_HOW=segv``: by
SIGSEGV, a crash).

Used by the resilience tests (tests/engines/test_spares.py) and
benchmarks/bench_hosts.py. Needs root (``ip netns``), iproute2 and torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from pathlib import Path

__all__ = ["WORKER", "Net", "can_make_hosts", "net", "read_stamps", "wait_for"]

WORKER = """
import json, os, signal, sys, time
import torch
import torch.distributed as dist

torch.set_num_threads(1)
out = os.environ["OUT"]
host = os.environ["NODE_ADDR"]
if os.environ.get("STORE_PREFIX"):
    # torchrun's workaround: its store keeps the last round's keys; a prefix
    # per restart keeps the rounds apart (not needed with aiolaunch's rounds)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("r" + os.environ["TORCHELASTIC_RESTART_COUNT"], store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
else:
    dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
rec = {"host": host, "rank": dist.get_rank(), "world": dist.get_world_size(),
       "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "pid": os.getpid(),
       "sum": t.item(), "t": time.monotonic()}
with open(os.path.join(out, "stamps"), "a") as f:
    f.write(json.dumps(rec) + "\\n")
print("step 0", flush=True)
restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if host in os.environ.get("FAIL_HOSTS", "").split(",") and restarts < int(
    os.environ.get("FAIL_UNTIL", "1000000")
):
    if os.environ.get("FAIL_HOW") == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)  # a crash
    sys.exit(1)
deadline = time.monotonic() + float(os.environ.get("RUN_FOR", "300"))
stop = os.path.join(out, "stop")
try:
    while True:
        # every rank stops in the same step: the decision is a collective too
        flag = torch.tensor([float(os.path.exists(stop) or time.monotonic() > deadline)])
        dist.all_reduce(flag)
        if flag.item() > 0:
            break
        time.sleep(0.02)
except RuntimeError:
    os._exit(1)  # a peer is gone: fail at once, as a real job does
dist.destroy_process_group()
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def can_make_hosts() -> str | None:
    """Why hosts cannot be made here, or ``None``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


class Net:
    """``n`` hosts: ``names[i]`` (namespace), ``addrs[i]``, ``ifaces[i]``."""

    def __init__(self, n: int) -> None:
        tag = f"{os.getpid() % 10000}{uuid.uuid4().hex[:4]}"
        sub = 1 + (os.getpid() + int(tag[-4:], 16)) % 250
        self.switch = f"alS{tag}"
        self.names = [f"al{i}{tag}" for i in range(n)]
        self.ifaces = [f"h{i}{tag}"[:15] for i in range(n)]
        self.addrs = [f"10.214.{sub}.{i + 1}" for i in range(n)]
        self._ports = [f"s{i}{tag}"[:15] for i in range(n)]

    def create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for ns, iface, port, addr in zip(
            self.names, self.ifaces, self._ports, self.addrs, strict=True
        ):
            _ip("netns", "add", ns)
            _ip("link", "add", iface, "type", "veth", "peer", "name", port)
            _ip("link", "set", iface, "netns", ns)
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            _ip("-n", ns, "link", "set", iface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        for ns in [*self.names, self.switch]:
            self.kill_ns(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)

    def pids(self, i: int) -> list[int]:
        """The processes in host ``i``'s namespace."""
        return self._ns_pids(self.names[i])

    @staticmethod
    def _ns_pids(ns: str) -> list[int]:
        got = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30, check=False
        )
        return [int(p) for p in got.stdout.split()]

    def kill(self, i: int) -> float:
        """Lose host ``i``: SIGKILL every process in it; returns the monotonic time."""
        return self.kill_ns(self.names[i])

    def kill_ns(self, ns: str) -> float:
        # Stop them first so none forks or restarts a peer between the look and the kill.
        pids = self._ns_pids(ns)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            if sig == signal.SIGSTOP:
                at = time.monotonic()
        for pid in self._ns_pids(ns):  # anything born meanwhile
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return at

    def popen(
        self, i: int, argv: Sequence[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        """Run ``argv`` on host ``i`` (output to ``log``: a full pipe would block it)."""
        env = {**env, "NODE_ADDR": self.addrs[i], "GLOO_SOCKET_IFNAME": self.ifaces[i]}
        with open(log, "ab") as f:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.names[i], *argv],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


@contextlib.contextmanager
def net(n: int) -> Iterator[Net]:
    """``n`` hosts for the block; skips the test where they cannot be made."""
    import pytest

    why = can_make_hosts()
    if why is not None:
        pytest.skip(why)
    hosts = Net(n)
    try:
        hosts.create()
    except (subprocess.CalledProcessError, OSError) as exc:
        hosts.remove()
        detail = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"cannot make network namespaces here: {exc} {detail!r}")
    try:
        yield hosts
    finally:
        hosts.remove()


def read_stamps(out: Path) -> list[dict[str, Any]]:
    """The workers' first-all_reduce records so far."""
    path = out / "stamps"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(what: str, check: Any, timeout: float, procs: Sequence[Any] = ()) -> Any:
    """Poll ``check()`` until it returns something true; fail with ``what`` at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def agent_argv(launcher: str, *args: str) -> list[str]:
    module = "aiolaunch" if launcher == "aiolaunch" else "torch.distributed.run"
    return [sys.executable, "-m", module, *args]
