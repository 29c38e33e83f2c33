"""Error files: format, atomic write, the record decorator, torch compatibility both ways."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest

from _programs import write_script
from aiolaunch import ChildFailedError, ProcessFailure, record
from aiolaunch._child._error_file import (
    ERROR_FILE_ENV,
    error_data_from_exception,
    read_error_file,
    write_error_file,
)

if TYPE_CHECKING:
    from pathlib import Path


def _raise_value_error() -> None:
    raise ValueError("boom")


def _caught(fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except BaseException as exc:
        return exc
    raise AssertionError("did not raise")


# -- format, write, read -------------------------------------------------------


def test_error_data_format() -> None:
    before = int(time.time())
    data = error_data_from_exception(_caught(_raise_value_error))
    assert set(data) == {"message"}
    assert data["message"]["message"] == "ValueError: boom"
    extra = data["message"]["extraInfo"]
    assert set(extra) == {"py_callstack", "timestamp"}
    assert isinstance(extra["timestamp"], str)
    assert before <= int(extra["timestamp"]) <= int(time.time())  # torch parses it with int()
    assert extra["py_callstack"].startswith("Traceback (most recent call last):")
    assert "in _raise_value_error" in extra["py_callstack"]
    assert extra["py_callstack"].endswith("ValueError: boom\n")


def test_error_data_includes_chained_cause() -> None:
    def chained() -> None:
        try:
            _raise_value_error()
        except ValueError as exc:
            raise RuntimeError("wrapped") from exc

    data = error_data_from_exception(_caught(chained))
    assert data["message"]["message"] == "RuntimeError: wrapped"
    callstack = data["message"]["extraInfo"]["py_callstack"]
    assert "ValueError: boom" in callstack
    assert "direct cause" in callstack


def test_write_read_round_trip_creates_parent(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "error.json"
    write_error_file(path, _caught(_raise_value_error))
    data = read_error_file(path)
    assert data is not None
    assert data["message"]["message"] == "ValueError: boom"
    assert json.loads(path.read_text()) == data
    assert os.listdir(path.parent) == ["error.json"]  # no temporary file left


def test_write_accepts_data_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    write_error_file(str(path), {"message": "first", "timestamp": "1"})
    write_error_file(str(path), {"message": "second", "timestamp": "2"})
    assert read_error_file(str(path)) == {"message": "second", "timestamp": "2"}
    assert os.listdir(tmp_path) == ["error.json"]


def test_write_rejects_bad_input_and_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    with pytest.raises(TypeError, match="an exception or a dict"):
        write_error_file(path, "not an error")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        write_error_file(path, {"message": object()})
    assert os.listdir(tmp_path) == []


def test_write_into_unwritable_place_raises_oserror(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        write_error_file(blocker / "error.json", {"message": "x"})
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.parametrize("content", ["{broken", "[1, 2]", ""])
def test_read_invalid_returns_none(tmp_path: Path, content: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(content)
    assert read_error_file(path) is None


def test_read_missing_returns_none(tmp_path: Path) -> None:
    assert read_error_file(tmp_path / "missing.json") is None


# -- record -------------------------------------------------------------------


@pytest.fixture
def error_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "rank0" / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    return path


def test_record_sync_writes_and_reraises(error_file: Path) -> None:
    @record
    def main(x: int) -> int:
        if x:
            raise KeyError("missing")
        return 7

    assert main(0) == 7
    assert not error_file.exists()
    with pytest.raises(KeyError, match="missing"):
        main(1)
    failure = ProcessFailure(0, os.getpid(), 1, str(error_file))
    assert failure.error_message == "KeyError: 'missing'"
    assert failure.py_callstack is not None
    assert "in main" in failure.py_callstack


async def test_record_async_writes_and_reraises(error_file: Path) -> None:
    @record
    async def main(x: int) -> int:
        await asyncio.sleep(0)
        if x:
            raise ValueError("async boom")
        return x + 1

    assert inspect.iscoroutinefunction(main)
    assert await main(0) == 1
    assert not error_file.exists()
    with pytest.raises(ValueError, match="async boom"):
        await main(1)
    data = read_error_file(error_file)
    assert data is not None
    assert data["message"]["message"] == "ValueError: async boom"
    assert "in main" in data["message"]["extraInfo"]["py_callstack"]


def test_record_keeps_metadata() -> None:
    def main(a: int, b: str = "x") -> str:
        """Doc."""
        return b * a

    wrapped = record(main)
    assert wrapped.__name__ == "main"
    assert wrapped.__doc__ == "Doc."
    assert wrapped.__wrapped__ is main  # type: ignore[attr-defined]
    assert inspect.signature(wrapped) == inspect.signature(main)
    assert wrapped(2, b="y") == "yy"


def test_record_system_exit(error_file: Path) -> None:
    @record
    def main(code: int | None) -> None:
        raise SystemExit(code)

    assert main(0) is None  # torch's behaviour: exit code 0 returns
    with pytest.raises(SystemExit) as info:
        main(3)
    assert info.value.code == 3
    with pytest.raises(SystemExit):
        main(None)
    assert not error_file.exists()


async def test_record_does_not_record_cancellation_or_interrupt(error_file: Path) -> None:
    @record
    async def cancelled() -> None:
        raise asyncio.CancelledError

    @record
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(asyncio.CancelledError):
        await cancelled()
    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert not error_file.exists()


def test_record_without_env_logs_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="aiolaunch"), pytest.raises(ValueError, match="boom"):
        record(_raise_value_error)()
    assert any("not recording ValueError: boom" in r.getMessage() for r in caplog.records)
    assert os.listdir(tmp_path) == []


def test_record_survives_unwritable_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(ERROR_FILE_ENV, str(blocker / "error.json"))
    with (
        caplog.at_level(logging.WARNING, logger="aiolaunch"),
        pytest.raises(ValueError, match="boom"),  # the original error, not the OSError
    ):
        record(_raise_value_error)()
    assert any("failed to write error file" in r.getMessage() for r in caplog.records)


def test_record_child_failed_error_passes_root_cause_up(tmp_path: Path, error_file: Path) -> None:
    child_file = tmp_path / "child" / "error.json"
    write_error_file(child_file, _caught(_raise_value_error))
    failure = ProcessFailure(local_rank=1, pid=99, exitcode=3, error_file=str(child_file))

    @record
    def agent() -> None:
        raise ChildFailedError("trainer", {1: failure})

    with pytest.raises(ChildFailedError):
        agent()
    data = read_error_file(error_file)
    assert data is not None
    assert data["message"]["message"] == "ValueError: boom"  # the child's error, not ours
    assert data["message"]["errorCode"] == 3


def test_record_child_failed_error_without_child_file(error_file: Path) -> None:
    @record
    def agent() -> None:
        raise ChildFailedError("trainer", {0: ProcessFailure(0, 5, -9, "")})

    with pytest.raises(ChildFailedError):
        agent()
    data = read_error_file(error_file)
    assert data is not None
    assert data["message"]["message"].startswith("ChildFailedError: \n")


# -- real processes and torch compatibility -------------------------------------

SCRIPT = """\
import asyncio, sys
from aiolaunch import record

