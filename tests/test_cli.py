"""The command line: torchrun argv parity, exit status, failure summary, signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import pytest

from _helpers import driver, wait_dead
from aiolaunch._cli import (
    config_from_args,
    determine_local_world_size,
    main,
    parse_args,
    parse_endpoint,
    parse_min_max_nnodes,
    parse_rdzv_conf,
)

if TYPE_CHECKING:
    from pathlib import Path

AIOLAUNCH = [sys.executable, "-m", "aiolaunch"]

TORCHRUN_LINES = [
    ["train.py"],
    ["--nproc_per_node=4", "train.py", "--lr", "0.1"],
    ["--nproc-per-node", "2", "--nnodes", "1:3", "--max_restarts", "5", "-m", "pkg.train"],
    [
        "--nnodes=2",
        "--node_rank=1",
        "--master_addr=10.0.0.1",
        "--master_port=1234",
        "--rdzv_backend=static",
        "train.py",
    ],
    [
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=host:29400",
        "--rdzv-id=job7",
        "--rdzv-conf=join_timeout=10,read_timeout=5",
        "--nnodes=1:4",
        "train.py",
    ],
    [
        "--standalone",
        "--nproc-per-node",
        "auto",
        "--role",
        "actor",
        "--start_method",
        "fork",
        "x.py",
    ],
    [
        "--log_dir",
        "/tmp/l",
        "-r",
        "3",
        "-t",
        "0:1,1:2",
        "--local_ranks_filter",
        "0,1",
        "--monitor_interval",
        "0.5",
        "train.py",
        "--flag",
    ],
    [
        "--no_python",
        "--run_path",
        "--local_addr",
        "1.2.3.4",
        "--shutdown_timeout",
        "7",
        "--signals_to_handle",
        "SIGTERM",
        "/bin/echo",
        "a",
        "b",
    ],
]


@pytest.mark.parametrize("argv", TORCHRUN_LINES)
def test_argv_parity_with_torchrun(argv: list[str]) -> None:
    torch_run = pytest.importorskip("torch.distributed.run")
    theirs = vars(torch_run.parse_args(argv))
    ours = vars(parse_args(argv))
    # every torchrun option exists here, with the same value
    missing = set(theirs) - set(ours)
    assert not missing, f"torchrun options missing: {missing}"
    for key, value in theirs.items():
        if key == "numa_binding":
            continue  # torch validates choices against its enum; both None here
        assert ours[key] == value, f"{key}: ours {ours[key]!r}, torchrun {value!r}"


def test_pet_environment_variables_are_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    args = parse_args(["train.py"])
    assert (args.nproc_per_node, args.standalone, args.max_restarts) == ("3", True, 2)
    assert parse_args(["--nproc-per-node", "5", "train.py"]).nproc_per_node == "5"


def test_small_parsers() -> None:
    assert parse_min_max_nnodes("3") == (3, 3)
    assert parse_min_max_nnodes("1:4") == (1, 4)
    for bad in ("0", "2:1", "a", "1:2:3"):
        with pytest.raises(ValueError, match="nnodes"):
            parse_min_max_nnodes(bad)
    assert parse_rdzv_conf(" a=1, b = x ") == {"a": "1", "b": "x"}
    with pytest.raises(ValueError, match="needs a value"):
        parse_rdzv_conf("a=")
    assert parse_endpoint("h:12", None) == ("h", 12)
    assert parse_endpoint("[::1]:5", None) == ("::1", 5)
    assert parse_endpoint("h", 7) == ("h", 7)
    with pytest.raises(ValueError, match="port"):
        parse_endpoint("h:x", None)
    assert determine_local_world_size("3") == 3
    assert determine_local_world_size("cpu") >= 1
    with pytest.raises(ValueError, match="nproc-per-node"):
        determine_local_world_size("many")


def test_config_builds_the_spec_like_torchrun() -> None:
    cfg = config_from_args(
        parse_args(["--nproc-per-node=2", "--max-restarts=1", "-m", "pkg.mod", "--a", "1"])
    )
    spec = cfg.spec
    assert spec.entrypoint == sys.executable
    # Through the bootstrap (stack dumps with no code change); python -m semantics kept.
    assert spec.args == ("-u", "-m", "aiolaunch._child._bootstrap", "-m", "pkg.mod", "--a", "1")
    assert (spec.local_world_size, spec.max_restarts, spec.role) == (2, 1, "default")
    assert cfg.entrypoint_name == "pkg.mod"
    assert cfg.torch_handler is None  # one node: no torch rendezvous
    nopy = config_from_args(parse_args(["--no-python", "/bin/echo", "hi"])).spec
    assert (nopy.entrypoint, nopy.args) == ("/bin/echo", ("hi",))


def test_static_single_node_needs_no_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        from aiolaunch._cli import config_from_args, parse_args
        config_from_args(parse_args(["--standalone", "--nproc-per-node=2", "t.py"]))
        config_from_args(parse_args(["--master-port=1234", "t.py"]))
        import aiolaunch, aiolaunch.agent
        aiolaunch.agent.LocalElasticAgent
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--nnodes", "0", "t.py"], "--nnodes"),
        (["--no-python", "-m", "t"], "--no-python and --module"),
        (["--redirects", "9", "t.py"], "--redirects"),
        (["--local-ranks-filter", "a,b", "t.py"], "--local-ranks-filter"),
        (["--standalone", "--nnodes", "2", "t.py"], "--standalone"),
        (["--nproc-per-node", "lots", "t.py"], "--nproc-per-node"),
    ],
)
def test_bad_options_exit_2_with_a_message(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "aiolaunch: error:" in err
    assert match in err


def test_help_lists_torchrun_flags() -> None:
    # How fast --help is, is measured in benchmarks/run.py (cli_help row).
    proc = subprocess.run([*AIOLAUNCH, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for flag in ("--nproc-per-node", "--nnodes", "--rdzv-backend", "--standalone", "--tee"):
        assert flag in proc.stdout


def test_success_exits_0(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    # one write() per line: under ``python -u`` print() writes each piece
    # separately, so the lines of two workers sharing the console could mix
    script.write_text(
        "import os, sys\n"
        "sys.stdout.write(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\")\n"
    )
    proc = subprocess.run(
        [*AIOLAUNCH, "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["rank 0 of 2", "rank 1 of 2"]


def test_failure_exits_1_with_root_cause_on_stderr(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            if os.environ["LOCAL_RANK"] == "1":
                sys.exit(13)
            time.sleep(30)
            """
        )
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [*AIOLAUNCH, "--nproc_per_node=2", "--max_restarts=1", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 25  # no waiting for the sleeper
    assert "bad.py" in proc.stderr  # the entrypoint name
    assert "13" in proc.stderr  # the root cause's exit code
    assert "Root Cause" in proc.stderr


def test_sigterm_stops_every_worker(tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys, time
            d = sys.argv[1]
            rank = os.environ["LOCAL_RANK"]
            def on_term(signum, frame):
                open(os.path.join(d, f"{rank}.graceful"), "w").close()
                sys.exit(0)
            signal.signal(signal.SIGTERM, on_term)
            # tmp + rename: the test never reads a pid file empty
            with open(os.path.join(d, f"{rank}.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(d, f"{rank}.tmp"), os.path.join(d, f"{rank}.pid"))
            while True:
                time.sleep(0.1)
            """
        )
    )
    with driver([*AIOLAUNCH, "--nproc-per-node", "2", str(script), str(tmp_path)]) as proc:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143  # 128 + SIGTERM (torchrun: 1), what schedulers read
    assert "SIGTERM" in err
    # the workers got the signal (their handler ran) and are gone
    assert sorted(p.name for p in tmp_path.glob("*.graceful")) == ["0.graceful", "1.graceful"]
    assert not wait_dead(pids)
