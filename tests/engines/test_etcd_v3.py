"""``--rdzv-backend etcd-v3`` against a real etcd 3.4 with its v2 API off.

The backend's compare-and-swap and the store's waits on a loopback etcd
(fast); torch's registry and torchrun finding the backend through the entry
point; a ``WorkerSpec`` with the handler; and the elastic job of two hosts
(network namespaces, etcd on host A): one host's worker killed, a new
rendezvous, success.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from _etcd import etcd_server, require_etcd

from _netns import EXPECTED, PORT, hosts, restarts_ok, scenario, view

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from _netns import Hosts

pytest.importorskip("torch")

__all__ = ["hosts"]  # the fixture

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_etcd()
    with etcd_server(tmp_path_factory.mktemp("etcd")) as endpoint:
        yield endpoint


def _client(endpoint: str) -> object:
    from aiolaunch.agent._rendezvous._etcd_v3 import EtcdV3Client

    host, port = endpoint.split(":")
    return EtcdV3Client(host, int(port), timeout=10, ttl=60)


def test_the_v2_api_is_off(etcd: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://{etcd}/v2/keys", timeout=10)
    info.value.close()  # the error holds the response's socket
    assert info.value.code == 404  # torch's etcd and etcd-v2 backends cannot work here


def test_backend_compare_and_swap(etcd: str) -> None:
    from aiolaunch.agent._rendezvous._etcd_v3 import EtcdV3RendezvousBackend

    backend = EtcdV3RendezvousBackend(_client(etcd), f"cas-{uuid.uuid4().hex}", "/t/rdzv")  # type: ignore[arg-type]
    assert backend.name == "etcd-v3"
    assert backend.get_state() is None
    state, token, ok = backend.set_state(b"one")  # type: ignore[misc]
    assert (state, ok) == (b"one", True)
    assert backend.set_state(b"lost") == (b"one", token, False)  # exists: no create
    _, token2, ok2 = backend.set_state(b"two", token)  # type: ignore[misc]
    assert ok2 and token2 > token
    assert backend.set_state(b"stale", token) == (b"two", token2, False)  # fenced
    assert backend.set_state(b"alien", b"not-a-revision") == (b"two", token2, False)
    assert backend.get_state() == (b"two", token2)


def test_store_waits_on_a_watch_and_counts_atomically(etcd: str) -> None:
    import torch.distributed as dist

    from aiolaunch.agent._rendezvous._etcd_v3 import EtcdV3Store

    raw = EtcdV3Store(_client(etcd), f"/t/store/{uuid.uuid4().hex}")  # type: ignore[arg-type]
    store: Any = dist.PrefixStore("p", raw)  # type: ignore[attr-defined]  # as handed out
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.multi_get(["k"]) == [b"v"]
    assert store.check(["k"]) and not store.check(["missing"])
    assert store.compare_set("c", "", "1") == b"1"
    assert store.compare_set("c", "0", "2") == b"1"  # not what was expected: unchanged
    assert store.compare_set("c", "1", "3") == b"3"
    threading.Timer(0.3, lambda: raw.set("p/late", b"here")).start()
    assert store.get("late") == b"here"  # a watch, woken by the write
    store.set("k2", b"w")
    threading.Timer(0.3, lambda: raw.set("p/late2", b"x")).start()
    # one request for the keys there, a watch for the one still missing
    assert store.multi_get(["k", "late2", "k2"]) == [b"v", b"x", b"w"]
    store.set_timeout(timedelta(seconds=0.5))
    with pytest.raises(dist.DistStoreError, match="not set within"):
        store.get("never")
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"])

    def adder() -> None:
        for _ in range(10):
            store.add("n", 1)

    threads = [threading.Thread(target=adder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert store.add("n", 0) == 40  # no lost update under contention


def test_keys_go_with_their_lease_and_a_lost_lease_is_replaced(etcd: str) -> None:
    from aiolaunch.agent._rendezvous._etcd_v3 import EtcdV3Client

    host, port = etcd.split(":")
    client = EtcdV3Client(host, int(port), timeout=10, ttl=2)
    key = f"/t/lease/{uuid.uuid4().hex}".encode()
    client.put(key, b"1")
    first = client.lease()
    deadline = time.monotonic() + 30  # etcd expires a 2 s lease within a few seconds
    while client.range(key)[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.range(key)[0] == []  # what a job leaves in etcd goes by itself
    client.put(key, b"2")  # a fresh lease: the old one is gone
    assert client.lease() != first
    assert [kv["value"] for kv in client.range(key)[0]] == ["Mg=="]
    # revoked behind the client's back (its clock says the lease is fresh):
    # the write is refused once, then made with a new lease
    body = json.dumps({"ID": str(client.lease())}).encode()
    urllib.request.urlopen(f"http://{etcd}/v3/lease/revoke", body, timeout=10).close()
    client.put(key, b"3")
    assert [kv["value"] for kv in client.range(key)[0]] == ["Mw=="]


def test_unreachable_etcd_is_a_clear_error() -> None:
    from _etcd import free_port
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from aiolaunch.agent._rendezvous._torch import create_handler

    with pytest.raises(RendezvousConnectionError, match="cannot reach etcd"):
        create_handler(
            backend="etcd-v3",
            endpoint=f"127.0.0.1:{free_port()}",
            run_id="x",
            min_nodes=1,
            max_nodes=1,
        )


WORKER = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    agent_store = os.environ["TORCHELASTIC_USE_AGENT_STORE"]
    sys.stdout.write(f"ok {dist.get_rank()} {dist.get_world_size()} {agent_store}\\n")
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("launcher", ["aiolaunch", "torchrun"])
def test_the_cli_and_torchrun_find_the_backend(etcd: str, tmp_path: Path, launcher: str) -> None:
    # torchrun too: aiolaunch's torchrun.handlers entry point registers etcd-v3
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    module = "aiolaunch" if launcher == "aiolaunch" else "torch.distributed.run"
    argv = [sys.executable, "-m", module, "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3"]
    argv += ["--rdzv-endpoint", etcd, "--rdzv-id", f"cli-{uuid.uuid4().hex[:8]}"]
    argv += ["--rdzv-conf", "last_call_timeout=1", str(script)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.split("\n")) == ["", "ok 0 2 True", "ok 1 2 True"], proc.stdout


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        dist.barrier()
        return dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


# libuv's process-wide signal pipe, made by the first TCPStore server of a
# process (the one the handler hosts for the workers) and kept for good
@pytest.mark.leaks_ok("fds")
async def test_worker_spec_takes_the_handler(etcd: str) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from aiolaunch.agent import LocalElasticAgent, WorkerSpec

    params = RendezvousParameters(
        backend="etcd-v3",
        endpoint=etcd,
        run_id=f"spec-{uuid.uuid4().hex[:8]}",
        min_nodes=1,
        max_nodes=1,
        last_call_timeout=1,
    )
    handler = get_rendezvous_handler(params)  # torch's registry, through the entry point
    spec = WorkerSpec(
        role="trainer", local_world_size=2, entrypoint=_rank_and_world, rdzv_handler=handler
    )
    agent = LocalElasticAgent(spec, start_method="spawn")
    try:
        result = await agent.run()
    finally:
        handler.shutdown()
        # the TCPStore the handler hosts for the workers goes with it (its pipe fds)
        del agent, spec, handler
        gc.collect()
    assert not result.is_failed(), result.failures
    assert result.return_values == {0: (0, 2), 1: (1, 2)}


JOINER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch.distributed as dist
    out, ws = sys.argv[1], int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    # a fresh prefix per world: the agent's store outlives a round
    prefix = f"w{ws}-{os.environ['TORCHELASTIC_RESTART_COUNT']}-{os.environ['GROUP_WORLD_SIZE']}"
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store),
                            rank=int(os.environ["RANK"]), world_size=ws)
    rec = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE")}
    with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
        json.dump(rec, f)
    if ws == 1:
        time.sleep(240)  # alone: until the second node joins and the agent restarts us
        sys.exit("nobody joined")
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_joins_a_running_job(etcd: str, tmp_path: Path) -> None:
    """``--nnodes 1:2``: one node starts alone (world 1); a second joins through
    etcd; the first one's agent sees it waiting, stops its worker, and both
    run in a world of 2 (a membership change, torch's c10d behaviour)."""
    script = tmp_path / "joiner.py"
    script.write_text(JOINER)
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "aiolaunch", "--nnodes", "1:2", "--nproc-per-node", "1"]
    argv += ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd]
    argv += ["--rdzv-id", f"join-{uuid.uuid4().hex[:8]}", "--local-addr", "127.0.0.1"]
    argv += ["--rdzv-conf", "last_call_timeout=1,join_timeout=120", "--monitor-interval", "1"]
    argv += [str(script), str(out)]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    with open(logs[0], "w") as log:
        first = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    second = None
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("*.json")):  # alone, running
            assert first.poll() is None, logs[0].read_text()
            assert time.monotonic() < deadline, logs[0].read_text()
            time.sleep(0.1)
        with open(logs[1], "w") as log:
            second = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        codes = [first.wait(timeout=240), second.wait(timeout=240)]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    text = "\n----\n".join(p.read_text(errors="replace")[-3000:] for p in logs)
    assert codes == [0, 0], text
    records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    alone = [r for r in records if r["WORLD_SIZE"] == "1"]
    together = sorted(
        (r["RANK"], r["WORLD_SIZE"], r["GROUP_WORLD_SIZE"])
        for r in records
        if r["WORLD_SIZE"] == "2"
    )
    assert len(alone) == 1, records
    assert together == [("0", "2", "2"), ("1", "2", "2")], text


