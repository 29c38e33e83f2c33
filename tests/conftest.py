"""The suite's own leak check is aiolaunch's public pytest plugin (``aiolaunch.testing``).

Every test - sync or async, pytest-asyncio or anyio - fails if it leaves a
descendant process, a zombie, an open fd or a changed signal handler behind.
Opt out per test with ``@pytest.mark.leaks_ok``. The plugin is registered
through the ``pytest11`` entry point of the installed package.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _leak_check(no_leaks: None) -> None:
    """Autouse, so it is set up before a test's event loop and checked after it."""
