"""Collective forensics of real gloo jobs (issue #44): torch's own record of
every rank's collectives, read from outside with no code in the script.

The scenarios run concurrently inside each test, each a 4-rank job under the
CLI (its workers forked from a zygote that imported torch once).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import aiolaunch
from _helpers import together, wait_lines
from aiolaunch import Std, Watchdog, WorkerStalled, WorkerStraggling
from test_collective_verdict import torchfrtrace

pytestmark = pytest.mark.torch
pytest.importorskip("torch.distributed")

STALL = 5
#: Each scenario: rank 3 (rank 1 in the subgroup one) holds the others up.
HANG = textwrap.dedent(
    """
    import atexit, os, sys, time
    mode = sys.argv[1]
    if mode == "exit" and os.environ["RANK"] == "3":
        # Registered before torch's exit handlers (and aiolaunch's): run after
        # them. Rank 3 takes long to die: the others die first, of its leaving.
        atexit.register(time.sleep, 3)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    pair = dist.new_group([0, 1], group_desc="pair01")
    for _ in range(3):
        dist.all_reduce(t)
    if rank < 2:
        dist.all_reduce(t, group=pair)
    # One write (atomic on a pipe): the ranks' unbuffered prints interleave.
    os.write(1, f"ready {time.time()}\\n".encode())
    if mode == "skip":  # rank 3 skips the all_reduce and waits for something else
        if rank == 3:
            time.sleep(3600)
        dist.all_reduce(t)
    elif mode == "op":  # rank 3 calls another collective at that point
        if rank == 3:
            dist.all_gather([torch.zeros(4) for _ in range(4)], t)
        else:
            dist.all_reduce(t)
    elif mode == "shapes":  # rank 3 all-reduces other sizes: gloo fails at once
        dist.all_reduce(torch.ones(8) if rank == 3 else t)
    elif mode == "compute":  # rank 3 computes in a one-line loop while the others wait
        if rank == 3:
            x = 0
            while True: x += 1
        dist.all_reduce(t)
    elif mode == "subgroup":  # rank 1 misses pair01's all_reduce
        if rank == 0:
            dist.all_reduce(t, group=pair)
        elif rank == 1:
            time.sleep(3600)
        dist.all_reduce(t)
    elif mode == "exit":  # rank 3 leaves before the all_reduce
        if rank == 3:
            sys.exit(0)
        dist.all_reduce(t)
    dist.destroy_process_group()
    """
)

#: Healthy jobs the stack rule alone failed (the issue's field reports).
HEALTHY = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist

    mode, seconds = sys.argv[1], float(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)

    def fib(n):
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    end = time.monotonic() + seconds
    if mode == "tight":  # every rank: a one-line loop between two all_reduces
        x = 0
        while time.monotonic() < end: x += 1
    elif mode == "eval" and rank == 0:  # rank 0 evaluates: its stack moves
        while time.monotonic() < end:
            fib(16)
    elif mode == "checkpoint" and rank == 0:  # rank 0 writes checkpoints
        path = os.path.join(os.environ["OUT"], "ckpt.pt")
        state = {"w": torch.randn(256, 1024)}
        while time.monotonic() < end:
            torch.save(state, path)
    dist.all_reduce(t)
    print("done", flush=True)
    dist.destroy_process_group()
    """
)


async def _cli(
    tmp: Path, name: str, code: str, *args: str, ranks: int = 4, timeout: float = 180
) -> tuple[int, str, Path]:
    """Run ``code`` under ``aiolaunch --stall-timeout`` with ``ranks`` ranks:
    (exit status, console output, log dir)."""
    folder = tmp / name
    folder.mkdir()
    script = folder / "job.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OUT": str(folder)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiolaunch", "--standalone", "--nproc-per-node", str(ranks),
        "--stall-timeout", str(STALL), "--log-dir", str(folder / "logs"), str(script), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), folder / "logs"


def _report(log_dir: Path) -> dict[str, Any]:
    (path,) = log_dir.glob("**/report.json")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


#: mode -> (verdict, culprits, process group, op, sequence number, waiting)
EXPECTED = {
    "skip": ("missing", [3], "default_pg", "all_reduce", 4, [0, 1, 2]),
    "op": ("mismatch", [3], "default_pg", "all_reduce", 4, [0, 1, 2]),
    "shapes": ("mismatch", [3], "default_pg", "all_reduce", 4, [0, 1, 2]),
    "compute": ("in_compute", [3], "default_pg", "all_reduce", 4, [0, 1, 2]),
    "subgroup": ("missing", [1], "pair01", "all_reduce", 2, [0]),
    "exit": ("exited", [3], "default_pg", "all_reduce", 4, [0, 1, 2]),
}

#: The scenarios that end in a failure, not a stall: gloo fails the collective
#: at once (rank 3's exit; other sizes, where the others may even return).
FIRST_FAILURES = ("exit", "shapes")