def inner():
    raise ZeroDivisionError("in the worker")

@record
def main():
    inner()

@record
async def amain():
    await asyncio.sleep(0)
    inner()

if sys.argv[1] == "sync":
    main()
else:
    asyncio.run(amain())
"""


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_subprocess_with_record_writes_error_file(tmp_path: Path, kind: str) -> None:
    script = write_script(tmp_path, "worker.py", SCRIPT)
    error_file = tmp_path / "logs" / "0" / "error.json"
    env = {**os.environ, ERROR_FILE_ENV: str(error_file)}
    proc = subprocess.run(
        [sys.executable, str(script), kind], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "ZeroDivisionError: in the worker" in proc.stderr  # still raised and printed
    failure = ProcessFailure(0, 1234, proc.returncode, str(error_file))
    assert failure.error_message == "ZeroDivisionError: in the worker"
    assert failure.py_callstack is not None
    assert "in inner" in failure.py_callstack
    assert abs(failure.timestamp - time.time()) < 120


def test_torch_reads_our_error_file(tmp_path: Path) -> None:
    errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    path = tmp_path / "error.json"
    write_error_file(path, _caught(_raise_value_error))
    theirs = errors.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    ours = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert theirs.message["message"] == "ValueError: boom"
    assert "in _raise_value_error" in theirs.message["extraInfo"]["py_callstack"]
    assert theirs.timestamp == ours.timestamp
    assert theirs.message == ours.message
    summary = errors.ChildFailedError("trainer", {0: theirs}).format_msg()
    assert "ValueError: boom" in summary


TORCH_SCRIPT = """\
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    raise LookupError("torch side")

main()
"""


def test_we_read_torch_record_error_file(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = write_script(tmp_path, "torch_worker.py", TORCH_SCRIPT)
    error_file = tmp_path / "error.json"
    env = {**os.environ, ERROR_FILE_ENV: str(error_file)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    failure = ProcessFailure(0, 1, 1, str(error_file))
    assert failure.error_message == "LookupError: torch side"
    assert failure.py_callstack is not None
    assert "in main" in failure.py_callstack
    assert abs(failure.timestamp - time.time()) < 300
    assert read_error_file(error_file) == failure.error_file_data
    assert "LookupError: torch side" in str(ChildFailedError("w", {0: failure}))


def test_record_passes_torch_child_failed_error_up(tmp_path: Path, error_file: Path) -> None:
    errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    child_file = tmp_path / "child.json"
    write_error_file(child_file, _caught(_raise_value_error))
    failure = errors.ProcessFailure(local_rank=0, pid=9, exitcode=2, error_file=str(child_file))

    @record
    def agent() -> None:
        raise errors.ChildFailedError("trainer", {0: failure})

    with pytest.raises(errors.ChildFailedError):
        agent()
    data = read_error_file(error_file)
    assert data is not None
    assert data["message"]["message"] == "ValueError: boom"
    assert data["message"]["errorCode"] == 2


_NO_STDERR = """
import asyncio, sys, warnings
warnings.simplefilter("always")
sys.stderr = None  # pythonw, some services and notebooks: faulthandler cannot enable
import faulthandler
assert not faulthandler.is_enabled()
from aiolaunch import record

@record
def main(x):
    print("sync ran", x, flush=True)
    return x + 1

@record
async def amain(x):
    print("async ran", x, flush=True)
    return x + 2

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print("results", main(1), asyncio.run(amain(1)), flush=True)
for w in caught:
    print("warning", w.category.__name__, str(w.message), flush=True)
"""


def test_record_runs_the_function_when_faulthandler_cannot_be_enabled(tmp_path: Path) -> None:
    # torch's record warns and runs the function; the decorated main must not
    # be skipped because sys.stderr is None.
    script = tmp_path / "no_stderr.py"
    script.write_text(_NO_STDERR)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["sync ran 1", "async ran 1", "results 2 3"], done.stdout
    warned = [line for line in lines if line.startswith("warning ")]
    assert len(warned) == 2
    assert all(
        line.startswith("warning RuntimeWarning Unable to enable fault handler. RuntimeError:")
        for line in warned
    ), warned
