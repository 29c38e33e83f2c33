"""Two ranks failing together are two failures (issue #46.9).

A rank that fails on its own while the stop of another rank's failure is on
its way (its exception recorded, its teardown under way when the death
signal reaches it) is a failure of its own, not "stopped by aiolaunch":
torchrun lists both.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest

import aiolaunch
from _helpers import driver
from aiolaunch import Std

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

# Both ranks fail the same assertion. Rank 1's teardown is long (torch's can
# take seconds): the stop reaches it there. Rank 0 exits once rank 1 has
# recorded its exception, so the two failures always overlap.
BOTH_FAIL = textwrap.dedent(
    """
    import atexit, os, time

    def teardown():
        if os.environ["LOCAL_RANK"] == "0":
            other = os.path.join(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"]),
                                 "..", "1", "error.json")
            while not os.path.exists(other):
                time.sleep(0.01)
        else:
            time.sleep(60)

    atexit.register(teardown)
    assert os.environ["LOCAL_RANK"] == "no such rank", "the loss is nan"
    """
)


def test_two_ranks_failing_together_are_both_failures(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(BOTH_FAIL)
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2", "--log-dir", str(logs),
            str(script)]  # fmt: skip
    with driver(argv) as proc:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "<NO_OTHER_FAILURES>" not in err, err
    assert err.count("AssertionError: the loss is nan") >= 2
    (report,) = logs.glob("*/attempt_0/report.json")
    data = json.loads(report.read_text())
    assert data["failed"] == [0, 1] and data["stopped_by_aiolaunch"] == [], data


async def test_function_workers_failing_together_are_both_failures(tmp_path: Path) -> None:
    # A function worker records its exception on its way out, then finalizes:
    # rank 1 is in its teardown (an atexit callback) when the stop comes.
    release = tmp_path / "release"
    async with aiolaunch.start_processes(
        name="two",
        entrypoint=_two_functions,
        args={0: (str(release),), 1: (str(release),)},
        envs={0: {"RANK": "0"}, 1: {"RANK": "1"}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None
    assert sorted(result.failures) == [0, 1], result.failures
    assert result.failures[1].error_message == "RuntimeError: rank 1 diverged"
    assert result.failures[0].error_message == "RuntimeError: rank 0 diverged"


def _two_functions(release: str) -> None:
    import atexit
    import time

    rank = os.environ["RANK"]
    if rank == "0":

        def wait_for_rank_one() -> None:
            while not os.path.exists(release):
                time.sleep(0.01)

        atexit.register(wait_for_rank_one)
    else:

        def recorded_then_slow() -> None:
            open(release, "w").close()  # recorded by now: rank 0 may exit
            time.sleep(60)

        atexit.register(recorded_then_slow)
    raise RuntimeError(f"rank {rank} diverged")
