"""Messages that name the real cause (issue #27 item 7).

`aiolaunch status` as another user, or beside a planted registry folder; a
job registered where the asking shell does not look (cron or nohup: no
$XDG_RUNTIME_DIR); a missing script; the report's stderr lines when stderr
went to the console; a worker that took the dump signal over. Real jobs
(the CLI), real users (root acting as nobody), real signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import aiolaunch
from _helpers import driver

if TYPE_CHECKING:
    from collections.abc import Iterator

AIOLAUNCH = [sys.executable, "-m", "aiolaunch"]
PARK = "import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(3600)\n"
NOBODY = 65534


def _env(**extra: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@contextlib.contextmanager
def _job(log_dir: Path, env: dict[str, str], script: Path) -> Iterator[subprocess.Popen[str]]:
    """A CLI job of two parked workers, yielded once its control socket is up."""
    script.write_text(PARK)
    argv = [*AIOLAUNCH, "--nproc-per-node", "2", "--log-dir", str(log_dir), str(script)]
    with driver(argv, env=env, stdout=subprocess.DEVNULL) as job:
        deadline = time.monotonic() + 60
        while not list(log_dir.glob("*/attempt_0/control.sock")):
            if job.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the job did not start: {job.communicate()[1]}")
            time.sleep(0.05)  # allowed: polling for the job's socket
        yield job
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=60)


def _status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*AIOLAUNCH, "status", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# -- another user, a planted registry, another registry --------------------------


def _as_nobody(argv: list[str]) -> subprocess.CompletedProcess[str]:
    src = str(Path(aiolaunch.__file__).parent.parent)
    return subprocess.run(
        argv,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        env={"PYTHONPATH": src},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd="/",
    )


def _python_for_nobody() -> str:
    """An interpreter that user ``nobody`` can run (``sys.executable`` may live
    in root's private home), importing aiolaunch from the source tree."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root")
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            r = _as_nobody([python, "-c", "import aiolaunch._cli._client"])
        except OSError:  # e.g. in root's private home
            continue
        if r.returncode == 0:
            return python
    pytest.skip("no Python interpreter that user nobody may run")


@pytest.mark.parametrize("private", ["socket", "folder"])
def test_status_as_another_user_names_the_permission_problem(tmp_path: Path, private: str) -> None:
    # Before: "[Errno 13] Permission denied" (socket) or "no aiolaunch group
    # is running with that log dir" (a folder the other user cannot list).
    python = _python_for_nobody()
    base = Path(tempfile.mkdtemp(prefix="aiolaunch-test-", dir="/tmp"))  # nobody can reach it
    try:
        base.chmod(0o755)
        logs = base / "logs"
        with _job(logs, _env(), tmp_path / "train.py"):
            for folder in [logs, *logs.rglob("*")]:
                if folder.is_dir():  # "socket": every folder open, the socket 0600
                    folder.chmod(0o700 if private == "folder" else 0o755)
            r = _as_nobody([python, "-m", "aiolaunch", "status", str(logs)])
        assert r.returncode == 1
        assert "no aiolaunch group is running" not in r.stderr, r.stderr
        assert "permission denied" in r.stderr and "root" in r.stderr, r.stderr
        assert "run this as that user" in r.stderr
        what = "cannot look for the job's control.sock" if private == "folder" else "cannot connect"
        assert what in r.stderr, r.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("planted", ["open-mode", "other-owner"])
def test_a_planted_registry_folder_is_named_not_ignored(tmp_path: Path, planted: str) -> None:
    # Before: the job ran unlisted without a word, and `aiolaunch status`
    # said "no running aiolaunch job of yours was found".
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    folder = tmp / f"aiolaunch-{os.getuid()}"
    folder.mkdir()
    if planted == "open-mode":
        folder.chmod(0o777)
    elif os.geteuid() == 0:
        os.chown(folder, NOBODY, NOBODY)
    else:
        pytest.skip("a folder owned by another user needs root to make")
    env = _env(TMPDIR=str(tmp), XDG_RUNTIME_DIR=None)
    with _job(tmp_path / "logs", env, tmp_path / "train.py") as job:
        r = _status(_env(TMPDIR=str(tmp), XDG_RUNTIME_DIR=str(tmp_path)))
        job.send_signal(signal.SIGTERM)
        _, job_err = job.communicate(timeout=60)
    assert r.returncode == 1
    assert str(folder) in r.stderr and "Remove it" in r.stderr and "LOG_DIR" in r.stderr
    assert "another user" in r.stderr or "open to other users" in r.stderr, r.stderr
    assert str(folder) in job_err and "remove that folder" in job_err, job_err


def test_a_job_started_without_xdg_runtime_dir_is_found_from_a_login_shell(
    tmp_path: Path,
) -> None:
    # cron / nohup: no $XDG_RUNTIME_DIR, so the job registers in the temp
    # folder; a login shell has one. Before: "no running aiolaunch job".
    tmp, run = tmp_path / "tmp", tmp_path / "run"
    tmp.mkdir()
    run.mkdir(mode=0o700)
    with _job(tmp_path / "logs", _env(TMPDIR=str(tmp), XDG_RUNTIME_DIR=None), tmp_path / "t.py"):
        r = _status(_env(TMPDIR=str(tmp), XDG_RUNTIME_DIR=str(run)), "--json")
        assert r.returncode == 0, r.stderr
        assert [w["rank"] for w in json.loads(r.stdout)["workers"]] == [0, 1]
    r = _status(_env(TMPDIR=str(tmp), XDG_RUNTIME_DIR=str(run)))
    assert r.returncode == 1
    # Not found: the message says where it looked.
    assert f"{run}/aiolaunch" in r.stderr and f"{tmp}/aiolaunch-{os.getuid()}" in r.stderr


# -- a missing script -------------------------------------------------------------


async def test_a_missing_script_exits_2_as_python_does(tmp_path: Path) -> None:
    # The bootstrap (every Python worker of the CLI) behaves as python: one
    # line and exit status 2 - it raised FileNotFoundError, status 1.
    async with aiolaunch.start_processes(
        "m",
        sys.executable,
        {0: ("-m", "aiolaunch._child._bootstrap", "missing.py")},
        {0: {}},
        log_dir=tmp_path,
        redirects=aiolaunch.Std.ALL,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None and result.failures[0].exitcode == 2
    err = (tmp_path / "0" / "stderr.log").read_text()
    assert err.endswith(
        f": can't open file {os.path.abspath('missing.py')!r}: [Errno 2] "
        "No such file or directory\n"
    ), err
    assert "Traceback" not in err


# -- the report's stderr lines ----------------------------------------------------

FAIL = "import sys\nprint('the real reason', file=sys.stderr, flush=True)\nsys.exit(3)\n"


@pytest.mark.parametrize("redirect", [False, True])
def test_the_report_says_where_stderr_went(tmp_path: Path, redirect: bool) -> None:
    # Before: without -r the report had no stderr lines and no word on why.
    script = tmp_path / "train.py"
    script.write_text(FAIL)
    logs = tmp_path / "logs"
    flags = ["-r", "2"] if redirect else []
    r = subprocess.run(
        [*AIOLAUNCH, "--log-dir", str(logs), *flags, str(script)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1, r.stderr
    report = next(logs.glob("*/attempt_0/report.txt")).read_text()
    data = json.loads(next(logs.glob("*/attempt_0/report.json")).read_text())
    if redirect:
        assert "last stderr lines:\n    the real reason" in report, report
        assert data["root_cause"]["stderr_note"] is None
    else:
        assert "the real reason" in r.stderr  # it went to the console
        assert "no stderr lines here: its stderr went to the console" in report, report
        assert "-t 2 or -r 2" in report
        assert data["root_cause"]["stderr_tail"] == []


# -- a worker that took the dump signal over --------------------------------------


def takes_the_dump_signal(how: str) -> None:
    from aiolaunch._child._dump_handler import DUMP_SIGNAL

    if how == "handler":
        signal.signal(DUMP_SIGNAL, lambda *_: None)
    elif how == "ignore":
        signal.signal(DUMP_SIGNAL, signal.SIG_IGN)
    print("parked", flush=True)
    while True:
        time.sleep(3600)


@pytest.mark.parametrize(
    ("how", "needles"),
    [
        ("handler", ("did not answer within 1s although it runs", "not aiolaunch's", "replaced")),
        ("ignore", ("ignores the dump signal (SIGRTMIN+5)", "SIG_IGN")),
        ("stopped", ("is stopped", "kill -CONT")),
    ],
)
async def test_a_worker_that_took_the_dump_signal_over_gets_the_real_reason(
    tmp_path: Path, how: str, needles: tuple[str, ...]
) -> None:
    # Before: "did not answer within 1s (stopped, or in uninterruptible
    # sleep)" for a replaced handler, "it exec'd another program?" for SIG_IGN.
    async with aiolaunch.start_processes(
        "t",
        takes_the_dump_signal,
        {0: (how,)},
        {0: {}},
        log_dir=tmp_path,
        redirects=aiolaunch.Std.ALL,
    ) as ctx:
        await asyncio.wait_for(_until_text(tmp_path / "0" / "stdout.log", "parked"), 60)
        pid = ctx.pids()[0]
        if how == "stopped":
            os.kill(pid, signal.SIGSTOP)
        try:
            dumps = await asyncio.wait_for(ctx.dump_stacks(timeout=1), 30)
        finally:
            if how == "stopped":
                os.kill(pid, signal.SIGCONT)
    for needle in needles:
        assert needle in dumps[0], dumps[0]


async def _until_text(path: Path, text: str) -> None:
    while not (path.exists() and text in path.read_text()):
        await asyncio.sleep(0.02)  # allowed: polling the worker's log file
