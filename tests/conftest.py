"""The suite's own leak check is aiolaunch's public pytest plugin (``aiolaunch.testing``).

Every test - sync or async, pytest-asyncio or anyio - fails if it leaves a
descendant process, a zombie, an open fd or a changed signal handler behind.
Opt out per test with ``@pytest.mark.leaks_ok``. The plugin is registered
through the ``pytest11`` entry point of the installed package.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

from _helpers import run_teardowns

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

# test_leak_fixture.py and faults/test_testing_plugin.py run inner sessions;
# declared here (the top-level conftest), so each file also runs on its own.
pytest_plugins = ["pytester"]

# HYPOTHESIS_PROFILE=ci (.ci/run): every run draws the same examples (seeded
# from each test), so CI turns red only on a change, never on a new draw.
settings.register_profile("ci", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


_SUITE_TMP = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The suite's temporary folders in one folder of its own, removed at the end.

    A group started without ``log_dir`` keeps its temporary log folder, as a
    user's run does (torch's too): hundreds of them per suite run would pile
    up in /tmp. ``TMPDIR`` reaches the supervisors that tests start as
    programs; pytest's own ``tmp_path`` stays where it was (its temproot is
    fixed first), and tests that need an exact folder still use
    ``private_tmp``. The prefix is short: a control socket's path must fit
    AF_UNIX's 108 bytes (aiolaunch falls back to a shorter one, but the
    suite should not always take that path).
    """
    root = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", root)
    suite = tempfile.mkdtemp(prefix="al-", dir=root)
    # As /tmp itself: tests that run a client as another user must reach their folders.
    os.chmod(suite, 0o1777)
    config.stash[_SUITE_TMP] = suite
    os.environ["TMPDIR"] = suite
    tempfile.tempdir = suite


def pytest_unconfigure(config: pytest.Config) -> None:
    suite = config.stash.get(_SUITE_TMP, None)
    if suite is not None:
        # After multiprocessing's own exit finalizer (priority -100), which
        # removes its pymp-* folder in there: one more, ordered after it.
        from multiprocessing import util

        util.Finalize(
            None, shutil.rmtree, args=(suite,), kwargs={"ignore_errors": True}, exitpriority=-101
        )


@pytest.fixture(autouse=True)
def _leak_check(no_leaks: None) -> Iterator[None]:
    """Autouse, so it is set up before a test's event loop and checked after it.

    Before the check, processes a helper registered with
    ``_helpers.on_teardown`` are stopped (a test that failed early must not
    leave a supervisor behind to disturb the next test).
    """
    yield
    run_teardowns()


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder that ``tempfile`` uses for this test, so that a temporary
    folder aiolaunch leaves behind can be seen (and listed exactly).
    """
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder
