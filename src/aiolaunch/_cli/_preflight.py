"""Checks before anything starts whose failure a retry cannot fix (exit 2)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

__all__ = ["check_entrypoint"]


def check_entrypoint(args: argparse.Namespace) -> None:
    """What the workers run exists here (else exit 2, do not retry): the script file,
    the top-level package of ``-m``, the binary (``--no-python``, ``$PYTHON_EXEC``).

    :raises FileNotFoundError: naming the flag and the fix
        (:class:`PermissionError`: a binary that is not executable).
    """
    from ._checks import check_executable

    script = args.training_script
    python = os.getenv("PYTHON_EXEC", sys.executable)
    if not args.no_python and not args.run_path and python != sys.executable:
        check_executable(python, "$PYTHON_EXEC")
    if args.module and not args.run_path:
        if args.no_python:
            return  # refused with its own message
        from importlib.util import find_spec

        top = script.partition(".")[0]
        saved = list(sys.path)
        sys.path.insert(0, os.getcwd())  # `python -m` looks in the working folder first
        try:
            found = bool(top) and find_spec(top) is not None  # no import: top level only
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path[:] = saved
        if not found:
            raise FileNotFoundError(
                f"-m {script}: no module {top!r} on sys.path (from {os.getcwd()}); "
                "install it or run from the folder that holds it"
            )
    elif args.no_python and not args.run_path:
        check_executable(script, "--no-python")
    elif not os.path.exists(script):  # a folder with __main__.py runs too, as with python
        raise FileNotFoundError(
            f"the script {script!r} does not exist (from {os.getcwd()}); give its path, "
            "or use -m for a module, --no-python for a program"
        )