async def test_the_collectives_name_who_holds_the_others_up(tmp_path: Path) -> None:
    modes = list(EXPECTED)
    runs = await together(*(_cli(tmp_path, m, HANG, m) for m in modes))
    for mode, (rc, out, log_dir) in zip(modes, runs, strict=True):
        assert rc == 1, (mode, out[-3000:])
        report = _report(log_dir)
        c = report.get("collective")
        assert c is not None, (mode, report, out[-3000:])
        verdict, culprits, pg, op, seq, waiting = EXPECTED[mode]
        got = (c["verdict"], c["ranks"], c["pg"], c["op"], c["seq"], c["waiting"])
        assert got == (verdict, culprits, pg, op, seq, waiting), (mode, c)
        assert "Server listening" not in out, mode  # torch's server keeps quiet
        # The raw records, one per rank, in torch's format; the sentence.
        dumps = Path(c["dumps"])
        assert sorted(p.name for p in dumps.iterdir()) == [f"rank_{r}" for r in range(4)]
        text = next(log_dir.glob("**/report.txt")).read_text()
        assert f"Collectives ({verdict}): {c['text']}." in text, mode
        if mode not in FIRST_FAILURES:  # a stall: the verdict came in time, culprits first
            ready = max(
                float(line.split()[1]) for line in out.splitlines() if line.startswith("ready")
            )
            assert dumps.stat().st_mtime - ready < STALL + 10, mode
            assert report["root_cause"]["rank"] == culprits[0], (mode, report["root_cause"])
            assert f"collectives: {c['text']}" in report["root_cause"]["message"], mode
    # torch's own analyzer reads every folder (the pg_config gloo leaves empty is filled).
    seen = await together(
        *(asyncio.to_thread(torchfrtrace, Path(_report(r[2])["collective"]["dumps"])) for r in runs)
    )
    assert "missing ranks: {3}" in seen[modes.index("skip")]
    assert "SIZE_OR_SYNTAX_MISMATCH" in seen[modes.index("shapes")]


async def test_working_ranks_are_never_killed(tmp_path: Path) -> None:
    """Two ranks in a one-line loop for 4x the stall time between two
    all_reduces; a rank 0 evaluating, or writing checkpoints, for 3x the stall
    time while three others wait in the next all_reduce."""
    runs = await together(
        _cli(tmp_path, "tight", HEALTHY, "tight", str(4 * STALL), ranks=2),
        _cli(tmp_path, "eval", HEALTHY, "eval", str(3 * STALL)),
        _cli(tmp_path, "checkpoint", HEALTHY, "checkpoint", str(3 * STALL)),
    )
    for name, (rc, out, log_dir) in zip(("tight", "eval", "checkpoint"), runs, strict=True):
        assert rc == 0, (name, out[-3000:])
        assert out.count("done") == (2 if name == "tight" else 4), name
        assert list(log_dir.glob("**/report.json")) == [], name
        assert "stalled" not in out, (name, out[-3000:])
        if name != "tight":  # the others waited for rank 0: said once, not a stall
            assert "wait in all_reduce #2 of default_pg for rank 0, which works" in out, name


