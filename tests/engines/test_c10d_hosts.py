"""c10d across two hosts (network namespaces) with no ``is_host``: the agent on
the endpoint's host finds the address on its own interfaces and hosts the
store (torch decides from the host name, which both namespaces share, so
without ``is_host=1`` no one hosts it and the rendezvous times out)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from _netns import EXPECTED, PORT, hosts, restarts_ok, scenario, view

if TYPE_CHECKING:
    from pathlib import Path

    from _netns import Hosts

pytest.importorskip("torch")

__all__ = ["hosts"]  # the fixture


def no_is_host(h: Hosts, i: int, launcher: str, attempt: int) -> list[str]:
    return [
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={h.addrs[0]}:{PORT + attempt}",
        f"--rdzv-id=netns-noishost-{attempt}",
        "--rdzv-conf=join_timeout=60",  # torch would wait this long, then fail
    ]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(900)
def test_c10d_across_hosts_without_is_host(hosts: Hosts, tmp_path: Path) -> None:
    outcome = scenario("aiolaunch", hosts, tmp_path, 0, rdzv=no_is_host)
    assert outcome.codes == [0, 0], outcome.logs
    assert sorted(map(view, outcome.finals)) == EXPECTED, outcome.logs
    assert restarts_ok(outcome.finals, hosts), outcome.logs
    assert all(r["MASTER_ADDR"] in hosts.addrs for r in outcome.finals)


def test_local_addresses() -> None:
    import socket

    from aiolaunch.agent._rendezvous._torch import is_local_address

    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert is_local_address("::1") or not socket.has_ipv6
    assert not is_local_address("198.51.100.7")  # TEST-NET-2: documentation only
    assert not is_local_address("no-such-host.invalid")
