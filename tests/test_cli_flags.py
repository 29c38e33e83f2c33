"""torchrun 2.13's late flags, for real: what each worker gets, compared with torchrun.

--virtual-local-rank, --numa-binding, --event-log-handler, --duplicate-*-filters,
--signals-to-handle, and aiolaunch's --forward-signals. Real processes; torchrun
runs the same command line where the comparison is cheap.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import pytest

from _helpers import driver
from aiolaunch._cli import get_args_parser

if TYPE_CHECKING:
    from pathlib import Path

AIOLAUNCH = [sys.executable, "-m", "aiolaunch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT = 120


def _run(
    launcher: list[str], argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "LOGLEVEL": "INFO", **(env or {})}
    full_env.pop("PET_NPROC_PER_NODE", None)
    return subprocess.run(
        [*launcher, *argv],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def _torchrun() -> list[str]:
    pytest.importorskip("torch.distributed.run")
    return TORCHRUN


def test_no_torchrun_flag_is_ignored_or_unsupported() -> None:
    text = " ".join(get_args_parser().format_help().split()).lower()
    assert "not supported" not in text
    assert "ignored" not in text
    for flag in (
        "--virtual-local-rank",
        "--numa-binding",
        "--event-log-handler",
        "--signals-to-handle",
        "--duplicate-stdout-filters",
        "--forward-signals",
    ):
        assert flag in text


# Each worker appends "RANK LOCAL_RANK CUDA_VISIBLE_DEVICES" to a shared file.
ENV_SCRIPT = 'echo "$RANK $LOCAL_RANK ${CUDA_VISIBLE_DEVICES-unset}" >> "$OUT"'


@pytest.mark.parametrize("visible", [None, "5,7"])
def test_virtual_local_rank_env_matches_torchrun(tmp_path: Path, visible: str | None) -> None:
    seen: dict[str, list[str]] = {}
    for name, launcher in (("aiolaunch", AIOLAUNCH), ("torchrun", _torchrun())):
        out = tmp_path / f"{name}.txt"
        env = {"OUT": str(out)}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        argv = ["--standalone", "--nproc-per-node", "2", "--virtual-local-rank", "--no-python"]
        proc = _run(launcher, [*argv, "/bin/sh", "-c", ENV_SCRIPT], tmp_path, env)
        assert proc.returncode == 0, proc.stderr
        seen[name] = sorted(out.read_text().splitlines())
    want = ["0 0 5", "1 0 7"] if visible else ["0 0 0", "1 0 1"]
    assert seen["aiolaunch"] == want
    assert seen["torchrun"] == want


def test_virtual_local_rank_with_too_few_devices_is_refused(tmp_path: Path) -> None:
    proc = _run(
        AIOLAUNCH,
        ["--nproc-per-node", "2", "--virtual-local-rank", "--no-python", "/bin/true"],
        tmp_path,
        {"CUDA_VISIBLE_DEVICES": "3"},
    )
    assert proc.returncode == 2
    assert "CUDA_VISIBLE_DEVICES=3" in proc.stderr


def test_without_virtual_local_rank_local_ranks_are_real(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    proc = _run(
        AIOLAUNCH,
        ["--nproc-per-node", "2", "--no-python", "/bin/sh", "-c", ENV_SCRIPT],
        tmp_path,
        {"OUT": str(out), "CUDA_VISIBLE_DEVICES": "5,7"},
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(out.read_text().splitlines()) == ["0 0 5,7", "1 1 5,7"]


def test_numa_binding_fails_like_torchrun_where_it_cannot_bind(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and shutil.which("numactl"):
        pytest.skip("this machine can bind: the failure case needs no GPU or no numactl")
    marker = tmp_path / "ran"
    argv = ["--standalone", "--nproc-per-node", "2", "--numa-binding", "node", "--no-python"]
    argv += ["/bin/sh", "-c", f"touch {marker}"]
    ours = _run(AIOLAUNCH, argv, tmp_path)
    theirs = _run(_torchrun(), argv, tmp_path)
    assert theirs.returncode != 0 and ours.returncode != 0
    assert "cannot bind local_rank 0" in ours.stderr
    assert not marker.exists(), "no worker may start when the binding cannot be computed"


def test_numa_binding_needs_a_known_mode(tmp_path: Path) -> None:
    proc = _run(AIOLAUNCH, ["--numa-binding", "everywhere", "/bin/true"], tmp_path)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def _events(stderr: str) -> list[tuple[str, str, int | None]]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{") and "torchelastic.worker.status" in line:
            event = json.loads(line)
            md = event["metadata"]
            out.append((event["name"], event["source"], md["global_rank"]))
    return out


def test_event_log_handler_console_records_torchruns_events(tmp_path: Path) -> None:
    argv = ["--standalone", "--nproc-per-node", "2", "--event-log-handler", "console"]
    argv += ["--no-python", "/bin/true"]
    ours = _run(AIOLAUNCH, argv, tmp_path)
    theirs = _run(_torchrun(), argv, tmp_path)
    assert ours.returncode == 0 and theirs.returncode == 0, ours.stderr
    assert sorted(_events(ours.stderr), key=str) == sorted(_events(theirs.stderr), key=str)
    names = [name.rsplit(".", 1)[1] for name, _, _ in _events(ours.stderr)]
    assert names.count("START") == 2 and names.count("SUCCEEDED") == 3
    # null (the default) records nothing
    quiet = _run(AIOLAUNCH, ["--nproc-per-node", "2", "--no-python", "/bin/true"], tmp_path)
    assert _events(quiet.stderr) == []


def test_event_log_handler_records_failures(tmp_path: Path) -> None:
    argv = ["--nproc-per-node", "2", "--event-log-handler", "console", "--no-python"]
    argv += ["/bin/sh", "-c", 'test "$LOCAL_RANK" = 0 || exit 3; sleep 30']
    proc = _run(AIOLAUNCH, argv, tmp_path)
    assert proc.returncode == 1
    final = {(e[0].rsplit(".", 1)[1], e[2]) for e in _events(proc.stderr) if "START" not in e[0]}
    assert ("FAILED", 1) in final
    assert ("TERMINATED", 0) in final  # stopped by the agent, as torch names it
    assert ("FAILED", None) in final  # the agent's own event


def test_unknown_event_log_handler_is_refused(tmp_path: Path) -> None:
    proc = _run(AIOLAUNCH, ["--event-log-handler", "nowhere", "/bin/true"], tmp_path)
    assert proc.returncode == 2
    assert "'nowhere' is not a registered handler" in proc.stderr


FRUIT = 'echo "apple $RANK"; echo "pear $RANK"; echo "apple err $RANK" >&2'


def test_duplicate_filters_file_matches_torchrun(tmp_path: Path) -> None:
    files: dict[str, list[str]] = {}
    for name, launcher in (("aiolaunch", AIOLAUNCH), ("torchrun", _torchrun())):
        log_dir = tmp_path / name
        argv = ["--standalone", "--nproc-per-node", "2", "--tee", "3", "--log-dir", str(log_dir)]
        argv += ["--duplicate-stdout-filters", "apple,kiwi", "--no-python", "/bin/sh", "-c", FRUIT]
        proc = _run(launcher, argv, tmp_path)
        assert proc.returncode == 0, proc.stderr
        (path,) = log_dir.glob("*/attempt_0/filtered_stdout.log")
        files[name] = sorted(path.read_text().splitlines())
        assert not list(log_dir.glob("*/attempt_0/filtered_stderr.log"))
    assert files["aiolaunch"] == ["[default0]:apple 0", "[default1]:apple 1"]
    assert files["aiolaunch"] == files["torchrun"]


def test_signal_lists_reach_the_environment(tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    script = 'echo "$TORCHELASTIC_SIGNALS_TO_HANDLE|${AIOLAUNCH_FORWARD_SIGNALS-unset}" > "$OUT"'
    argv = ["--signals-to-handle", "SIGTERM,SIGUSR2", "--forward-signals", "SIGUSR1"]
    proc = _run(
        AIOLAUNCH, [*argv, "--no-python", "/bin/sh", "-c", script], tmp_path, {"OUT": str(out)}
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().strip() == "SIGTERM,SIGUSR2|SIGUSR1"
    # the defaults, as torchrun exports them
    proc = _run(AIOLAUNCH, ["--no-python", "/bin/sh", "-c", script], tmp_path, {"OUT": str(out)})
    assert out.read_text().strip() == "SIGTERM,SIGINT,SIGHUP,SIGQUIT|unset"


SIGNAL_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    out = sys.argv[1]
    rank = os.environ["RANK"]
    got = []
    if len(sys.argv) > 2:  # --forward-signals: note the signal, then finish
        signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    open(os.path.join(out, f"ready{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(os.path.join(out, f"done{rank}"), "w") as f:
        f.write("usr1" if got else "timeout")
    """
)


