"""Tiny real child programs for tests (STYLE.md practice 10).

Tests start real processes, never mocks of ``Popen`` or of the event loop.
``python(code)`` gives an argv that runs ``code`` in a fresh interpreter; the
constants are the programs tests need most. Programs that report readiness
print a line (``ready``) and flush, so the test reads it before it signals
the process: handshakes, not sleeps (practice 11).

Programs that would otherwise run forever sleep in a loop; the test must stop
them (the autouse leak check in ``conftest.py`` fails a test that does not).
"""

from __future__ import annotations

import sys
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "EXIT_0",
    "EXIT_1",
    "GRANDCHILD_HOLDS_PIPE",
    "IGNORE_SIGTERM",
    "PRINT_READY_THEN_SLEEP",
    "SLEEP_FOREVER",
    "python",
    "sleep",
    "write_script",
]


def python(code: str) -> list[str]:
    """The argv that runs ``code`` with this interpreter: ``[sys.executable, "-c", code]``.

    ``code`` is dedented first, so triple-quoted blocks can be indented.
    """
    return [sys.executable, "-c", textwrap.dedent(code)]


#: Exits with status 0 at once.
EXIT_0 = "import sys; sys.exit(0)"

#: Exits with status 1 at once.
EXIT_1 = "import sys; sys.exit(1)"

#: Sleeps until killed (the default SIGTERM action applies).
SLEEP_FOREVER = "import time\nwhile True:\n    time.sleep(3600)"

#: Prints ``ready`` once running, then sleeps until killed.
PRINT_READY_THEN_SLEEP = """\
import sys, time
print("ready", flush=True)
while True:
    time.sleep(3600)
"""

#: Ignores SIGTERM, *then* prints ``ready``: once the test has read ``ready``,
#: SIGTERM has no effect and only SIGKILL stops the process.
IGNORE_SIGTERM = """\
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(3600)
"""

#: Starts a grandchild that inherits stdout and stderr and sleeps (60 s at
#: most), prints ``grandchild=<pid>`` and exits 0 at once: the pipes stay open
#: after the child is gone. A supervisor must not wait for their EOF, and must
#: kill the grandchild when it stops the worker's tree.
GRANDCHILD_HOLDS_PIPE = """\
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(f"grandchild={child.pid}", flush=True)
"""


def sleep(seconds: float) -> str:
    """A program that sleeps ``seconds`` and exits 0."""
    return f"import time; time.sleep({seconds!r})"


def write_script(tmp_path: Path, name: str, code: str) -> Path:
    """Write ``code`` (dedented) to ``tmp_path / name`` and return the path.

    For programs too long for ``-c``, or run as ``python script.py`` (e.g. by
    the CLI). The file is made executable, so a script with a ``#!`` line can
    be run directly.
    """
    path = tmp_path / name
    path.write_text(textwrap.dedent(code), encoding="utf-8")
    path.chmod(0o755)
    return path
