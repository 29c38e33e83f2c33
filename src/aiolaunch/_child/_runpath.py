"""``--run-path``: run a script with :func:`runpy.run_path` inside a function worker.

The CLI's function entrypoint, pickled by reference: every ``--run-path``
worker imports this module, so it imports only ``sys`` (``runpy`` when it
runs) - not the command line, asyncio or argparse.
"""

from __future__ import annotations

import sys

__all__ = ["run_script_path"]


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Run ``training_script`` with :func:`runpy.run_path` as ``__main__`` (``--run-path``)."""
    import runpy

    sys.argv = [training_script, *training_script_args]
    try:
        runpy.run_path(training_script, run_name="__main__")
    except SystemExit as exc:
        # a script that ends with sys.exit(0) succeeded (as torch's @record)
        if exc.code not in (0, None):
            raise
