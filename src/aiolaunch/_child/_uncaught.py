"""The exception that ends a worker, recorded as ``@record`` would: no decorator needed.

torchrun reports a worker's exception only when the script decorates its
entrypoint with ``@record``; without it the failure says "exitcode 1" and
"decorate the entrypoint". aiolaunch runs every Python worker through its
own bootstrap (a script's: ``_bootstrap``, spawned or forked from the
zygote; a function's: ``_function``), which sees the exception that ends
the program and records it here - type, message, traceback, as
:func:`aiolaunch.record` writes them - into the rank's error file.

A program that recorded its error itself keeps its own file: ``@record``
(aiolaunch's or torch's), or any data it wrote to
``$TORCHELASTIC_ERROR_FILE``. :class:`ErrorFileWatch` notes the file when
the program starts and writes only when it is unchanged at the end.

The record is made before the traceback is printed and the interpreter
finalizes: the supervisor reads it as the sign that a worker is failing on
its own (``_terminate``), even when it stops the worker before its exit.

Imports only :mod:`os` until there is something to record (a worker's start
stays as cheap as a bare interpreter's); the error-file writer is imported
then.
"""

from __future__ import annotations

import os

__all__ = ["ErrorFileWatch"]

_ENV = "TORCHELASTIC_ERROR_FILE"  # _error_file.ERROR_FILE_ENV, without importing it


class ErrorFileWatch:
    """A worker's error file, watched from the program's start to its end.

    :param path: the error file; ``None``: ``$TORCHELASTIC_ERROR_FILE`` (read
        now, before the program can change it). No path (unset, empty) or
        ``/dev/null``: nothing is ever written.
    """

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            path = os.environ.get(_ENV, "")
        self.path = "" if path == os.devnull else path
        self._before = _state(self.path) if self.path else None

    def record(self, exc: BaseException) -> None:
        """Record ``exc`` unless the program wrote the error file since it started.

        ``exc`` is the exception that ends the program, with its traceback
        (the bootstrap's own frames already removed). A
        :class:`~aiolaunch.ChildFailedError` passes its root cause's error
        file up, as :func:`aiolaunch.record` does. Never raises: a failure to
        write is logged, and ``exc`` still ends the program as it would.
        """
        if not self.path or _state(self.path) != self._before:
            return
        try:
            from ._error_file import _record_exception, write_error_file

            if isinstance(exc, Exception):
                _record_exception(exc, self.path)
            else:  # KeyboardInterrupt in a function worker: as before, its own file
                write_error_file(self.path, exc)
        except Exception as error:  # e.g. an exception whose __str__ raises
            note = f"aiolaunch: could not record {type(exc).__name__}: {error!r}\n"
            try:
                os.write(2, note.encode())
            except OSError:
                pass


def _state(path: str) -> tuple[int, int, int, int] | None:
    # The error file is replaced by a rename when written (a new inode):
    # any write changes this.
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
