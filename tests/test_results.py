"""ProcessFailure and RunProcsResult: torch's constructor and derived fields, pickling."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import time
from typing import TYPE_CHECKING

import pytest

from _programs import SLEEP_FOREVER, python
from aiolaunch import ProcessFailure, RunProcsResult

if TYPE_CHECKING:
    from pathlib import Path


def _torch_format(path: Path, message: str, timestamp: int, callstack: str = "tb") -> str:
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": callstack, "timestamp": str(timestamp)},
        }
    }
    path.write_text(json.dumps(data))
    return str(path)


def test_no_error_file_and_exit_code() -> None:
    before = time.time()
    failure = ProcessFailure(local_rank=2, pid=4242, exitcode=1, error_file="")
    assert (failure.local_rank, failure.pid, failure.exitcode) == (2, 4242, 1)
    assert failure.error_file == "<N/A>"  # torch's placeholder
    assert before <= failure.timestamp <= time.time()  # sub-second, not whole seconds
    assert isinstance(failure.message, str)
    assert "@aiolaunch.record" in failure.message
    assert failure.error_file_data["errorTraits"] == {
        "category": "system_terminated_error",
        "retryability": "False",
    }
    assert failure.signal_name() == "<N/A>"
    assert failure.error_message == failure.message
    assert failure.py_callstack is None


def test_missing_error_file_path_is_treated_as_none(tmp_path: Path) -> None:
    failure = ProcessFailure(0, 1, 1, str(tmp_path / "nope.json"))
    assert failure.error_file == "<N/A>"
    assert failure.error_file_data["message"] == "<NONE>"


def test_error_file_data_is_not_shared_between_failures() -> None:
    # torch mutates one module-level dict; ours are independent.
    a = ProcessFailure(0, 1, 1, "")
    b = ProcessFailure(1, 2, -9, "")
    a.error_file_data["x"] = 1
    assert "x" not in b.error_file_data
    assert "errorTraits" not in b.error_file_data


def test_killed_by_a_real_signal_names_it() -> None:
    proc = subprocess.Popen(python(SLEEP_FOREVER))
    proc.kill()
    assert proc.wait(timeout=5) == -signal.SIGKILL
    failure = ProcessFailure(0, proc.pid, proc.returncode, "")
    assert failure.exitcode == -9
    assert failure.signal_name() == "SIGKILL"
    assert failure.message == f"Signal 9 (SIGKILL) received by PID {proc.pid}"
    assert "errorTraits" not in failure.error_file_data


def test_unknown_signal_number() -> None:
    failure = ProcessFailure(0, 7, -1000, "")
    assert failure.signal_name() == "<N/A>"
    assert failure.message == "Signal 1000 (<N/A>) received by PID 7"


def test_reads_torch_format_error_file(tmp_path: Path) -> None:
    path = _torch_format(tmp_path / "error.json", "ValueError: boom", 1_700_000_000, "Traceback\n")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=path)
    assert failure.error_file == path
    assert failure.timestamp == 1_700_000_000
    assert failure.message == {
        "message": "ValueError: boom",
        "extraInfo": {"py_callstack": "Traceback\n", "timestamp": "1700000000"},
    }
    assert failure.error_file_data == {"message": failure.message}
    assert failure.error_message == "ValueError: boom"
    assert failure.py_callstack == "Traceback\n"
    assert failure.timestamp_isoformat().startswith("2023-11-1")


def test_reads_old_string_format(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "it broke", "timestamp": "1234"}))
    failure = ProcessFailure(0, 1, 1, str(path))
    assert failure.message == "it broke"
    assert failure.timestamp == 1234
    assert failure.error_message == "it broke"
    assert failure.py_callstack is None


def test_error_file_message_wins_over_signal(tmp_path: Path) -> None:
    path = _torch_format(tmp_path / "e.json", "RuntimeError: x", 5)
    failure = ProcessFailure(0, 1, -15, path)
    assert failure.error_message == "RuntimeError: x"
    assert failure.signal_name() == "SIGTERM"


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        '{"no_message": 1}',
        '{"message": {"extraInfo": {}}}',
        '{"message": 3}',
    ],
)
def test_malformed_error_file_does_not_raise(tmp_path: Path, content: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(content)
    os.utime(path, (1_600_000_000, 1_600_000_000))
    failure = ProcessFailure(0, 1, 1, str(path))
    assert isinstance(failure.message, str)
    assert failure.message.startswith(f"<unreadable error file {path}:")
    assert failure.timestamp == 1_600_000_000  # the file's mtime
    assert failure.error_file == str(path)


def test_pickle_round_trip_keeps_derived_fields(tmp_path: Path) -> None:
    path = _torch_format(tmp_path / "error.json", "KeyError: 'k'", 99)
    failure = ProcessFailure(3, 10, 1, path)
    os.unlink(path)  # unpickling must not read the file again
    clone = pickle.loads(pickle.dumps(failure))
    assert clone == failure
    assert clone.message == failure.message
    assert clone.timestamp == 99


def test_run_procs_result_defaults_and_is_failed() -> None:
    ok = RunProcsResult()
    assert (ok.return_values, ok.failures, ok.stdouts, ok.stderrs) == ({}, {}, {}, {})
    assert not ok.is_failed()
    ok.return_values[0] = 1
    assert RunProcsResult().return_values == {}  # no shared default
    failed = RunProcsResult(failures={1: ProcessFailure(1, 2, 1, "")})
    assert failed.is_failed()


def test_run_procs_result_pickles() -> None:
    result = RunProcsResult(
        return_values={0: {"a": [1, 2]}, 1: None},
        failures={2: ProcessFailure(2, 5, -9, "")},
        stdouts={0: "/tmp/0/stdout.log", 1: ""},
        stderrs={0: "", 1: "/tmp/1/stderr.log"},
    )
    clone = pickle.loads(pickle.dumps(result))
    assert clone == result
    assert clone.is_failed()


def test_matches_torch_for_the_same_error_file(tmp_path: Path) -> None:
    errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    path = _torch_format(tmp_path / "error.json", "ValueError: v", 1_700_000_123, "tb\n")
    theirs = errors.ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file=path)
    ours = ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file=path)
    assert ours.message == theirs.message
    assert ours.timestamp == theirs.timestamp
    assert ours.error_file_data == theirs.error_file_data
    assert ours.error_file == theirs.error_file


def test_matches_torch_for_a_signal() -> None:
    errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    theirs = errors.ProcessFailure(local_rank=0, pid=77, exitcode=-15, error_file="")
    ours = ProcessFailure(local_rank=0, pid=77, exitcode=-15, error_file="")
    assert ours.message == theirs.message
    assert ours.signal_name() == theirs.signal_name() == "SIGTERM"
    assert ours.error_file == theirs.error_file == "<N/A>"
