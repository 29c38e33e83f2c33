"""Two machines for real (tests/_netns.py): c10d with ``is_host`` told, the
group killed on one host and re-rendezvoused; torchrun must end the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from _netns import EXPECTED, hosts, restarts_ok, scenario, view

if TYPE_CHECKING:
    from pathlib import Path

    from _netns import Hosts

pytest.importorskip("torch")

__all__ = ["hosts"]  # the fixture


# Slow on a loaded machine: 2 hosts x 2 attempts x (agent + worker) import torch.
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(900)
@pytest.mark.parametrize("launcher", ["aiolaunch", "torchrun"])
def test_two_hosts_all_reduce_then_re_rendezvous(
    hosts: Hosts, tmp_path: Path, launcher: str
) -> None:
    outcome = scenario(launcher, hosts, tmp_path, 0)
    assert outcome.codes == [0, 0], outcome.logs
    finals = outcome.finals
    assert sorted(map(view, finals)) == EXPECTED, outcome.logs
    assert restarts_ok(finals, hosts), outcome.logs
    assert {r["NODE_ADDR"] for r in finals} == set(hosts.addrs)
    # the workers met through a namespace address, not loopback
    assert all(r["MASTER_ADDR"] in hosts.addrs for r in finals)
