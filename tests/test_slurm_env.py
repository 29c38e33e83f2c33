"""Under Slurm: hostlist expansion (pure) and what SLURM_* fills in (no daemons;
tests/engines/test_slurm.py runs the real Slurm)."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolaunch._cli import parse_args
from aiolaunch._cli._slurm import apply_slurm, expand_hostlist

if TYPE_CHECKING:
    from pathlib import Path


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("node[001-002,010]", ["node001", "node002", "node010"]),
        ("a[1-2],b,c[5]", ["a1", "a2", "b", "c5"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("gpu-a100-[7,9].cluster.org", ["gpu-a100-7.cluster.org", "gpu-a100-9.cluster.org"]),
        (" x[9-10] ", ["x9", "x10"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[[1]]", "n[3-1]", "n[a-b]", "a,,b", "n[]"])
def test_bad_hostlists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(bad)


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
    lo=st.integers(0, 500),
    span=st.integers(0, 40),
    width=st.integers(1, 5),
    extra=st.lists(st.from_regex(r"[a-z][a-z0-9.]{0,6}", fullmatch=True), max_size=3),
)
def test_ranges_expand_like_scontrol(
    prefix: str, lo: int, span: int, width: int, extra: list[str]
) -> None:
    lo_s = str(lo).zfill(width)
    hi = lo + span
    listed = ",".join([f"{prefix}[{lo_s}-{hi}]", *extra])
    hosts = expand_hostlist(listed)
    expected = [prefix + str(n).zfill(len(lo_s)) for n in range(lo, hi + 1)]
    assert hosts == expected + extra


def _args(*argv: str) -> object:
    return parse_args([*argv, "train.py"])


# an srun step on every node of the allocation (what srun writes)
SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NODELIST": "gpu[07-09]",
}


def test_slurm_fills_what_was_not_given() -> None:
    args = parse_args(["train.py"])
    notice = apply_slurm(args, SLURM)
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("3", 2, "gpu07:29500")
    assert notice == (
        "under Slurm job 42: --nnodes 3 (SLURM_STEP_NUM_NODES), --node-rank 2 (SLURM_NODEID), "
        "--rdzv-endpoint gpu07:29500 (first host of SLURM_STEP_NODELIST=gpu[07-09])"
    )


def test_a_step_on_part_of_the_allocation_is_its_own_world() -> None:
    env = {**SLURM, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[08-09]"}
    env["SLURMD_NODENAME"] = "gpu09"  # SLURM_NODEID=2 counts in the job, not the step
    args = parse_args(["train.py"])
    notice = apply_slurm(args, env)
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("2", 1, "gpu08:29500")
    assert "--node-rank 1 (SLURMD_NODENAME=gpu09 in SLURM_STEP_NODELIST)" in (notice or "")


def test_several_nodes_outside_srun_is_refused() -> None:
    batch = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP_")}
    with pytest.raises(ValueError, match=r"srun aiolaunch.*--nnodes 1"):
        apply_slurm(parse_args(["train.py"]), batch)
    args = parse_args(["--nnodes", "1", "train.py"])  # what the message says: fine
    apply_slurm(args, batch)
    assert args.nnodes == "1"


def test_c10d_gets_the_endpoint_but_no_node_rank() -> None:
    args = parse_args(["--rdzv-backend", "c10d", "train.py"])
    apply_slurm(args, SLURM)
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("3", 0, "gpu07")


def test_what_the_user_gave_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_args(["--nnodes", "2", "--rdzv-endpoint", "head:1234", "train.py"])
    notice = apply_slurm(args, SLURM)
    assert (args.nnodes, args.rdzv_endpoint) == ("2", "head:1234")
    assert notice == "under Slurm job 42: --node-rank 2 (SLURM_NODEID)"
    # PET_* (Kubernetes, torchrun's) counts as given too
    monkeypatch.setenv("PET_NNODES", "4")
    args = parse_args(["train.py"])
    apply_slurm(args, {**SLURM, "PET_NNODES": "4"})
    assert args.nnodes == "4"


def test_one_node_and_outside_slurm_take_nothing_but_the_count() -> None:
    args = parse_args(["train.py"])
    assert apply_slurm(args, {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}) is None
    assert args.nnodes == "1:1"
    one = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "1", "SLURM_NODEID": "0"}
    notice = apply_slurm(args, {**one, "SLURM_JOB_NODELIST": "gpu07"})  # the batch script
    assert notice == "under Slurm job 42: --nnodes 1 (SLURM_NNODES)"
    assert (args.node_rank, args.rdzv_endpoint) == (0, "")


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SLURM_STEP_NUM_NODES", "two"),
        ("SLURM_NODEID", "x"),
        ("SLURM_STEP_NODELIST", "n[1-"),
    ],
)
def test_bad_slurm_values_name_the_variable(var: str, value: str) -> None:
    with pytest.raises(ValueError, match=var):
        apply_slurm(parse_args(["train.py"]), {**SLURM, var: value})


def test_standalone_takes_nothing_from_slurm() -> None:
    # torchrun --standalone is one node whatever Slurm says: in an srun step
    # on several nodes each node runs a job of its own.
    for env in (SLURM, {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP_")}):
        args = parse_args(["--standalone", "train.py"])
        assert apply_slurm(args, env) is None
        assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("1:1", 0, "")


def test_standalone_in_a_two_node_srun_step_runs(tmp_path: Path) -> None:
    # What srun writes on the second node of a 2-node step.
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    env |= {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2"}
    env |= {"SLURM_STEP_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n2"}
    argv = ["--standalone", "--nproc-per-node", "2", "--no-python", "sh", "-c", "echo $WORLD_SIZE"]
    proc = subprocess.run(
        [sys.executable, "-m", "aiolaunch", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "2"]  # one node's world, as torchrun's
    assert "--nnodes" not in proc.stderr


def test_the_cli_says_what_it_took(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_NNODES": "1"}
    env["SLURM_JOB_NODELIST"] = "localhost"
    proc = subprocess.run(
        [sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2", "--no-python", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "aiolaunch: under Slurm job 7: --nnodes 1 (SLURM_NNODES)\n" in proc.stderr
