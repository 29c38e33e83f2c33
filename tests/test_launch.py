"""launch(): the one-call helper, with a real torch.distributed gloo run."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from _helpers import driver

if TYPE_CHECKING:
    from pathlib import Path


def env_of_rank(_: Any) -> dict[str, str]:
    keys = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: os.environ[k] for k in keys}


def fail_on_rank_one(_: Any) -> int:
    if os.environ["RANK"] == "1":
        raise SystemExit(7)
    import time

    time.sleep(60)
    return 0


def all_reduce(value: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(value + dist.get_rank())])
        dist.all_reduce(t)
        return float(t.item())
    finally:
        dist.destroy_process_group()


async def test_launch_sets_the_env_and_returns_values() -> None:
    values = await aiolaunch.launch(env_of_rank, None, 3, master_port=23456)
    assert sorted(values) == [0, 1, 2]
    for rank, env in values.items():
        assert env == {
            "WORLD_SIZE": "3",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "localhost",
            "MASTER_PORT": "23456",
        }


async def test_launch_picks_a_free_port() -> None:
    values = await aiolaunch.launch(env_of_rank, None, 2)
    ports = {v["MASTER_PORT"] for v in values.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0


async def test_failing_worker_raises_worker_error() -> None:
    with pytest.raises(aiolaunch.WorkerError) as info:
        await aiolaunch.launch(fail_on_rank_one, None, 2)
    assert info.value.exitcode == 7 and info.value.worker_id == 1
    assert str(info.value) == "worker[1] failed with exitcode=7"


async def test_launch_rejects_bad_nprocs() -> None:
    with pytest.raises(ValueError, match="nprocs=0"):
        await aiolaunch.launch(env_of_rank, None, 0)


async def test_gloo_all_reduce_through_launch() -> None:
    pytest.importorskip("torch")
    values = await aiolaunch.launch(all_reduce, 10, 2)
    # ranks contribute 10 and 11
    assert values == {0: 21.0, 1: 21.0}


def test_free_port_is_bindable() -> None:
    port = aiolaunch.free_port()
    with socket.socket() as s:
        s.bind(("", port))


def test_sigterm_raises_main_process_error(tmp_path: Path) -> None:
    script = tmp_path / "sup.py"
    script.write_text(
        textwrap.dedent(
            """
        import asyncio, json, sys, time, aiolaunch
        def sleeper(_):
            print("ready", flush=True)
            time.sleep(60)
        async def main():
            task = asyncio.ensure_future(aiolaunch.launch(sleeper, None, 2))
            try:
                await task
            except aiolaunch.MainProcessError as exc:
                print(json.dumps({"signal_no": int(exc.signal_no), "str": str(exc)}), flush=True)
        asyncio.run(main())
        """
        )
    )
    with driver([sys.executable, str(script)], stderr=None) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {
        "signal_no": int(signal.SIGTERM),
        "str": "SIGTERM received, exiting due to Terminated.",
    }
