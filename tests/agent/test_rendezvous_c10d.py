"""Two agents in two processes form one world through torch's c10d rendezvous."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("torch")

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT")
    rec = {k: os.environ[k] for k in keys}
    rec["sum"] = t.item()
    rec["dist_rank"] = dist.get_rank()
    rec["dist_world"] = dist.get_world_size()
    with open(os.path.join(sys.argv[1], f"rank{rec['RANK']}.json"), "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_two_agents_form_one_world_of_four(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    run_id = f"test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "aiolaunch",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=join_timeout=60",
        "--local-addr=127.0.0.1",
        str(script),
        str(out),
    ]
    agents = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    deadline = time.monotonic() + 100
    outputs = []
    try:
        for p in agents:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (so, se) in zip(agents, outputs, strict=True):
        assert p.returncode == 0, f"agent failed:\n{so}\n{se}"

    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert sorted(r["RANK"] for r in recs) == ["0", "1", "2", "3"]
    assert [r["dist_rank"] for r in recs] == [0, 1, 2, 3]
    for r in recs:
        assert r["WORLD_SIZE"] == "4"
        assert r["dist_world"] == 4
        assert r["GROUP_WORLD_SIZE"] == "2"
        assert r["LOCAL_WORLD_SIZE"] == "2"
        assert r["ROLE_WORLD_SIZE"] == "4"
        assert r["ROLE_RANK"] == r["RANK"]
        assert r["TORCHELASTIC_RUN_ID"] == run_id
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        # 1 + 2 + 3 + 4: the all_reduce spanned both agents' workers
        assert r["sum"] == 10.0
        assert int(r["RANK"]) == int(r["GROUP_RANK"]) * 2 + int(r["LOCAL_RANK"])
    # both groups used the same master (the agent-hosted store)
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in recs}) == 1
    assert {r["GROUP_RANK"] for r in recs} == {"0", "1"}
