"""The same script under real torchrun and under aiolaunch sees the same environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("torch")

CONTRACT_KEYS = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
)

# No torch import in the worker: only the launchers are compared.
DUMP = textwrap.dedent(
    f"""
    import json, os, sys
    keys = {CONTRACT_KEYS!r}
    env = {{k: os.environ.get(k) for k in keys}}
    env["argv"] = sys.argv[2:]
    with open(os.path.join(sys.argv[1], f"{{os.environ['LOCAL_RANK']}}.json"), "w") as f:
        json.dump(env, f)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run(
    launcher: list[str], flags: list[str], tmp: Path, env: dict[str, str]
) -> dict[int, dict[str, Any]]:
    script = tmp / "dump.py"
    script.write_text(DUMP)
    out = tmp / f"out_{len(list(tmp.glob('out_*')))}"
    out.mkdir()
    proc = subprocess.run(
        [*launcher, *flags, str(script), str(out), "--x=${local_rank}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
AIOLAUNCH = [sys.executable, "-m", "aiolaunch"]


def _compare(
    theirs: dict[int, dict[str, Any]], ours: dict[int, dict[str, Any]], may_differ: set[str]
) -> None:
    assert set(theirs) == set(ours) == {0, 1}
    for rank in (0, 1):
        t, o = theirs[rank], ours[rank]
        assert set(t) == set(o)
        for key in t:
            if key in may_differ:
                continue
            assert o[key] == t[key], f"rank {rank} {key}: aiolaunch {o[key]!r}, torchrun {t[key]!r}"
        # both point workers at their own error file inside a per-rank folder
        for e in (t, o):
            assert e["TORCHELASTIC_ERROR_FILE"].endswith(os.path.join(str(rank), "error.json"))


def test_static_rendezvous_env_matches_torchrun(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    port = _free_port()
    flags = [
        "--nproc-per-node=2",
        "--rdzv_backend=static",
        "--master_addr=127.0.0.1",
        f"--master-port={port}",
        "--max-restarts=2",
        "--role=trainer",
    ]
    theirs = _run(TORCHRUN, flags, tmp_path, env)
    ours = _run(AIOLAUNCH, flags, tmp_path, env)
    # torchrun's static backend hosts a TCPStore in the agent; aiolaunch needs
    # no torch for one machine, so rank 0 hosts it (env:// does that itself).
    _compare(theirs, ours, {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"})
    assert theirs[0]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert ours[0]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    # the values that are compared are the interesting ones
    assert ours[1]["RANK"] == "1"
    assert ours[1]["argv"] == ["--x=1"]
    assert ours[0]["OMP_NUM_THREADS"] == "1"
    assert ours[0]["MASTER_PORT"] == str(port)
    assert ours[0]["TORCHELASTIC_RUN_ID"] == "none"
    assert ours[0]["TORCHELASTIC_MAX_RESTARTS"] == "2"
    assert ours[0]["ROLE_NAME"] == "trainer"


def test_standalone_env_matches_torchrun(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "3", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    flags = ["--standalone", "--nproc_per_node", "2"]
    theirs = _run(TORCHRUN, flags, tmp_path, env)
    ours = _run(AIOLAUNCH, flags, tmp_path, env)
    # a fresh run id and port each run; torchrun --standalone uses c10d with an
    # agent store on the host's FQDN, aiolaunch the static rendezvous on 127.0.0.1.
    may_differ = {
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
    }
    _compare(theirs, ours, may_differ)
    assert ours[0]["OMP_NUM_THREADS"] == "3"
    assert ours[0]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert ours[0]["TORCHELASTIC_RUN_ID"] == ours[1]["TORCHELASTIC_RUN_ID"] != "none"
    assert ours[0]["MASTER_PORT"] == ours[1]["MASTER_PORT"]
