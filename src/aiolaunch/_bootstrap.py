"""Run a Python program as ``python`` would, able to dump its stacks on request.

``python -m aiolaunch._bootstrap script.py ARGS...`` behaves like
``python script.py ARGS...`` and ``python -m aiolaunch._bootstrap -m module
ARGS...`` like ``python -m module ARGS...``: same ``sys.argv``, the program
runs as ``__main__`` (``sys.modules["__main__"]`` is its module, so
multiprocessing's spawn finds it), ``sys.path[0]`` is the script's folder (or
the current folder for ``-m``), and the exit status is the program's (an
uncaught exception: its traceback and status 1; ``sys.exit(n)``: ``n``).

Before the program starts, :func:`aiolaunch._stacks.register` installs the
stack-dump handler when ``$AIOLAUNCH_STACKS_DIR`` is set (the CLI sets it). The
only visible difference: a traceback starts with a few ``runpy`` frames.
"""

from __future__ import annotations

import os
import runpy
import sys

__all__ = ["main"]


def main(argv: list[str]) -> None:
    """Run ``argv`` (``[script, *args]`` or ``["-m", module, *args]``); never returns normally."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        sys.stderr.write(
            "usage: python -m aiolaunch._bootstrap (script.py | -m module) [args...]\n"
        )
        raise SystemExit(2)
    from aiolaunch._stacks import register

    register()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy replaces argv[0] by the module's path
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
