"""The root cause: one rule (earliest timestamp, ties to the lowest rank) for all.

``ChildFailedError``, ``launch()`` and the agent all pick it with
``aiolaunch._results.root_cause``; failures the supervisor observed (no error
file) are timestamped when the exit was detected, to the sub-second.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import pytest

import aiolaunch
from aiolaunch import ChildFailedError, ProcessFailure, Std
from aiolaunch._results import root_cause

if TYPE_CHECKING:
    from pathlib import Path


def _failed(rank: int, timestamp: float) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=-9, error_file="")
    failure.timestamp = timestamp
    return failure


def test_earliest_wins_within_the_same_second() -> None:
    failures = {0: _failed(0, 1000.7), 1: _failed(1, 1000.2), 2: _failed(2, 1000.5)}
    assert root_cause(failures)[0] == 1
    assert ChildFailedError("t", failures).get_first_failure()[0] == 1


@pytest.mark.parametrize("order", [[3, 1, 2], [2, 3, 1], [1, 2, 3]])
def test_ties_go_to_the_lowest_rank_whatever_the_order(order: list[int]) -> None:
    failures = {r: _failed(r, 50.0) for r in order}
    rank, failure = root_cause(failures)
    assert rank == 1
    assert failure is failures[1]
    assert ChildFailedError("t", failures).get_first_failure() == (1, failures[1])


def test_no_failures_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        root_cause({})


def test_failures_built_in_sequence_order_by_creation_to_the_sub_second() -> None:
    # Both without an error file, both within the same second: the one
    # observed first is the root cause even though its rank is higher.
    later_rank_first = ProcessFailure(local_rank=5, pid=1, exitcode=-9, error_file="")
    time.sleep(0.002)  # allowed: guarantees two distinct clock readings
    lower_rank_after = ProcessFailure(local_rank=0, pid=2, exitcode=-9, error_file="")
    assert later_rank_first.timestamp < lower_rank_after.timestamp
    assert root_cause({0: lower_rank_after, 5: later_rank_first})[0] == 5


async def test_a_failure_is_timestamped_when_its_exit_was_detected(tmp_path: Path) -> None:
    """Not when the result is built: a peer that ignores SIGTERM delays that by the grace."""
    t0 = time.time()
    ready = tmp_path / "trapped"
    async with aiolaunch.start_processes(
        name="ts",
        entrypoint="/bin/sh",
        args={
            # Fails once rank 1 ignores SIGTERM (a handshake: rank 0 exiting
            # first would stop rank 1 before its trap).
            0: ("-c", f"while [ ! -e '{ready}' ]; do sleep 0.01; done; exit 3"),
            # Outlives the fail-fast SIGTERM; SIGKILLed after the 1 s grace.
            1: ("-c", f"trap '' TERM; : > '{ready}'; while :; do sleep 0.1; done"),
        },
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
        shutdown_timeout=1.0,
    ) as ctx:
        result = await ctx.wait(timeout=60)
    t_end = time.time()
    assert result is not None and set(result.failures) == {0}
    failure = result.failures[0]
    assert failure.error_file == "<N/A>"
    assert t0 <= failure.timestamp <= t_end - 0.9, (t0, failure.timestamp, t_end)
    assert root_cause(result.failures) == (0, failure)


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("POSIX shell workers")