def _wait_files(paths: list[Path], proc: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"workers not ready: {paths}"
        time.sleep(0.05)


@pytest.mark.parametrize("launcher", ["aiolaunch", "torchrun"])
def test_signals_to_handle_stops_the_run_like_torchrun(tmp_path: Path, launcher: str) -> None:
    # SIGUSR1 in the list: the supervisor catches it, the workers are stopped
    # and the run ends with a failure - aiolaunch as torchrun
    cmd = AIOLAUNCH if launcher == "aiolaunch" else _torchrun()
    script = tmp_path / "worker.py"
    script.write_text(SIGNAL_WORKER)
    argv = ["--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGUSR1"]
    argv += ["--shutdown-timeout", "5", str(script), str(tmp_path)]
    with driver([*cmd, *argv], env={**os.environ, "LOGLEVEL": "WARNING"}) as proc:
        _wait_files([tmp_path / "ready0", tmp_path / "ready1"], proc)
        proc.send_signal(signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode != 0
    assert not (tmp_path / "done0").exists() and not (tmp_path / "done1").exists()
    if launcher == "aiolaunch":
        assert "received SIGUSR1" in stderr


def test_forward_signals_reach_workers_that_keep_running(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(SIGNAL_WORKER)
    argv = ["--nproc-per-node", "2", "--forward-signals", "SIGUSR1"]
    argv += [str(script), str(tmp_path), "handle"]
    with driver([*AIOLAUNCH, *argv]) as proc:
        _wait_files([tmp_path / "ready0", tmp_path / "ready1"], proc)
        proc.send_signal(signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stderr
    # both workers got the signal and finished on their own
    assert (tmp_path / "done0").read_text() == "usr1"
    assert (tmp_path / "done1").read_text() == "usr1"
