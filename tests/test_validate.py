"""Bad input raises before anything starts, naming the argument and the fix."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from aiolaunch import Std

if TYPE_CHECKING:
    from pathlib import Path


def work(x: int) -> int:
    return x


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        found.add(int(entry))
            except OSError:
                pass
    return found


GOOD: dict[str, Any] = {
    "name": "v",
    "entrypoint": work,
    "args": {0: (1,), 1: (2,)},
    "envs": {0: {}, 1: {}},
}

CASES = [
    (ValueError, r"args is empty", {"args": {}, "envs": {}}),
    (
        ValueError,
        r"args must have exactly the local ranks.*missing \[1\]",
        {"args": {0: (1,), 2: (1,)}, "envs": {0: {}, 2: {}}},
    ),
    (ValueError, r"envs must have exactly.*missing \[1\]", {"envs": {0: {}}}),
    (ValueError, r"envs must have exactly.*unexpected \[5\]", {"envs": {0: {}, 1: {}, 5: {}}}),
    (ValueError, r"start_method='thread'.*use 'spawn'", {"start_method": "thread"}),
    (ValueError, r"start_method='bogus'", {"entrypoint": "/bin/true", "start_method": "bogus"}),
    (TypeError, r"entrypoint must be a callable.*or a str.*got int", {"entrypoint": 42}),
    (TypeError, r"envs\[0\] has a non-str key 1", {"envs": {0: {1: "x"}, 1: {}}}),
    (TypeError, r"envs\[1\]\['X'\] is 3.*use str\(3\)", {"envs": {0: {}, 1: {"X": 3}}}),
    (
        TypeError,
        r"args\[1\]\[0\] \(lock\) cannot be pickled",
        {"args": {0: (1,), 1: (threading.Lock(),)}},
    ),
    (
        FileNotFoundError,
        r"'no-such-binary-xyz' was not found on PATH",
        {"entrypoint": "no-such-binary-xyz", "args": {0: ()}, "envs": {0: {}}},
    ),
    (TypeError, r"redirects=.*Std", {"redirects": "all"}),
    (ValueError, r"tee has rank 7", {"tee": {7: Std.ALL}}),
    (ValueError, r"shutdown_timeout=-1", {"shutdown_timeout": -1}),
    (ValueError, r"log_line_prefixes has rank 9", {"log_line_prefixes": {9: "x"}}),
    (ValueError, r"console_dedup=-1 must be a window in seconds", {"console_dedup": -1}),
    (
        ValueError,
        r"either logs_specs or log_dir",
        {"logs_specs": aiolaunch.DefaultLogsSpecs(), "redirects": Std.ALL},
    ),
]


@pytest.mark.parametrize(("exc", "match", "override"), CASES)
def test_bad_input_raises_before_start(
    exc: type[Exception], match: str, override: dict[str, Any]
) -> None:
    before = _children()
    with pytest.raises(exc, match=match):
        aiolaunch.start_processes(**{**GOOD, **override})
    assert _children() == before


def test_unpicklable_entrypoint_has_cause() -> None:
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"entrypoint .* cannot be pickled") as info:
        aiolaunch.start_processes(**{**GOOD, "entrypoint": lambda x: (lock, x)})
    assert info.value.__cause__ is not None


def test_log_dir_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        aiolaunch.start_processes(**GOOD, log_dir=str(f))


def test_log_dir_not_empty(tmp_path: Path) -> None:
    (tmp_path / "old.log").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        aiolaunch.start_processes(**GOOD, log_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.log"]


async def test_missing_log_dir_is_created(tmp_path: Path) -> None:
    log_dir = tmp_path / "a" / "b"
    starting = aiolaunch.start_processes(**GOOD, log_dir=str(log_dir), redirects=Std.ALL)
    assert not log_dir.exists(), "nothing is created before the call is awaited"
    async with starting as ctx:
        result = await ctx.wait()
    assert result is not None and result.return_values == {0: 1, 1: 2}
    assert (log_dir / "0" / "stdout.log").exists()
