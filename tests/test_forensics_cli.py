"""Hang forensics through the command line: flags, bootstrap, status/stacks subcommands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _helpers import driver
from aiolaunch._cli import config_from_args, parse_args

HANG = textwrap.dedent(
    """
    import os, time

    def stuck_here():
        print("parked", flush=True)
        while True:
            time.sleep(3600)

    def waiting_for_peers():
        print("parked", flush=True)
        while True:
            time.sleep(3600)

    if __name__ == "__main__":
        rank = int(os.environ["LOCAL_RANK"])
        print(f"rank {rank} up", flush=True)
        if rank == 2:
            stuck_here()
        waiting_for_peers()
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "aiolaunch", *args]


def test_flags_build_the_watchdog() -> None:
    cfg = config_from_args(
        parse_args(
            ["--stall-timeout", "30", "--on-stall", "observe", "--progress-regex", "^step", "x.py"]
        )
    )
    wd = cfg.spec.watchdog
    assert wd is not None
    assert (wd.stall_after, wd.action, wd.progress) == (30.0, "observe", "^step")
    assert cfg.spec.args[:4] == ("-u", "-m", "aiolaunch._child._bootstrap", "x.py")
    assert cfg.entrypoint_name == "x.py"
    assert config_from_args(parse_args(["x.py"])).spec.watchdog is None
    with pytest.raises(ValueError, match="--on-stall needs --stall-timeout"):
        config_from_args(parse_args(["--on-stall", "fail", "x.py"]))


def test_module_mode_goes_through_the_bootstrap() -> None:
    cfg = config_from_args(parse_args(["-m", "pkg.train", "--lr", "1"]))
    assert cfg.spec.args == (
        "-u",
        "-m",
        "aiolaunch._child._bootstrap",
        "-m",
        "pkg.train",
        "--lr",
        "1",
    )
    assert cfg.entrypoint_name == "pkg.train"


def test_cli_stall_fails_the_job_and_names_the_outlier(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(HANG)
    logs = tmp_path / "logs"
    t0 = time.monotonic()
    argv = _cli(
        "--nproc-per-node", "4", "--stall-timeout", "2", "--log-dir", str(logs), str(script)
    )
    with driver(argv, env=_env()) as proc:
        _, stderr = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, stderr
    assert elapsed < 2 + 3 + 6  # stall_after + 3 s + interpreter start-up under load
    assert "stalled" in stderr and "stuck_here" in stderr and "outlier" in stderr
    assert "report: " in stderr
    attempt = Path(stderr.split("report: ")[1].split()[0]).parent
    report = json.loads((attempt / "report.json").read_text())
    assert report["verdict"]["outliers"] == [2]
    for rank in range(4):
        assert (attempt / str(rank) / "stacks-1.txt").exists()
    assert "waiting_for_peers" in (attempt / "0" / "stacks-1.txt").read_text()


EARLY_STEPS = textwrap.dedent(
    """
    import os, sys, time

    rank = int(os.environ["LOCAL_RANK"])
    if rank == 1:
        for i in range(3):  # before the watchdog's first sample
            print(f"step {i}", flush=True)
        time.sleep(12)  # then no progress: a stall
        sys.exit(0)
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < 15:  # rank 0: progress all along
        i += 1
        print(f"step {i}", flush=True)
        time.sleep(0.2)
    """
)


def test_progress_printed_before_the_first_sample_counts_for_its_rank(tmp_path: Path) -> None:
    # Judged by the group's progress (rank 0's), rank 1 would never be
    # flagged: the job would succeed after 15 s.
    script = tmp_path / "train.py"
    script.write_text(EARLY_STEPS)
    argv = _cli("--nproc-per-node", "2", "--stall-timeout", "3", "--progress-regex", "^step",
                str(script))  # fmt: skip
    with driver(argv, env=_env()) as proc:
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "rank 1 of 'default' stalled (no progress line and no CPU" in stderr, stderr
    assert "root cause: rank 1 (local_rank 1)" in stderr


def test_cli_status_and_stacks_while_a_job_runs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(HANG)
    logs = tmp_path / "logs"
    with driver(
        _cli("--nproc-per-node", "3", "--log-dir", str(logs), "--redirects", "3", str(script)),
        env=_env(),
        stdout=subprocess.DEVNULL,
    ) as job:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            outs = list(logs.glob("*/attempt_0/*/stdout.log"))
            if len(outs) == 3 and all("parked" in p.read_text() for p in outs):
                break
            time.sleep(0.1)  # allowed: polling the job's log files
        else:
            pytest.fail("the job's workers did not start")
        r = subprocess.run(
            _cli("status", str(logs)),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[1].split()[:2] == ["RANK", "STATE"]
        assert [line.split()[0] for line in lines[2:]] == ["0", "1", "2"]
        assert all(" sleeping " in line for line in lines[2:])
        r = subprocess.run(
            _cli("stacks", str(logs), "--json"),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        answer = json.loads(r.stdout)
        assert "stuck_here" in answer["stacks"]["2"]
        assert answer["report"]["outliers"] == [2]
        assert job.poll() is None  # dumping did not hurt the job
        job.terminate()
        job.communicate(timeout=60)


def test_client_verbs_are_one_table_outside_the_server() -> None:
    # Each client verb is one function of _cli/_client.VERBS, dispatched by
    # main(); _control keeps the server, the registry writer and the wire
    # format only (issue #21 item 5).
    import aiolaunch._live._control as control
    from aiolaunch._cli._client import VERBS

    assert set(VERBS) == {"status", "stacks", "top", "events", "attach"}
    for name in ("find_socket", "request", "running_jobs", "format_status", "status_main"):
        assert not hasattr(control, name), name
    for verb in VERBS:
        r = subprocess.run(
            _cli(verb, "--help"),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 0 and f"usage: aiolaunch {verb}" in r.stdout, r.stderr
    assert control.decode(control.encode({"cmd": "status"})) == {"cmd": "status"}
    with pytest.raises(ValueError, match="JSON object"):
        control.decode(b"[1, 2]\n")