def ddp_rank(rank: int, world: int, port: int, late: int, seconds: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = DistributedDataParallel(torch.nn.Linear(32, 32))
    if rank == late:  # 0.1 s late inside DDP's backward: its all_reduce has no frame to sample

        def late_grad(grad: Any) -> Any:
            time.sleep(0.1)
            return grad

        model.module.weight.register_hook(late_grad)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    print("training", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.1)  # the data loader: it waits, so 4 ranks on 2 cores keep time
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    dist.destroy_process_group()


async def test_a_rank_late_inside_ddps_backward_is_named_by_its_lateness(tmp_path: Path) -> None:
    port = aiolaunch.free_port()
    async with aiolaunch.start_processes(
        "ddp", ddp_rank, {r: (r, 4, port, 3, 60.0) for r in range(4)}, {r: {} for r in range(4)},
        log_dir=tmp_path, redirects=Std.ALL, preload=("torch",),
        watchdog=Watchdog(stall_after=600, stragglers=1.0),
    ) as ctx:  # fmt: skip
        t0 = await wait_lines(tmp_path, 4, "training", timeout=120)
        named: list[WorkerStraggling] = []
        while not named and time.monotonic() < t0 + 60:
            await asyncio.sleep(0.5)  # allowed: waiting for the statistic's window
            named = [e for e in ctx._bus.history if isinstance(e, WorkerStraggling)]
        assert named, "the late rank was never named within 60 s of training"
        e = named[0]
        assert [n.rank for n in named] == [3] and e.source == "collectives", named
        assert e.wait_share < 0.25 < e.peers_wait_share, e
        statuses = ctx.status()
        assert statuses[3].straggling and statuses[3].state == "straggling"
        peers = [s.lateness_s for s in statuses[:3]]
        assert all(p is not None and p < 0.05 for p in peers), peers
        # Within 20 % of the 0.1 s injected, give or take how late a rank on
        # time arrives here (a loaded host starves ranks now and then: the
        # earliest of four gains on the others).
        noise = max(p or 0.0 for p in peers)
        assert e.lateness_s is not None and 0.08 <= e.lateness_s <= 0.12 + noise, (e, peers)
        assert statuses[3].lateness_s == pytest.approx(e.lateness_s, abs=0.03)
        from aiolaunch._live._metrics import render_metrics

        text = render_metrics({"name": "ddp", "workers": [s.to_json() for s in statuses]})
        assert 'aiolaunch_worker_lateness_seconds{rank="3"} 0.1' in text
        assert not any(isinstance(ev, WorkerStalled) for ev in ctx._bus.history)
        await ctx.close()


def test_the_rank_side_leaves_the_users_settings_and_its_stderr_alone(tmp_path: Path) -> None:
    """Armed from the import hook: no line on stderr, the socket and the
    description; a buffer size the user set is kept; an old torch says why
    it has no record; the rank's exit status is its own, and it leaves its
    last words."""
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, json, glob
            import torch  # the hook arms here
            d = os.environ["AIOLAUNCH_STACKS_DIR"]
            info = json.load(open(glob.glob(os.path.join(d, "fr-*.json"))[0]))
            print(json.dumps({"info": info, "size": os.environ.get("TORCH_FR_BUFFER_SIZE"),
                              "files": sorted(os.listdir(d))}))
            import aiolaunch._child._record_server as rs
            torch.__version__ = "2.7.1"  # what an old torch says of itself
            server, rs._armed.server = rs._armed.server, None
            rs.arm(os.path.join(d, "old"))
            rs._armed.server = server
            sys.exit(3)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    runs = []
    for size in (None, "7"):
        d = tmp_path / f"stacks-{size}"
        run_env = {**env, "AIOLAUNCH_COLLECTIVES": "1", "AIOLAUNCH_STACKS_DIR": str(d)}
        if size is not None:
            run_env["TORCH_FR_BUFFER_SIZE"] = size
        proc = subprocess.run(
            [sys.executable, "-m", "aiolaunch._child._bootstrap", str(script)],
            capture_output=True, text=True, env=run_env, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr == "", proc.stderr
        runs.append((json.loads(proc.stdout), d))
    (first, d0), (second, _) = runs
    assert first["size"] == "64" and second["size"] == "7"
    assert first["info"]["entries"] == "64" and second["info"]["entries"] == "7"
    pid = first["info"]["pid"]
    assert {f"fr-{pid}.json", f"fr-{pid}.sock"} <= set(first["files"])
    assert (d0 / f"fr-{pid}.last").exists()  # its last words, written at exit
    off = (d0 / "old" / f"fr-{pid}.off").read_text()
    assert off == "torch 2.7.1 keeps no collective record for gloo (torch 2.8 does)"


async def test_a_rank_that_does_not_answer_is_reported_never_waited_on(tmp_path: Path) -> None:
    from aiolaunch._hangs._pull import pull_records

    code = "import torch, time\nprint('up', flush=True)\ntime.sleep(600)\n"
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
        "AIOLAUNCH_COLLECTIVES": "1", "AIOLAUNCH_STACKS_DIR": str(tmp_path),
    }  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ARMED + code],
            stdout=subprocess.PIPE,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"up\n"
        os.kill(procs[1].pid, signal.SIGSTOP)  # it cannot answer
        while _state(procs[1].pid) != "T":
            await asyncio.sleep(0.01)  # allowed: until the kernel stopped it
        t0 = time.monotonic()
        got = await pull_records(str(tmp_path), {0: procs[0].pid, 1: procs[1].pid}, 1.0)
        took = time.monotonic() - t0
        assert got[0].status == "ok" and got[0].dumps, got[0]
        assert got[1].status == "silent" and got[1].note == "no answer within 1s", got[1]
        assert took < 1.5, took
        # A build with NCCL is asked for NCCL's record too; where there is none
        # (this CPU build answers 404), gloo's still stands.
        info = tmp_path / f"fr-{procs[0].pid}.json"
        info.write_text(json.dumps({**json.loads(info.read_text()), "nccl": True}))
        got = await pull_records(str(tmp_path), {0: procs[0].pid}, 1.0)
        assert got[0].status == "ok" and len(got[0].dumps) == 1, got[0]
        assert got[0].note.startswith("no NCCL record: dump_nccl_trace_json: HTTP/1.1 404")
    finally:
        for p in procs:
            p.kill()
            p.wait()
            assert p.stdout is not None
            p.stdout.close()


#: A rank armed the way the bootstraps arm it, for a ``python -c`` program.
_ARMED = "from aiolaunch._child._record_server import watch; watch()\n"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
