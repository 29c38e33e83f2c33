"""The exceptions: messages from fields, pickling, ChildFailedError's summary."""

from __future__ import annotations

import json
import pickle
import signal
from typing import TYPE_CHECKING

import pytest

from aiolaunch import (
    ChildFailedError,
    MainProcessError,
    ProcessFailure,
    SignalException,
    WorkerError,
)

if TYPE_CHECKING:
    from pathlib import Path


def _failure(tmp_path: Path, rank: int, timestamp: int, exitcode: int = 1) -> ProcessFailure:
    path = tmp_path / f"{rank}" / "error.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    callstack = f"Traceback (most recent call last):\n  line 1\nValueError: rank {rank}\n"
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": f"ValueError: rank {rank}",
                    "extraInfo": {"py_callstack": callstack, "timestamp": str(timestamp)},
                }
            }
        )
    )
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_signal_exception_fields_and_str() -> None:
    exc = SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
    assert str(exc) == "Process 1 got signal: 15"
    assert exc.sigval is signal.SIGTERM
    assert SignalException("m", 2).sigval is signal.SIGINT  # an int is converted


def test_worker_error() -> None:
    exc = WorkerError(exitcode=3, worker_id=1)
    assert str(exc) == "worker[1] failed with exitcode=3"
    assert (exc.exitcode, exc.worker_id) == (3, 1)


@pytest.mark.parametrize(
    ("sig", "text"),
    [
        (signal.SIGTERM, "SIGTERM received, exiting due to Terminated."),
        (signal.SIGINT, "SIGINT received, exiting due to Interrupt."),
        (int(signal.SIGHUP), "SIGHUP received, exiting due to Hangup."),
        (1000, "signal 1000 received, exiting due to unknown signal."),
    ],
)
def test_main_process_error(sig: int, text: str) -> None:
    exc = MainProcessError(sig)
    assert str(exc) == text
    assert exc.signal_no == sig


def test_child_failed_error_needs_failures() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        ChildFailedError("trainer", {})


def test_root_cause_is_the_earliest_failure(tmp_path: Path) -> None:
    failures = {
        0: _failure(tmp_path, 0, timestamp=300),
        1: _failure(tmp_path, 1, timestamp=100),
        2: _failure(tmp_path, 2, timestamp=200),
    }
    exc = ChildFailedError("trainer", failures)
    rank, failure = exc.get_first_failure()
    assert rank == 1
    assert failure is failures[1]


def test_root_cause_tie_goes_to_lowest_rank(tmp_path: Path) -> None:
    # Observed order (dict order) 2 then 0: the tie still goes to rank 0, the
    # rule launch() and the agent use too.
    failures = {2: _failure(tmp_path, 2, 50), 0: _failure(tmp_path, 0, 50)}
    assert ChildFailedError("t", failures).get_first_failure()[0] == 0


def test_format_msg_shape(tmp_path: Path) -> None:
    failures = {
        0: _failure(tmp_path, 0, timestamp=300),
        1: _failure(tmp_path, 1, timestamp=100),
        3: ProcessFailure(local_rank=3, pid=77, exitcode=-9, error_file=""),
    }
    exc = ChildFailedError("trainer", failures)
    text = str(exc)
    assert text == exc.format_msg()
    lines = text.split("\n")
    assert lines[0] == ""
    assert lines[1] == "=" * 60  # width capped at 60, like torch
    assert lines[2] == "trainer FAILED"
    assert lines[3] == "-" * 60
    assert lines[4] == "Failures:"
    assert lines[-1] == "=" * 60
    failures_part, root_part = text.split("Root Cause (first observed failure):\n")
    # the root cause (rank 1, earliest) only in its section, the others above
    assert "rank      : 1 (local_rank: 1)" in root_part
    assert "rank      : 1 (local_rank: 1)" not in failures_part
    assert "[0]:\n" in failures_part
    assert "[2]:\n" in failures_part
    assert root_part.startswith("[1]:\n")
    assert "exitcode  : -9 (pid: 77) (SIGKILL)" in failures_part
    assert "traceback : Signal 9 (SIGKILL) received by PID 77" in failures_part
    # the traceback is shown, indented under its field
    assert "traceback : Traceback (most recent call last):\n    line 1\n  ValueError: rank 1" in (
        root_part
    )
    assert f"error_file: {failures[1].error_file}" in root_part
    assert "exitcode  : 1 (pid: 1001)\n" in root_part  # no signal name for exit codes


def test_format_msg_single_failure_and_delims(tmp_path: Path) -> None:
    exc = ChildFailedError("t", {0: ProcessFailure(0, 5, 2, "")})
    text = exc.format_msg(boarder_delim="#", section_delim="~")
    assert "  <NO_OTHER_FAILURES>" in text
    assert set(text.split("\n")[1]) == {"#"}
    assert set(text.split("\n")[3]) == {"~"}


def test_format_msg_shape_matches_torch(tmp_path: Path) -> None:
    errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    f0, f1 = _failure(tmp_path, 0, 200), _failure(tmp_path, 1, 100)
    ours = ChildFailedError("trainer", {0: f0, 1: f1}).format_msg()
    theirs = errors.ChildFailedError(
        "trainer",
        {
            r: errors.ProcessFailure(f.local_rank, f.pid, f.exitcode, f.error_file)
            for r, f in ((0, f0), (1, f1))
        },
    ).format_msg()

    def skeleton(text: str) -> list[str]:
        # field names and structure, without values and trailing blank lines
        return [line.split(":")[0].rstrip() for line in text.split("\n") if line.strip()]

    assert skeleton(ours) == skeleton(theirs)


@pytest.mark.parametrize(
    "exc",
    [
        SignalException("got SIGTERM", signal.SIGTERM),
        WorkerError(exitcode=-9, worker_id=4),
        MainProcessError(signal.SIGINT),
        MainProcessError(15),
    ],
    ids=lambda e: type(e).__name__,
)
def test_exceptions_pickle(exc: Exception) -> None:
    clone = pickle.loads(pickle.dumps(exc))
    assert type(clone) is type(exc)
    assert str(clone) == str(exc)
    assert clone.args == exc.args
    assert vars(clone) == vars(exc)


def test_child_failed_error_pickles(tmp_path: Path) -> None:
    exc = ChildFailedError("trainer", {0: _failure(tmp_path, 0, 10), 1: _failure(tmp_path, 1, 5)})
    clone = pickle.loads(pickle.dumps(exc))
    assert type(clone) is ChildFailedError
    assert clone.name == "trainer"
    assert clone.failures == exc.failures
    assert str(clone) == str(exc)
    assert clone.get_first_failure()[0] == 1


def test_exceptions_are_plain_exceptions() -> None:
    for cls in (SignalException, ChildFailedError, WorkerError, MainProcessError):
        assert issubclass(cls, Exception)
        assert cls.__module__ == "aiolaunch"  # public path in tracebacks and pickles
