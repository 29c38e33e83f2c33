"""The public surface: complete, sorted, named by the public path, and light to import."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

import aiolaunch
import aiolaunch.agent


def test_all_is_sorted_and_complete() -> None:
    assert list(aiolaunch.__all__) == sorted(aiolaunch.__all__)
    for name in aiolaunch.__all__:
        assert getattr(aiolaunch, name) is not None, name
    assert set(dir(aiolaunch)) >= set(aiolaunch.__all__)
    assert list(aiolaunch.agent.__all__) == sorted(aiolaunch.agent.__all__)


def test_public_objects_name_the_public_module() -> None:
    for name in aiolaunch.__all__:
        obj = getattr(aiolaunch, name)
        module = getattr(obj, "__module__", None)
        if module is not None and name != "__version__":
            assert module == "aiolaunch", f"{name}.__module__ == {module!r}"


def test_results_pickle_by_their_public_path() -> None:
    failure = aiolaunch.ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file="")
    data = pickle.dumps(aiolaunch.RunProcsResult(failures={0: failure}))
    assert b"aiolaunch\n" in data or b"aiolaunch\x94" in data  # the public module name
    assert b"aiolaunch._results" not in data
    assert pickle.loads(data).failures[0].exitcode == -9


def test_import_is_light_and_never_imports_torch() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); import aiolaunch, aiolaunch.agent; "
        "dt = time.perf_counter() - t; "
        "heavy = [m for m in ('torch', 'asyncio', 'anyio', 'cloudpickle') if m in sys.modules]; "
        "print(heavy, dt)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    heavy, seconds = out.stdout.rsplit(" ", 1)
    assert "torch" not in heavy
    assert float(seconds) > 0  # the import ran; its time is a benchmark row, not a test


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        aiolaunch.no_such_name  # noqa: B018
