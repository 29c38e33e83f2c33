"""torch's ``test/distributed/elastic/multiprocessing/errors/error_handler_test.py``, ported.

torch's ``ErrorHandler`` object has no counterpart in aiolaunch: its three
duties are functions there. ``initialize()`` (enable :mod:`faulthandler`) is
what ``@record`` does on each call; ``record_exception(e)`` is
``write_error_file($TORCHELASTIC_ERROR_FILE, e)`` (``_record_exception`` when the
variable may be unset); ``dump_error_file(src)`` is what ``@record`` does with a
``ChildFailedError``: the child's file becomes the reply file. The faulthandler
scenarios run in a fresh interpreter (no mock of ``faulthandler.enable``).

Not ported: ``test_get_error_handler`` (no handler registry in aiolaunch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

from aiolaunch import ChildFailedError, ProcessFailure
from aiolaunch._child._error_file import _record_exception, write_error_file

if TYPE_CHECKING:
    from pathlib import Path

    import pytest

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def raise_exception_fn() -> None:
    raise RuntimeError("foobar")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop(ERROR_FILE_ENV, None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_initialize() -> None:
    proc = _python(
        """
        import faulthandler, aiolaunch
        faulthandler.disable()
        @aiolaunch.record
        def main():
            return faulthandler.is_enabled()
        print(main())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_initialize_error() -> None:
    # faulthandler cannot be enabled (no stderr): warn, and still run the function
    proc = _python(
        """
        import faulthandler, sys, warnings, aiolaunch
        faulthandler.disable()
        out = sys.stdout
        sys.stderr = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            @aiolaunch.record
            def main():
                return "ran"
            result = main()
        print(result, [str(w.message)[:40] for w in caught], file=out)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ran ")
    assert "fault handler" in proc.stdout


def test_record_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    try:
        raise_exception_fn()
    except Exception as e:
        _record_exception(e)
    err = json.loads(error_file.read_text())
    assert err["message"]["message"] is not None
    assert err["message"]["extraInfo"]["py_callstack"] is not None
    assert err["message"]["extraInfo"]["timestamp"] is not None


def test_record_exception_no_error_file(monkeypatch: pytest.MonkeyPatch) -> None:
    # recording must not fail when no error file is named
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    try:
        raise_exception_fn()
    except Exception as e:
        _record_exception(e)


def _child_failed(src: Path) -> ChildFailedError:
    return ChildFailedError(
        "trainer", {0: ProcessFailure(local_rank=0, pid=1, exitcode=0, error_file=str(src))}
    )


def test_dump_error_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src_error_file = tmp_path / "src_error.json"
    test_error_file = tmp_path / "error.json"
    write_error_file(src_error_file, RuntimeError("foobar"))
    monkeypatch.setenv(ERROR_FILE_ENV, str(test_error_file))
    _record_exception(_child_failed(src_error_file))
    # torch compares bytes; the content is what matters (same JSON)
    assert json.loads(src_error_file.read_text()) == json.loads(test_error_file.read_text())
    # with no error file named it only logs
    monkeypatch.delenv(ERROR_FILE_ENV)
    _record_exception(_child_failed(src_error_file))


def test_dump_error_file_overwrite_existing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst_error_file = tmp_path / "dst_error.json"
    src_error_file = tmp_path / "src_error.json"
    write_error_file(dst_error_file, RuntimeError("foo"))
    write_error_file(src_error_file, RuntimeError("bar"))
    monkeypatch.setenv(ERROR_FILE_ENV, str(dst_error_file))
    _record_exception(_child_failed(src_error_file))
    assert json.loads(src_error_file.read_text()) == json.loads(dst_error_file.read_text())
