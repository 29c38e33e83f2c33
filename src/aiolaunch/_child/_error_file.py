"""Error files: torch-compatible JSON read/write, and the :func:`record` decorator.

A worker that fails with an exception leaves an error file; the supervisor
reads it into a :class:`~aiolaunch.ProcessFailure`. The format is torch's
(``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``), so files
written here are read by torch and the other way round::

    {"message": {"message": "<Type>: <msg>",
                 "extraInfo": {"py_callstack": "<traceback>",
                               "timestamp": "<unix seconds, an integer string>"}}}

Function workers get one written by their bootstrap; binaries find its path
in ``$TORCHELASTIC_ERROR_FILE`` and write it when their main function is
decorated with :func:`record` (aiolaunch's or torch's).

This module imports nothing from aiolaunch at run time, and only the standard
library, so a failing worker can import it cheaply.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import time
import traceback
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

if TYPE_CHECKING:
    from .._types import JSON

__all__ = [
    "ERROR_FILE_ENV",
    "error_data_from_exception",
    "read_error_file",
    "record",
    "write_error_file",
]

logger = logging.getLogger(__name__)

#: The environment variable that names a worker's error file (torch's name).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


_P = ParamSpec("_P")
_R = TypeVar("_R")


def error_data_from_exception(exc: BaseException) -> JSON:
    """The error-file contents for ``exc``, in torch's format.

    ``message`` is ``"<Type>: <str(exc)>"``, ``py_callstack`` the formatted
    traceback of ``exc`` (chained exceptions included) and ``timestamp`` the
    current time in whole seconds, as a string (torch parses it with ``int``).

    :param exc: the exception; its ``__traceback__`` is used, so call this
        where the exception was caught (or on an exception that was raised).
    :returns: a new dict ready for :func:`json.dumps`.
    """
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(int(time.time())),
            },
        }
    }


def write_error_file(
    path: str | os.PathLike[str], exc_or_data: BaseException | Mapping[str, Any]
) -> None:
    """Write an error file, atomically.

    The JSON goes to a temporary file in the same directory, which is then
    renamed over ``path``: a reader (the supervisor) sees either no file or a
    complete one, even when the worker is killed half-way. The parent
    directory is created if missing; an existing file is replaced.

    :param path: where to write, e.g. ``os.environ["TORCHELASTIC_ERROR_FILE"]``.
    :param exc_or_data: an exception (converted with
        :func:`error_data_from_exception`) or ready error data (a mapping that
        :func:`json.dumps` accepts).
    :raises OSError: the file could not be written (nothing is left behind);
        :class:`NotADirectoryError` when a file is in the way of its directory.
    :raises TypeError: ``exc_or_data`` is neither, or is not JSON-serializable.
    """
    if isinstance(exc_or_data, BaseException):
        data: Mapping[str, Any] = error_data_from_exception(exc_or_data)
    elif isinstance(exc_or_data, Mapping):
        data = exc_or_data
    else:
        raise TypeError(
            f"write_error_file() takes an exception or a dict, not {type(exc_or_data).__name__}"
        )
    text = json.dumps(data)
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        try:
            os.makedirs(parent, exist_ok=True)
        except FileExistsError as exc:  # a file is in the way
            raise NotADirectoryError(
                errno.ENOTDIR, f"cannot write error file {path}: not a directory", exc.filename
            ) from exc
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with open(fd, "w", encoding="utf-8", closefd=True) as fp:
            fp.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_error_file(path: str | os.PathLike[str]) -> JSON | None:
    """Read an error file written by aiolaunch or torch.

    :param path: the error file.
    :returns: its JSON object, or ``None`` when there is no such file, it
        cannot be read, or it does not hold a JSON object (a warning is
        logged for the last two).
    """
    try:
        with open(path, encoding="utf-8") as fp:
            data = json.load(fp)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("cannot read error file %s: %r", os.fspath(path), exc)
        return None
    if not isinstance(data, dict):
        logger.warning("error file %s does not hold a JSON object", os.fspath(path))
        return None
    return data


def _enable_faulthandler() -> None:
    # As torch's ErrorHandler.initialize(): a crash (SIGSEGV...) prints every
    # thread's traceback. Leave an existing setup (e.g. pytest's) alone.
    import faulthandler

    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(all_threads=True)
    except Exception as exc:
        # No usable sys.stderr (pythonw, some notebooks and services: it is
        # None or has no fileno): the function must run anyway, as torch's does.
        import warnings

        warnings.warn(
            f"Unable to enable fault handler. {type(exc).__name__}: {exc}",
            RuntimeWarning,
            stacklevel=3,
        )


def _record_exception(exc: Exception, path: str | None = None) -> None:
    """What :func:`record` does with ``exc`` (``path``: default ``$TORCHELASTIC_ERROR_FILE``)."""
    if path is None:
        path = os.environ.get(ERROR_FILE_ENV)
    get_first_failure = getattr(exc, "get_first_failure", None)
    if callable(get_first_failure):
        # A ChildFailedError (ours or torch's): pass the root cause's own
        # error file up, with its exit code, as torch's record does.
        rank, failure = get_first_failure()
        child_data = read_error_file(failure.error_file)
        if child_data is not None:
            message = child_data.get("message")
            if failure.exitcode and isinstance(message, dict):
                message["errorCode"] = failure.exitcode
            if path:
                _write_or_log(path, child_data)
            else:
                logger.info("no %s set; not recording local_rank %s's error", ERROR_FILE_ENV, rank)
            return
        # The child left no error file: record the ChildFailedError itself
        # (torch records nothing here).
    if path:
        _write_or_log(path, exc)
    else:
        logger.info("no %s set; not recording %s: %s", ERROR_FILE_ENV, type(exc).__name__, exc)


def _write_or_log(path: str, exc_or_data: BaseException | Mapping[str, Any]) -> None:
    # Never let a failure to record hide the exception being recorded.
    try:
        write_error_file(path, exc_or_data)
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("failed to write error file %s: %r", path, exc)


@overload
def record(
    fn: Callable[_P, Coroutine[Any, Any, _R]],
) -> Callable[_P, Coroutine[Any, Any, _R | None]]: ...
@overload
def record(fn: Callable[_P, _R]) -> Callable[_P, _R | None]: ...
def record(fn: Callable[_P, Any]) -> Callable[_P, Any]:
    """Decorate a worker's main function so that its exception reaches the supervisor.

    When ``fn`` raises an :class:`Exception`, the decorator writes it (type,
    message, traceback, time) to the file named by ``$TORCHELASTIC_ERROR_FILE``
    and re-raises it; without that variable it only logs that nothing was
    recorded. A :class:`~aiolaunch.ChildFailedError` (aiolaunch's or torch's)
    passes its root cause's error file up instead, as torch does.
    ``SystemExit`` with code 0 makes the call return ``None`` (torch's
    behaviour, for ``run_path`` entrypoints); other ``SystemExit``,
    ``KeyboardInterrupt`` and cancellation propagate without a record. The
    call also enables :mod:`faulthandler` unless already enabled.

    Works on ``def`` and ``async def`` functions (the result is then a
    coroutine function). A drop-in for torch's
    ``torch.distributed.elastic.multiprocessing.errors.record``::

        @aiolaunch.record
        def main() -> None: ...

        if __name__ == "__main__":
            main()

    :param fn: the function to decorate.
    :returns: a wrapper with ``fn``'s signature and metadata.
    """
    import inspect  # only needed at decoration time

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: _P.args, **kwargs: _P.kwargs) -> Any:
            _enable_faulthandler()
            try:
                return await fn(*args, **kwargs)
            except SystemExit as exc:
                if exc.code == 0:
                    return None
                raise
            except Exception as exc:
                _record_exception(exc)
                raise

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> Any:
        _enable_faulthandler()
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code == 0:
                return None
            raise
        except Exception as exc:
            _record_exception(exc)
            raise

    return wrapper
