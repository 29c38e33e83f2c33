"""What a finished run returns: :class:`RunProcsResult` and :class:`ProcessFailure`.

Both classes are plain dataclasses that pickle by value (no file is read on
unpickling), so results can cross process boundaries. :func:`build_result`
makes a group's result from its state (``_group.GroupState``). Nearly a leaf module: it imports
the leaf ``_signals._names``, and ``build_result`` (lazily) the error-file writer.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ._signals._names import exit_signal_name

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from ._group import GroupState
    from ._types import JSON
    from ._workers._handle import WorkerHandle

__all__ = [
    "ProcessFailure",
    "RunProcsResult",
    "build_result",
    "not_ready_failure",
    "root_cause",
]

logger = logging.getLogger(__name__)

#: What torch stores in place of a missing error file or signal name.
NOT_AVAILABLE = "<N/A>"

_NO_TRACEBACK_HINT = "To enable traceback, decorate the entrypoint with @aiolaunch.record"

#: Lines of a worker's stderr log quoted when it died without an exception.
STDERR_TAIL_LINES = 10


def tail_lines(path: str, n: int) -> list[str]:
    """The last ``n`` lines of the log file ``path`` (its last 64 KiB at most).

    ``[]`` when there is no such file (``""``, ``/dev/null``, unreadable).
    """
    if not path or path == os.devnull:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    return list(deque(lines, maxlen=n))


def stderr_tail(path: str, n: int) -> tuple[list[str], str | None]:
    """The last ``n`` lines of a worker's stderr (``path``: its entry in
    ``stderrs``) and, when there are none, why not - for the run report.

    ``""`` means the stream went to the console: the supervisor never saw it
    (the worker writes the terminal itself), so only the terminal has it.
    """
    if path == "":
        return [], (
            "its stderr went to the console (aiolaunch's own stderr), not to a log file: "
            "the last lines are there; -t 2 or -r 2 (tee= or redirects=Std.ERR) keep them "
            "in a log file"
        )
    if path == os.devnull:
        return [], "its stderr was discarded (/dev/null)"
    lines = tail_lines(path, n)
    return lines, None if lines else f"nothing in {path}"


def _empty_error_data() -> JSON:
    # A fresh dict each time: torch shares (and mutates) one module-level dict.
    return {"message": "<NONE>"}


def _to_timestamp(value: object) -> int:
    # torch writes str(int(time.time())); accept floats and numbers as well.
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return int(float(value))
    raise TypeError(f"timestamp is a {type(value).__name__}")


@dataclass
class ProcessFailure:
    """A worker that failed: its rank, pid, exit code and recorded error.

    Construct it like torch's
    ``torch.distributed.elastic.multiprocessing.errors.ProcessFailure``:
    ``ProcessFailure(local_rank, pid, exitcode, error_file)``. The other fields
    are derived on construction, exactly as torch derives them:

    * If ``error_file`` is a file (written by :func:`aiolaunch.record`, torch's
      ``@record`` or the worker bootstrap), ``error_file_data`` is its JSON,
      ``message`` is its ``"message"`` entry - for a recorded exception a dict
      ``{"message": "<Type>: <msg>", "extraInfo": {"py_callstack": ...,
      "timestamp": ...}}`` as in torch, or a plain string in the older
      format - and ``timestamp`` the time the error was recorded.
    * Otherwise ``error_file`` becomes ``"<N/A>"``, ``timestamp`` is now
      (``time.time()``, sub-second; a supervisor sets it to the moment it
      detected the exit), and
      ``message`` is made up: ``"Signal 9 (SIGKILL) received by PID 123"`` for
      a worker killed by a signal (``exitcode == -signum``), else a hint to
      decorate the entrypoint with ``@record``.

    Unlike torch, an unreadable or malformed error file does not raise (the
    supervisor must still report the failure): ``message`` then says what is
    wrong with the file, and ``timestamp`` is the file's modification time.

    Use :attr:`error_message` and :attr:`py_callstack` for the two parts of
    ``message`` as strings, whichever format it has.

    :param local_rank: the worker's local rank.
    :param pid: the worker's process id.
    :param exitcode: its exit status; ``-N`` when killed by signal ``N``.
    :param error_file: path of its error file (``""`` if there is none).
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: JSON = field(init=False)
    message: str | JSON = field(init=False)  # the error file's dict, as in torch
    #: unix seconds: whole seconds from an error file (torch writes
    #: ``int(time.time())``), else sub-second (see :func:`root_cause`)
    timestamp: float = field(init=False)
    #: where the other live ranks were when this rank failed, one line per
    #: place (``"ranks 0,2: all_reduce (distributed_c10d.py:2950) <- ..."``):
    #: set by a supervisor with a watchdog, which dumped their stacks first;
    #: ``""`` otherwise (aiolaunch's own field, not torch's)
    others: str = field(init=False, default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        self.error_file_data = _empty_error_data()
        self.message = ""
        self.timestamp = time.time()
        if self.error_file and os.path.isfile(self.error_file):
            self._read_error_file()
        else:
            self.error_file = NOT_AVAILABLE

        if not self.message:
            # Signals typically leave no error file behind.
            if self.exitcode < 0:
                self.message = (
                    f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
                )
            else:
                self.error_file_data["errorTraits"] = {
                    "category": "system_terminated_error",
                    "retryability": "False",
                }
                self.message = _NO_TRACEBACK_HINT

    def _read_error_file(self) -> None:
        try:
            with open(self.error_file, encoding="utf-8") as fp:
                data = json.load(fp)
            message = data["message"]
            if isinstance(message, str):
                timestamp = _to_timestamp(data.get("timestamp", 0))
            elif isinstance(message, dict):
                timestamp = _to_timestamp(message["extraInfo"]["timestamp"])
            else:
                raise TypeError(f'"message" is a {type(message).__name__}')
        except (OSError, ValueError, LookupError, TypeError) as exc:
            # torch raises here; a supervisor that crashes while reporting a
            # failure is worse than one that reports a damaged error file.
            logger.warning("failed to parse error file %s: %r", self.error_file, exc)
            self.message = f"<unreadable error file {self.error_file}: {type(exc).__name__}: {exc}>"
            self.error_file_data = {"message": self.message}
            try:
                self.timestamp = int(os.path.getmtime(self.error_file))
            except OSError:
                pass
            return
        self.error_file_data = data
        self.message = message
        self.timestamp = timestamp

    def signal_name(self) -> str:
        """Name of the signal that killed the worker, e.g. ``"SIGKILL"``.

        :returns: the name when ``exitcode`` is ``-N`` for a known signal
            ``N``, else ``"<N/A>"`` (torch's placeholder).
        """
        return exit_signal_name(self.exitcode) or NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """:attr:`timestamp` as local time, ``YYYY-MM-DD_HH:MM:SS`` (torch's format)."""
        return datetime.fromtimestamp(int(self.timestamp)).isoformat(sep="_")

    @property
    def error_message(self) -> str:
        """The failure in one line: ``"<Type>: <msg>"`` for a recorded
        exception, else :attr:`message` itself (e.g. the signal description)."""
        if isinstance(self.message, dict):
            return str(self.message.get("message", NOT_AVAILABLE))
        return str(self.message)

    @property
    def py_callstack(self) -> str | None:
        """The recorded Python traceback, or ``None`` when the error file has none."""
        if isinstance(self.message, dict):
            extra = self.message.get("extraInfo")
            if isinstance(extra, dict):
                callstack = extra.get("py_callstack")
                if isinstance(callstack, str):
                    return callstack
        return None


@dataclass
class RunProcsResult:
    """The outcome of a finished run, every field keyed by local rank.

    Returned by :meth:`PContext.wait`; torch's ``RunProcsResult`` with the
    same fields. ``return_values`` holds every rank's return value when the
    run succeeded (``None`` for binaries) and is empty when it failed;
    ``failures`` holds the failed ranks in the order they were observed;
    ``stdouts``/``stderrs`` map ranks to log file paths (``""`` when the
    stream was not redirected).
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        """Whether any worker failed (``failures`` is not empty)."""
        return len(self.failures) > 0


def root_cause(failures: Mapping[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The root cause of a failed group: ``(rank, failure)`` observed first.

    The one rule, used by :class:`ChildFailedError`, :func:`aiolaunch.launch`
    and the agent: the earliest :attr:`ProcessFailure.timestamp`; ties go to
    the lowest rank (deterministic, whatever the order of ``failures``).
    Timestamps are sub-second for failures the supervisor observed (exit
    detection time) and whole seconds for those read from an error file.

    :raises ValueError: if ``failures`` is empty.
    """
    if not failures:
        raise ValueError("root_cause() needs at least one failure")
    rank = min(failures, key=lambda r: (failures[r].timestamp, r))
    return rank, failures[rank]


def not_ready_failure(handle: WorkerHandle, error_file: str) -> ProcessFailure:
    """The failure of a worker that exited before it was ready (for ``wait_ready()``)."""
    return ProcessFailure(
        local_rank=handle.local_rank,
        pid=handle.pid,
        exitcode=handle.returncode or 0,
        error_file=error_file,
    )


def build_result(
    state: GroupState,
    failed: Iterable[int],
    error_files: Mapping[int, str],
    stdouts: Mapping[int, str],
    stderrs: Mapping[int, str],
) -> RunProcsResult:
    """The result of a finished group.

    :param state: the group; every started worker (the last incarnation of
        each rank) has exited.
    :param failed: the failed ranks, in the order their failure was observed
        (:meth:`GroupState.failed_ranks`): the order of ``failures``. A
        failure forced on a live rank (a stall, :meth:`GroupState.fail`) says
        why, with the moment it was decided as its timestamp. A failure
        without an error file whose handle knows why (``failure_reason``,
        e.g. a function worker that exited 0 without returning) gets that
        reason written as its error file. A failure the worker did not
        record itself is timestamped with the moment its exit was detected
        (sub-second), not when this runs. A worker that records its
        exceptions (a function, a script run by the bootstrap) that died
        without a Python exception (``os._exit``, a signal) gets its exit
        code or signal and the last lines of its stderr log as ``message``
        (not torch's "decorate with @record" hint).
    :returns: the return values of every rank that exited 0 on its own when
        nothing failed, else the failures only.
    """
    failures: dict[int, ProcessFailure] = {}
    forced = state.forced
    for rank in failed:
        w = state.worker(rank)
        assert w is not None and w.returncode is not None
        error_file = error_files.get(rank, "")
        recorded = bool(error_file) and os.path.isfile(error_file)
        if w.failure_reason is not None and error_file and error_file != os.devnull:
            _record_reason(error_file, w.failure_reason)
        failure = ProcessFailure(
            local_rank=rank, pid=w.pid, exitcode=w.returncode, error_file=error_file
        )
        if rank in forced:
            failure.message = forced[rank].message
            failure.timestamp = min(failure.timestamp, forced[rank].time)
        elif not recorded and w.exit_time is not None:
            failure.timestamp = w.exit_time
        if (
            not recorded
            and rank not in forced
            and w.failure_reason is None
            and w.records_exceptions
        ):
            # "Decorate with @record" cannot help a function worker or a
            # script run by the bootstrap: each records every exception it
            # raises. It died without one.
            failure.message = _died_without_exception(failure, stderrs.get(rank, ""))
        failures[rank] = failure
    return_values: dict[int, Any] = {}
    if not failures:
        for w in state.workers():
            if w.returncode == 0 and not w.stopped_by_us:
                return_values[w.local_rank] = w.return_value
    return RunProcsResult(
        return_values=return_values,
        failures=failures,
        stdouts=dict(stdouts),
        stderrs=dict(stderrs),
    )


def _died_without_exception(failure: ProcessFailure, stderr: str) -> str:
    if failure.exitcode < 0:
        text = (
            f"Signal {-failure.exitcode} ({failure.signal_name()}) received by PID "
            f"{failure.pid}: local rank {failure.local_rank} died without a Python exception"
        )
    else:
        text = (
            f"local rank {failure.local_rank} (pid {failure.pid}) exited with code "
            f"{failure.exitcode} without raising a Python exception (sys.exit("
            f"{failure.exitcode}), os._exit(), or a crash in native code)"
        )
    lines = tail_lines(stderr, STDERR_TAIL_LINES)
    if lines:
        text += f"; the last lines of its stderr ({stderr}):\n" + "\n".join(lines)
    return text


def _record_reason(path: str, reason: str) -> None:
    if os.path.exists(path):
        return
    from ._child._error_file import write_error_file

    try:
        write_error_file(path, RuntimeError(reason))
    except OSError:
        print(f"aiolaunch: {reason}", file=sys.stderr)  # noqa: T201