def etcd_flags(etcd_endpoint: str) -> object:
    def flags(h: Hosts, i: int, launcher: str, attempt: int) -> list[str]:
        return [
            "--rdzv-backend=etcd-v3",
            f"--rdzv-endpoint={etcd_endpoint}",
            f"--rdzv-id=netns-etcd-{attempt}-{h.names[0]}",
            "--rdzv-conf=join_timeout=120,last_call_timeout=2",
        ]

    return flags


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_hosts_elastic_job_over_etcd(hosts: Hosts, tmp_path: Path) -> None:
    """etcd on host A; each host's agent joins through it; host B's worker is
    killed; both re-rendezvous (round 2 in etcd) and finish with an all_reduce."""
    with etcd_server(tmp_path / "etcd", host=hosts.addrs[0], port=PORT, netns=hosts.names[0]) as ep:
        t0 = time.monotonic()
        outcome = scenario("aiolaunch", hosts, tmp_path, 0, rdzv=etcd_flags(ep))  # type: ignore[arg-type]
        took = time.monotonic() - t0
    assert outcome.codes == [0, 0], outcome.logs
    assert sorted(map(view, outcome.finals)) == EXPECTED, outcome.logs
    assert restarts_ok(outcome.finals, hosts), outcome.logs
    assert {r["NODE_ADDR"] for r in outcome.finals} == set(hosts.addrs)
    assert all(r["MASTER_ADDR"] in hosts.addrs for r in outcome.finals)
    assert took < 600
