"""The pytest side: the ``no_leaks`` fixture, the options and the hooks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

from ._processes import session_token
from ._snapshot import CHECKS, DEFAULT_SETTLE_S, Snapshot

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["no_leaks", "pytest_addoption", "pytest_collection_modifyitems", "pytest_configure"]


def _checks_for(item: pytest.Item) -> tuple[str, ...]:
    marker = item.get_closest_marker("leaks_ok")
    if marker is None:
        return CHECKS
    if not marker.args:
        return ()
    unknown = set(marker.args) - set(CHECKS)
    if unknown:
        raise pytest.UsageError(f"leaks_ok({', '.join(map(repr, marker.args))}): use {CHECKS}")
    return tuple(c for c in CHECKS if c not in marker.args)


def _settle(config: pytest.Config) -> float:
    env = os.environ.get("AIOLAUNCH_LEAKCHECK_SETTLE")
    if env:
        return float(env)
    value = config.getini("aiolaunch_leak_settle")
    return float(value) if value else DEFAULT_SETTLE_S


@pytest.fixture
def no_leaks(request: pytest.FixtureRequest) -> Iterator[Snapshot | None]:
    """Fail the test at teardown if it leaves processes, fds or changed signal handlers.

    Yields the :class:`Snapshot` (or ``None`` when ``leaks_ok`` turned every
    check off); ``snapshot.ignore_fds`` may be extended by the test.
    """
    checks = _checks_for(request.node)
    if not checks:
        yield None
        return
    before = Snapshot.take(checks)
    yield before
    settle = _settle(request.config)
    problems = before.wait_for_no_leaks(settle)
    if problems:
        pytest.fail(
            f"{request.node.nodeid} leaked (still there after {settle:g} s):\n  "
            + "\n  ".join(problems)
            + "\n(mark the test @pytest.mark.leaks_ok only if this is intended)",
            pytrace=False,
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aiolaunch")
    group.addoption(
        "--aiolaunch-leak-check",
        action="store_true",
        default=None,
        help="check every test for leaked processes, fds and signal handlers",
    )
    parser.addini(
        "aiolaunch_leak_check",
        type="bool",
        default=False,
        help="check every test for leaked processes, fds and signal handlers (no_leaks)",
    )
    parser.addini(
        "aiolaunch_leak_settle",
        default="",
        help=f"seconds leaks may take to go away after a test (default {DEFAULT_SETTLE_S})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "leaks_ok(*checks): skip aiolaunch's leak check for this test; with arguments, "
        "only the named parts (processes, fds, signals)",
    )
    if _autouse(config):
        # Every test is checked: tag the processes of the whole session,
        # session fixtures' included. Otherwise nothing is set until a test
        # requests no_leaks (Snapshot.take).
        session_token()


def _autouse(config: pytest.Config) -> bool:
    option = config.getoption("--aiolaunch-leak-check", default=None)
    if option is not None:
        return bool(option)
    return bool(config.getini("aiolaunch_leak_check"))


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if not _autouse(config):
        return
    for item in items:
        names = getattr(item, "fixturenames", None)
        if isinstance(names, list) and "no_leaks" not in names:
            # First: set up before the test's event loop and torn down after it.
            names.insert(0, "no_leaks")
