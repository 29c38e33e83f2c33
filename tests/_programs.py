"""Tiny real child programs for tests (STYLE.md practice 10).

Tests start real processes, never mocks of ``Popen`` or of the event loop.
``python(code)`` gives an argv that runs ``code`` in a fresh interpreter;
``write_script`` writes a longer program to a file. Programs that report
readiness print a line (``ready``) and flush, so the test reads it before it
signals the process: handshakes, not sleeps (practice 11).

Programs that would otherwise run forever sleep in a loop; the test must stop
them (the autouse leak check in ``conftest.py`` fails a test that does not).
"""

from __future__ import annotations

import sys
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["SLEEP_FOREVER", "python", "write_script"]


def python(code: str) -> list[str]:
    """The argv that runs ``code`` with this interpreter: ``[sys.executable, "-c", code]``.

    ``code`` is dedented first, so triple-quoted blocks can be indented.
    """
    return [sys.executable, "-c", textwrap.dedent(code)]


#: Sleeps until killed (the default SIGTERM action applies).
SLEEP_FOREVER = "import time\nwhile True:\n    time.sleep(3600)"


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
