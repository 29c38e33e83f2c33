"""Warm start with torch: restarts through the zygote, a fresh store per attempt, DataLoader.

Real gloo process groups on localhost; timing is the benchmarks' business
(``benchmarks/run.py --only warm_start,warm_restart``), these assert behaviour.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import TYPE_CHECKING

import pytest

import aiolaunch
from _helpers import driver
from _programs import write_script
from aiolaunch._warm._zygote import close_zygotes

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm start is Linux-only"),
]

AIOLAUNCH = [sys.executable, "-m", "aiolaunch"]

RESTART = """
import json, os, sys
forked = "torch" in sys.modules  # before this script imports it: a zygote's child
import torch, torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
stale = [k for k in ("left-by-0", "left-by-1") if store.check([k])]
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
t = torch.ones(2)
dist.all_reduce(t)
store.set(f"left-by-{attempt}", "x")
print(json.dumps({
    "attempt": attempt, "rank": dist.get_rank(), "forked": forked, "ppid": os.getppid(),
    "stale": stale, "sum": t.tolist(), "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"],
    "port": os.environ["MASTER_PORT"],
}), flush=True)
dist.barrier()
if attempt < 2 and dist.get_rank() == (attempt + 1) % 2:
    sys.exit(1)
dist.destroy_process_group()
"""


@pytest.fixture(autouse=True)
def _fresh_zygotes() -> Iterator[None]:
    yield
    close_zygotes()


def _reports(out: str) -> list[dict[str, object]]:
    return [json.loads(line.split(":", 1)[1]) for line in out.splitlines() if '"attempt"' in line]


@pytest.mark.timeout(300)  # three attempts of a DDP job: a minute on a loaded 2-core host
@pytest.mark.parametrize("port", ["auto", "fixed"])
def test_restarts_fork_from_the_zygote_with_a_fresh_store(port: str, tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", RESTART)
    argv = [*AIOLAUNCH, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
    if port == "fixed":
        argv += ["--master-port", str(aiolaunch.free_port())]
    with driver([*argv, "--tee", "3", str(script)], cwd=str(tmp_path)) as proc:
        out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, err
    reports = _reports(out)
    assert sorted((r["attempt"], r["rank"]) for r in reports) == [
        (a, r) for a in range(3) for r in range(2)
    ]
    for r in reports:
        assert r["forked"], "the script is the default preload's: forked from the zygote"
        assert r["ppid"] != proc.pid
        assert r["sum"] == [2.0, 2.0]
        assert r["agent_store"] == "True"
        assert r["stale"] == [], "a key of the previous attempt's store was still there"
    assert len({r["ppid"] for r in reports}) == 1  # one zygote for every attempt
    # a new store per attempt: on a port of its own, or the same one once the last is gone
    assert len({r["port"] for r in reports}) == (3 if port == "auto" else 1)


@pytest.mark.timeout(300)
def test_no_preload_starts_afresh_with_rank_0_hosting(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", RESTART)
    argv = [*AIOLAUNCH, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
    with driver([*argv, "--no-preload", "--tee", "3", str(script)], cwd=str(tmp_path)) as proc:
        out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, err
    reports = _reports(out)
    assert len(reports) == 6
    for r in reports:
        assert not r["forked"] and r["ppid"] == proc.pid
        assert r["agent_store"] == "False" and r["stale"] == []


DATALOADER = """
import torch
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":
    data = TensorDataset(torch.arange(64, dtype=torch.float32))
    total = sum(float(b[0].sum()) for b in DataLoader(data, batch_size=8, num_workers=2))
    print("total", total, flush=True)
"""


async def test_a_dataloader_with_worker_processes(tmp_path: Path) -> None:
    script = write_script(tmp_path, "dl.py", DATALOADER)
    async with aiolaunch.start_processes(
        name="dl",
        entrypoint=sys.executable,
        args={0: ("-u", "-m", "aiolaunch._child._bootstrap", str(script))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=aiolaunch.Std.ALL,
        preload=["torch"],
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed(), (
        tmp_path / "logs/0/stderr.log"
    ).read_text()
    assert (tmp_path / "logs/0/stdout.log").read_text() == f"total {float(sum(range(64)))}\n"


RUNS_AN_OP = """
import torch
torch.ones(256, 256).sum()  # at import: torch's OpenMP pool starts
"""


async def test_a_preload_that_runs_an_op_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiolaunch")
    write_script(tmp_path, "warm_op_mod.py", RUNS_AN_OP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a pool of two threads, even on one CPU
    script = write_script(
        tmp_path, "w.py", "import os, torch; print(os.getppid(), torch.ones(64, 64).sum().item())"
    )
    async with aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args={0: ("-u", "-m", "aiolaunch._child._bootstrap", str(script))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=aiolaunch.Std.ALL,
        preload=["warm_op_mod"],
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    assert (tmp_path / "logs/0/stdout.log").read_text() == f"{os.getpid()} 4096.0\n"
    assert "threads run in the zygote" in caplog.text


@pytest.mark.timeout(300)
def test_cli_default_is_on_only_for_a_script_that_imports_torch(tmp_path: Path) -> None:
    code = "import os, sys\nprint('torch' in sys.modules, os.getppid(), flush=True)\n"
    plain = write_script(tmp_path, "plain.py", code)
    uses = write_script(tmp_path, "uses.py", code + "import torch\n")
    for script, forked in ((plain, False), (uses, True)):
        with driver([*AIOLAUNCH, "--nproc-per-node", "2", "--tee", "3", str(script)]) as proc:
            out, err = proc.communicate(timeout=280)
        assert proc.returncode == 0, err
        lines = [line.split(":", 1)[1].split() for line in out.splitlines() if ":" in line]
        assert len(lines) == 2
        for in_modules, ppid in lines:
            assert (in_modules == "True") == forked
            assert (int(ppid) != proc.pid) == forked
