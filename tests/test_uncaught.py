"""The user's exception in every failure message, with no ``@record`` (issue #46.2).

aiolaunch runs every Python worker through its own bootstrap (a script's,
spawned or forked from the zygote; a function's), which records the
exception that ends the program as ``@record`` would. The termination
message (what Kubernetes shows), the root-cause summary on stderr and
``report.json`` then carry its type, message and traceback. A program that
writes its error file itself (``@record``, its own data) keeps its file.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

import aiolaunch
from _helpers import driver
from _programs import write_script
from aiolaunch import RestartPolicy, Std
from aiolaunch._cli._exit import TERMINATION_LOG_LIMIT

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX workers")

FIRE = """
import os, sys, time

def deep():
    raise ValueError("the disk is on fire" + "!" * int(sys.argv[1]) + " - end")

with open(os.path.join(sys.argv[2], os.environ["RANK"]), "w") as f:
    f.write(str(os.getppid()))
if os.environ["RANK"] == "1":
    deep()
time.sleep(60)  # stopped by the fail-fast
"""

OWN_ERROR_FILE = """
import json, os, sys, time

if os.environ["RANK"] == "1":
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": {"message": "QuotaError: the team's quota is spent",
                               "extraInfo": {"py_callstack": "our own stack",
                                             "timestamp": "1700000000"}}}, f)
    raise RuntimeError("not this one")
time.sleep(60)
"""

RECORDED = """
import os, time
from aiolaunch import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise KeyError("recorded by the decorator")
    time.sleep(60)

