"""A pytest plugin that fails tests which leave processes, fds or signal handlers behind.

Enable it (it is registered as the ``aiolaunch`` pytest plugin when aiolaunch
is installed, or list ``"aiolaunch.testing"`` in ``pytest_plugins``), then
either request the fixture::

    async def test_supervisor(no_leaks):
        ...

or check every test (``pytest.ini`` / ``pyproject.toml``)::

    [tool.pytest.ini_options]
    aiolaunch_leak_check = true        # or: pytest --aiolaunch-leak-check

After each checked test, three kinds of leak fail it at teardown:

(a) **Processes**: a live descendant of the test process, a *zombie* child
    nobody reaped, or an *orphan* - a grandchild whose parent died and that
    was re-parented away, which the ppid tree no longer shows. Orphans are
    found through an environment tag: the plugin puts a per-session token into
    ``$AIOLAUNCH_LEAKCHECK_TOKENS``; processes started by the tests inherit it
    and the check reads ``/proc/<pid>/environ``. (A process started with an
    empty environment escapes this part.) Only pids that appeared during the
    test are examined, so the check costs a few milliseconds.
(b) **File descriptors**: new entries of ``/proc/self/fd``, with their targets.
(c) **Signal handlers**: ``signal.getsignal()`` of SIGTERM, SIGINT, SIGHUP,
    SIGQUIT and SIGCHLD, and the ``signal.set_wakeup_fd`` fd.

Leaks get a bounded settle time (``aiolaunch_leak_settle``, default 2 s)
because a killed process takes a moment to be reaped.

**Event loops.** The check is a *sync* function-scoped fixture set up before
any other fixture of the test, so under pytest-asyncio and under anyio's
plugin the snapshot is taken before the test's event loop exists and compared
after it was closed. A loop or runner of a wider scope (a module-scoped
``anyio_backend`` runner kept alive by a module-scoped async fixture, a
session-scoped pytest-asyncio loop) is created before the snapshot of the
first test in that scope only if one of its fixtures was set up earlier: such
a test may see the loop's fds as new. Mark it ``leaks_ok("fds")`` or widen
nothing.

**Allowed helpers.** Processes started once per interpreter and kept until it
exits are never reported: ``multiprocessing``'s resource tracker and
forkserver, and aiolaunch's own lifeline pipe and guardian process. Add your
own with :func:`allow_long_lived_helper`.

**Opting out**: ``@pytest.mark.leaks_ok`` skips the check for one test;
``@pytest.mark.leaks_ok("fds")`` skips only the named parts (``"processes"``,
``"fds"``, ``"signals"``).

*Platform*: Linux reads ``/proc``; on macOS the check uses ``/dev/fd`` and
``ps`` and cannot see orphans. Importing :mod:`aiolaunch` never imports this
package (nor pytest). Loaded but not enabled - no ``no_leaks`` requested, no
``aiolaunch_leak_check`` - the plugin does nothing: it sets no environment
variable and reads nothing.

The package, one concept a module: ``_processes`` (the process table, the
session token, :func:`new_processes`), ``_resources`` (fds and signal
handlers), ``_long_lived`` (helpers never reported), ``_snapshot``
(:class:`Snapshot`: the baseline and its comparison), ``_plugin`` (the
fixture, the options and the hooks).
"""

from __future__ import annotations

from ._long_lived import allow_long_lived_helper
from ._plugin import (
    no_leaks,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
)
from ._processes import TOKEN_ENV, Proc, new_processes, session_token
from ._resources import SIGNALS, open_fds
from ._snapshot import CHECKS, DEFAULT_SETTLE_S, Snapshot

__all__ = [
    "CHECKS",
    "DEFAULT_SETTLE_S",
    "SIGNALS",
    "TOKEN_ENV",
    "Proc",
    "Snapshot",
    "allow_long_lived_helper",
    "new_processes",
    "no_leaks",
    "open_fds",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "session_token",
]
