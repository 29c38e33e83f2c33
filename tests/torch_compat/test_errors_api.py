"""torch's ``test/distributed/elastic/multiprocessing/errors/api_test.py``, ported.

``ErrorHandler().record_exception(e)`` (torch's internal writer) becomes
aiolaunch's ``write_error_file(path, e)``; ``mock.patch.dict(os.environ, ...)``
becomes ``monkeypatch``. Assertions are torch's; deliberate differences are
marked and listed in docs/migration.md.
"""

from __future__ import annotations

import json
import signal
from typing import TYPE_CHECKING

import pytest

from aiolaunch import ChildFailedError, ProcessFailure, record
from aiolaunch._child._error_file import write_error_file

if TYPE_CHECKING:
    from pathlib import Path

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


class SentinelError(Exception):
    """Raised so that the test can check that the right error propagates."""


@record
def raise_exception_fn() -> None:
    raise SentinelError("foobar")


@record
def raise_system_exit_exception_fn(exit_code: int = 1) -> None:
    exp = SystemExit()
    exp.code = exit_code
    raise exp


@record
def good_fn() -> None:
    print("hello world")


@record
def raise_child_failure_error_fn(name: str, child_error_file: str = "") -> None:
    if child_error_file:
        write_error_file(child_error_file, SentinelError("foobar"))
    pf = ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=child_error_file)
    raise ChildFailedError(name, {0: pf})


@pytest.fixture
def error_file(tmp_path: Path) -> Path:
    return tmp_path / "error.json"


def failure_with_error_file(path: Path, exception: BaseException) -> ProcessFailure:
    write_error_file(path, exception)
    return ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=str(path))


def failure_without_error_file(exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=0, pid=997, exitcode=exitcode, error_file="ignored.json")


def test_failure_incorrect_reply_file(error_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    error_file.write_text(json.dumps({"unknown_key": "unknown_value"}))
    # differs on purpose: torch raises (and so fails the whole supervisor on
    # one worker's malformed file); aiolaunch logs it and reports the failure
    pf = ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=str(error_file))
    assert pf.exitcode == 1
    assert "failed to parse error file" in caplog.text


def test_process_failure_new_format(error_file: Path) -> None:
    error_file.write_text(json.dumps({"message": "test error message", "timestamp": 10}))
    pf = ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=str(error_file))
    assert pf.message == "test error message"
    assert pf.timestamp == 10


def test_process_mast_error_format(error_file: Path) -> None:
    error_file.write_text(json.dumps({"message": "test error message", "timestamp": "10"}))
    pf = ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=str(error_file))
    assert pf.message == "test error message"
    assert pf.timestamp == 10


def test_process_failure(error_file: Path) -> None:
    pf = failure_with_error_file(error_file, SentinelError("foobar"))
    assert pf.local_rank == 0
    assert pf.pid == 997
    assert pf.exitcode == 1
    assert pf.error_file == str(error_file)
    assert pf.error_file_data["message"]["extraInfo"]["timestamp"] == str(pf.timestamp)
    assert pf.message
    assert pf.signal_name() == "<N/A>"


def test_process_failure_signal() -> None:
    pf = failure_without_error_file(exitcode=-signal.SIGSEGV)
    assert pf.signal_name() == "SIGSEGV"
    assert pf.message == f"Signal {signal.SIGSEGV} (SIGSEGV) received by PID {pf.pid}"


def test_process_failure_no_error_file() -> None:
    pf = failure_without_error_file(exitcode=138)
    assert pf.signal_name() == "<N/A>"
    assert pf.error_file == "<N/A>"
    # differs on purpose: aiolaunch's hint names its own decorator (torch:
    # "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    assert pf.message == "To enable traceback, decorate the entrypoint with @aiolaunch.record"


def test_child_failed_error(tmp_path: Path) -> None:
    pf0 = failure_with_error_file(tmp_path / "e0.json", SentinelError("rank 0"))
    pf1 = failure_with_error_file(tmp_path / "e1.json", SentinelError("rank 1"))
    pf2 = failure_without_error_file(exitcode=138)
    ex = ChildFailedError("trainer.par", {0: pf0, 1: pf1, 2: pf2})
    assert ex.get_first_failure()[1] == pf0
    # torch only prints it; check what the print shows
    text = str(ex)
    assert "trainer.par FAILED" in text
    assert "SentinelError: rank 0" in text and "SentinelError: rank 1" in text
    assert "exitcode  : 138" in text


def test_record(error_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    with pytest.raises(SentinelError):
        raise_exception_fn()
    err = json.loads(error_file.read_text())
    assert err["message"]["message"] is not None
    assert err["message"]["extraInfo"]["py_callstack"] is not None
    assert err["message"]["extraInfo"]["timestamp"] is not None


def test_record_system_exit(error_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    raise_system_exit_exception_fn(exit_code=0)
    assert not error_file.is_file()


def test_record_system_exit_error(error_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    with pytest.raises(SystemExit):
        raise_system_exit_exception_fn()
    assert not error_file.is_file()


def test_record_no_error_file(error_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    with pytest.raises(SentinelError):
        raise_exception_fn()
    assert not error_file.is_file()


def test_record_good_fn(error_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    good_fn()
    assert not error_file.is_file()


def test_record_child_failure(
    tmp_path: Path, error_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer_log_dir = tmp_path / "trainer" / "0"
    trainer_log_dir.mkdir(parents=True)
    trainer_error_file = trainer_log_dir / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    with pytest.raises(ChildFailedError) as cm:
        raise_child_failure_error_fn("trainer", str(trainer_error_file))
    pf = cm.value.get_first_failure()[1]
    # the worker's error file, with the exit code added, is the reply file
    expect = json.loads(trainer_error_file.read_text())
    expect["message"]["errorCode"] = pf.exitcode
    actual = json.loads(error_file.read_text())
    assert json.dumps(expect, sort_keys=True) == json.dumps(actual, sort_keys=True)


def test_record_child_failure_no_child_error_file(
    error_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    with pytest.raises(ChildFailedError):
        raise_child_failure_error_fn("trainer")
    # differs on purpose: torch records nothing when the child left no error
    # file; aiolaunch records the ChildFailedError itself, so the job's
    # summary names the failure instead of "<N/A>"
    data = json.loads(error_file.read_text())
    assert data["message"]["message"].startswith("ChildFailedError")