main()
"""


class Run(NamedTuple):
    status: int
    pid: int
    stderr: str
    message: str  # the termination message
    report: dict[str, Any]


def _cli(tmp_path: Path, flags: list[str], script: Path, *args: str) -> Run:
    """A failed 2-rank run of ``aiolaunch FLAGS script ARGS``."""
    log = tmp_path / "termination-log"
    env = {**os.environ, "AIOLAUNCH_TERMINATION_LOG": str(log)}
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2", "--log-dir", str(logs)]
    with driver([*argv, *flags, str(script), *args], env=env) as proc:
        _, err = proc.communicate(timeout=120)
    (report,) = logs.glob("*/attempt_0/report.json")
    return Run(proc.returncode, proc.pid, err, log.read_text(), json.loads(report.read_text()))


@pytest.mark.parametrize("how", ["spawned", "forked"])
def test_a_script_without_record_reports_its_exception(tmp_path: Path, how: str) -> None:
    script = write_script(tmp_path, "fire.py", FIRE)
    flags = ["--no-preload"] if how == "spawned" else ["--preload", "json"]
    ppids = tmp_path / "ppids"
    ppids.mkdir()
    status, pid, err, message, report = _cli(tmp_path, flags, script, "0", str(ppids))
    assert status == 1, err
    parent = int((ppids / "1").read_text())  # the agent, or the zygote
    assert (parent != pid) == (how == "forked")
    # the termination message: the head, the traceback's last lines, the exception
    head, *rest = message.splitlines()
    assert head.startswith(f"{script} failed: rank 1 (local_rank 1) on "), message
    assert rest[0] == "Traceback (most recent call last):", message
    assert rest[-3:] == [
        f'  File "{script}", line 5, in deep',
        '    raise ValueError("the disk is on fire" + "!" * int(sys.argv[1]) + " - end")',
        "ValueError: the disk is on fire - end",
    ], message
    assert "aiolaunch/_child" not in message  # the bootstrap's own frames are left out
    # the summary on stderr
    assert "traceback : Traceback (most recent call last):" in err
    assert "\n  ValueError: the disk is on fire - end\n" in err
    assert "@aiolaunch.record" not in err
    # report.json
    cause = report["root_cause"]
    assert cause["message"] == "ValueError: the disk is on fire - end"
    assert cause["traceback"].endswith("ValueError: the disk is on fire - end\n")
    assert cause["error_file"].endswith(os.path.join("attempt_0", "1", "error.json"))


def test_a_huge_exception_message_keeps_its_type_and_end_within_4096_bytes(
    tmp_path: Path,
) -> None:
    script = write_script(tmp_path, "fire.py", FIRE)
    ppids = tmp_path / "ppids"
    ppids.mkdir()
    status, _, err, message, report = _cli(tmp_path, ["--no-preload"], script, "20000", str(ppids))
    assert status == 1, err
    assert len(message.encode()) <= TERMINATION_LOG_LIMIT
    last = message.splitlines()[-1]
    assert last.startswith("ValueError: the disk is on fire!!!"), message
    assert last.endswith("!!! - end"), message
    assert "deep()" in message  # the traceback's last lines
    cause = report["root_cause"]
    assert cause["message"].endswith("!" * 20000 + " - end")  # the report keeps it whole


@pytest.mark.parametrize("how", ["spawned", "forked"])
def test_a_scripts_own_error_file_is_kept(tmp_path: Path, how: str) -> None:
    script = write_script(tmp_path, "own.py", OWN_ERROR_FILE)
    flags = ["--no-preload"] if how == "spawned" else ["--preload", "json"]
    status, _, err, message, report = _cli(tmp_path, flags, script)
    assert status == 1, err
    assert message.splitlines()[1:] == ["our own stack"], message
    cause = report["root_cause"]
    assert cause["message"] == "QuotaError: the team's quota is spent"
    assert "not this one" not in message


def test_record_keeps_working(tmp_path: Path) -> None:
    script = write_script(tmp_path, "rec.py", RECORDED)
    status, _, err, message, _ = _cli(tmp_path, ["--no-preload"], script)
    assert status == 1, err
    assert message.splitlines()[-1] == "KeyError: 'recorded by the decorator'", message
    assert "in main" in message  # the decorator's traceback: from the function down


def write_own_error_file_then_raise() -> None:
    from aiolaunch._child._error_file import write_error_file

    write_error_file(
        os.environ["TORCHELASTIC_ERROR_FILE"],
        {"message": {"message": "QuotaError: mine", "extraInfo": {"timestamp": "1700000000"}}},
    )
    raise RuntimeError("not this one")


async def test_a_functions_own_error_file_is_kept(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="own",
        entrypoint=write_own_error_file_then_raise,
        args={0: ()},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None
    assert result.failures[0].error_message == "QuotaError: mine"


RAISES_ITS_ATTEMPT = """
import os, sys
marker = sys.argv[1]
first = not os.path.exists(marker)
open(marker, "a").close()
raise ValueError("first incarnation" if first else "second incarnation")
"""


async def test_a_restarted_rank_records_its_own_exception_over_the_last_one(
    tmp_path: Path,
) -> None:
    # A rank restarted in place keeps its error file's path: the file of the
    # incarnation before must not pass for the new one's own record.
    script = write_script(tmp_path, "twice.py", RAISES_ITS_ATTEMPT)
    async with aiolaunch.start_processes(
        name="twice",
        entrypoint=sys.executable,
        args={0: ("-u", "-m", "aiolaunch._child._bootstrap", str(script), str(tmp_path / "m"))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
        restart=RestartPolicy("on-failure", max_restarts=1, backoff=0.01),
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None
    assert result.failures[0].error_message == "ValueError: second incarnation"


OS_EXIT = """
import os, sys
print("the allocator gave up", file=sys.stderr, flush=True)
os._exit(3)
"""


async def test_a_bootstrapped_script_that_raised_nothing_says_so(tmp_path: Path) -> None:
    # "decorate with @record" cannot help a script the bootstrap runs: it
    # records every exception already; this one died without one.
    script = write_script(tmp_path, "exit3.py", textwrap.dedent(OS_EXIT))
    async with aiolaunch.start_processes(
        name="exit3",
        entrypoint=sys.executable,
        args={0: ("-u", "-m", "aiolaunch._child._bootstrap", str(script))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None
    message = result.failures[0].error_message
    assert "exited with code 3 without raising a Python exception" in message
    assert "the allocator gave up" in message
    assert "@aiolaunch.record" not in message
