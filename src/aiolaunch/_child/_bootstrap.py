"""Run a Python program as ``python`` would, able to dump its stacks on request.

``python -m aiolaunch._child._bootstrap script.py ARGS...`` behaves like
``python script.py ARGS...`` and ``python -m aiolaunch._child._bootstrap -m module
ARGS...`` like ``python -m module ARGS...``: same ``sys.argv``, the program
runs as ``__main__`` (``sys.modules["__main__"]`` is its module, so
multiprocessing's spawn finds it), ``sys.path[0]`` is the script's folder (or
the current folder for ``-m``), and the exit status is the program's (an
uncaught exception: its traceback, without the bootstrap's frames, and
status 1; ``sys.exit(n)``: ``n``; a script that cannot be opened: python's
one line, status 2).

An uncaught exception is also recorded in the rank's error file
(``$TORCHELASTIC_ERROR_FILE``) as ``@record`` would record it - type,
message, traceback - unless the program wrote that file itself
(:mod:`aiolaunch._child._uncaught`): the failure's message, the summary and
``report.json`` carry the exception with no decorator in the script.

Before the program starts, :func:`aiolaunch._child._dump_handler.register` installs the
stack-dump handlers when ``$AIOLAUNCH_STACKS_DIR`` is set (the CLI sets it), and
:func:`aiolaunch._child._attach.register` the ``aiolaunch attach`` one, and
:func:`aiolaunch._child._record_server.watch` serves the rank's collective
record once the program imports torch (when the supervisor asks).
"""

from __future__ import annotations

import builtins
import os
import runpy
import sys

__all__ = ["BOOTSTRAP", "main"]

#: this module's name: a Python worker runs as ``python -u -m`` it ``script ARGS``
#: (``__name__`` is ``"__main__"`` when it runs so)
BOOTSTRAP = "aiolaunch._child._bootstrap"


def main(argv: list[str], dumps: bool = True) -> None:
    """Run ``argv`` (``[script, *args]`` or ``["-m", module, *args]``); never returns normally.

    ``dumps=False``: no stack-dump handler (a worker forked from the zygote
    for a plain ``python script.py`` command line, which would have none).
    """
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        sys.stderr.write(
            "usage: python -m aiolaunch._child._bootstrap (script.py | -m module) [args...]\n"
        )
        raise SystemExit(2)
    if dumps:
        from aiolaunch._child._attach import register as register_attach
        from aiolaunch._child._dump_handler import register
        from aiolaunch._child._record_server import watch

        register()
        register_attach()  # `aiolaunch attach RANK`: pdb on request
        watch()  # collective records, once the program imports torch
    from ._uncaught import ErrorFileWatch

    error_file = ErrorFileWatch()  # before the program can write it
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy replaces argv[0] by the module's path
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            if os.path.isdir(script):  # a folder with __main__.py, as python runs it
                sys.path[0] = script
                runpy.run_path(script, run_name="__main__")
            else:
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                _run_script(script)
    except Exception as exc:
        # As python would: the traceback (through sys.excepthook, which the
        # program may have replaced), then status 1 - minus our own frames.
        # SystemExit and KeyboardInterrupt propagate unchanged.
        tb = exc.__traceback__
        while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        error_file.record(exc.with_traceback(tb))
        sys.excepthook(type(exc), exc, tb)
        raise SystemExit(1) from None
    raise SystemExit(0)


def _run_script(path: str) -> None:
    # runpy.run_path would do the same for a plain file, but imports pkgutil
    # and typing first: ~10 ms more in every worker's start.
    try:
        f = open(path, "rb")  # noqa: SIM115
    except OSError as exc:
        # As python: one line and status 2 (torchrun's workers exit 2 too).
        sys.stderr.write(
            f"{sys.executable}: can't open file {os.path.abspath(path)!r}: "
            f"[Errno {exc.errno}] {exc.strerror}\n"
        )
        raise SystemExit(2) from None
    path = os.path.abspath(path)  # as python makes __file__ and the tracebacks' paths
    with f:
        code = compile(f.read(), path, "exec")
    main = type(sys)("__main__")
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=None,
        __package__=None,
        __spec__=None,
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _ours(filename: str) -> bool:
    name = os.path.basename(filename)
    return name in ("_bootstrap.py", "_forked.py") or "runpy" in name


if __name__ == "__main__":
    main(sys.argv[1:])
