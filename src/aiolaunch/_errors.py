"""Every exception aiolaunch raises on purpose.

::

    Exception
     ├── SignalException     SIGTERM/SIGINT/SIGHUP/SIGQUIT reached the supervisor while
     │                       PContext.wait() ran; the workers were stopped first.
     ├── ChildFailedError    one or more workers failed; str() is the root-cause summary
     │                       (raise it from a @record-decorated main to pass the
     │                       worker's error file up, as with torch).
     ├── WorkerError         launch(): a worker failed; the others were stopped.
     └── MainProcessError    launch(): the supervisor got a termination signal;
                             the workers were stopped.

Input errors are builtin exceptions (``ValueError``, ``TypeError``,
``FileNotFoundError``, ``NotADirectoryError``), raised before any process starts.

Each exception builds its message in ``__init__`` from its fields, and those
with constructor arguments beyond a message define ``__reduce__``, so they
survive pickling (e.g. a ``ChildFailedError`` raised in a function worker).
Nearly a leaf module: at run time it imports only the leaf ``_signals._names``.
"""

from __future__ import annotations

import functools
import signal
import socket
from typing import TYPE_CHECKING, Any

from ._signals._names import describe_signal, exit_signal_name

if TYPE_CHECKING:
    from ._results import ProcessFailure

__all__ = [
    "ChildFailedError",
    "MainProcessError",
    "SignalException",
    "WorkerError",
    "fd_limit_error",
]


class SignalException(Exception):
    """A termination signal reached the supervisor while :meth:`PContext.wait` ran.

    Raised by ``wait()`` after the signal was forwarded to every worker and
    the survivors were killed once the grace period ran out: when it
    propagates, no worker is left. Same constructor as torch's
    ``torch.distributed.elastic.multiprocessing.api.SignalException``.

    :param msg: the message.
    :param sigval: the signal received (an ``int`` is converted to
        :class:`signal.Signals`); available as :attr:`sigval`.
    """

    def __init__(self, msg: str, sigval: signal.Signals | int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.sigval: signal.Signals = signal.Signals(sigval)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.msg, self.sigval), self.__dict__)


@functools.lru_cache(maxsize=1)
def _hostname() -> str:
    # getfqdn() may do a DNS lookup: once per process is enough.
    return socket.getfqdn()


class ChildFailedError(Exception):
    """One or more workers failed; ``str(exc)`` is the readable summary.

    The summary (:meth:`format_msg`) has the shape of torch's
    ``ChildFailedError``: a title, the other failures, then the *root cause*,
    the failure observed first (earliest :attr:`ProcessFailure.timestamp`;
    ties go to the lowest rank - the rule of ``aiolaunch._results.root_cause``,
    shared with :func:`aiolaunch.launch` and the agent). Raising it from a function decorated with
    :func:`aiolaunch.record` copies the root cause's error file to the
    caller's ``$TORCHELASTIC_ERROR_FILE``, as torch does.

    :param name: what failed, e.g. the entrypoint's name; it heads the summary.
    :param failures: ``{rank: ProcessFailure}``, at least one.
    :raises ValueError: ``failures`` is empty.
    """

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure; failures is empty")
        self.name = name
        self.failures = failures
        super().__init__(self.format_msg())

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.failures), self.__dict__)

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """The root cause: ``(rank, failure)`` with the earliest timestamp.

        Ties go to the lowest rank (torch takes the first in ``failures``
        order; one deterministic rule for every caller instead).
        """
        from ._results import root_cause

        return root_cause(self.failures)

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """The summary: title, other failures, root cause (torch's layout).

        ::

            ==========================================
            trainer FAILED
            ------------------------------------------
            Failures:
              <NO_OTHER_FAILURES>
            ------------------------------------------
            Root Cause (first observed failure):
            [0]:
              time      : 2024-01-01_12:00:00
              host      : node0
              rank      : 1 (local_rank: 1)
              exitcode  : 1 (pid: 4242)
              error_file: /tmp/run/1/error.json
              traceback : Traceback (most recent call last): ...
            ==========================================

        :param boarder_delim: the character of the outer rules (torch's spelling).
        :param section_delim: the character of the section rules.
        """
        title = f"{self.name} FAILED"
        root_rank, _ = self.get_first_failure()
        root_fmt = ""
        others: list[str] = []
        width = len(title)
        for idx, (rank, failure) in enumerate(self.failures.items()):
            fmt = _format_failure(idx, rank, failure)
            width = max(width, *(len(line) for line in fmt.split("\n")))
            if rank == root_rank:
                root_fmt = fmt
            else:
                others.append(fmt)
        width = min(width, 60)  # torch's upper bound
        boarder = boarder_delim * width
        section = section_delim * width
        other_fmt = "\n".join(others or ["  <NO_OTHER_FAILURES>"])
        # The leading and trailing newlines are torch's: the summary starts on
        # its own line after "ChildFailedError: ".
        return (
            f"\n{boarder}\n{title}\n{section}\nFailures:\n{other_fmt}\n{section}\n"
            f"Root Cause (first observed failure):\n{root_fmt}\n{boarder}"
        )


def _format_failure(idx: int, rank: int, failure: ProcessFailure) -> str:
    # The recorded traceback, else the message (a signal's description, or
    # the error file's message).
    text = failure.py_callstack
    if text is None:
        text = failure.error_message
    # Indent a traceback, or the quoted stderr lines of a message.
    text = text.rstrip("\n").replace("\n", "\n  ")
    sig = exit_signal_name(failure.exitcode)
    sig_str = f" ({sig})" if sig else ""
    # Where the other ranks were (aiolaunch's, with a watchdog): before the
    # traceback, which stays last as torch has it.
    others = getattr(failure, "others", "")  # unpickled from an older version: none
    others_str = ""
    if others:
        others_str = "  others    : " + others.replace("\n", "\n              ") + "\n"
    return (
        f"[{idx}]:\n"
        f"  time      : {failure.timestamp_isoformat()}\n"
        f"  host      : {_hostname()}\n"
        f"  rank      : {rank} (local_rank: {failure.local_rank})\n"
        f"  exitcode  : {failure.exitcode} (pid: {failure.pid}){sig_str}\n"
        f"  error_file: {failure.error_file}\n"
        f"{others_str}"
        f"  traceback : {text}"
    )


class WorkerError(Exception):
    """:func:`aiolaunch.launch`: a worker failed; the other workers were stopped.

    ``str(exc)`` is ``worker[<worker_id>] failed with exitcode=<exitcode>``.
    Like torch's ``mp.spawn`` ``ProcessRaisedException``, it carries what the
    worker raised: :attr:`error_type` (e.g. ``"ValueError"``),
    :attr:`error_message`, :attr:`traceback` (the child's, as text) - each
    ``None`` when the worker died without a Python exception; then
    :attr:`error_message` says how it died (exit code or signal, last stderr
    lines). On Python 3.11+ the child's traceback is also added as a note, so
    an uncaught ``WorkerError`` shows it. :attr:`failure` is the whole
    :class:`ProcessFailure` (``None`` when built by hand).

    :param exitcode: the worker's exit status (``-N``: killed by signal ``N``).
    :param worker_id: the worker's rank.
    :param failure: the worker's failure, whose error fills the fields above.
    """

    def __init__(
        self, exitcode: int, worker_id: int, failure: ProcessFailure | None = None
    ) -> None:
        self.exitcode = exitcode
        self.worker_id = worker_id
        self.failure = failure
        self.error_type: str | None = None
        self.error_message: str | None = None
        self.traceback: str | None = None
        super().__init__(f"worker[{worker_id}] failed with exitcode={exitcode}")
        if failure is None:
            return
        text = failure.error_message
        self.traceback = failure.py_callstack
        if isinstance(failure.message, dict):
            # A recorded exception: "<Type>: <message>".
            kind, sep, rest = text.partition(": ")
            self.error_type, self.error_message = (kind, rest) if sep else (kind, "")
        else:
            self.error_message = text
        note = self.traceback or self.error_message
        if note and hasattr(self, "add_note"):  # Python 3.11+
            self.add_note(f"\n-- worker {worker_id} terminated with the following error:\n{note}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.exitcode, self.worker_id), self.__dict__)


class MainProcessError(Exception):
    """:func:`aiolaunch.launch`: the supervisor got a termination signal.

    The workers were stopped before it was raised. ``str(exc)`` is e.g.
    ``SIGTERM received, exiting due to Terminated.``

    :param signal_no: the signal received (an ``int`` or :class:`signal.Signals`);
        available as :attr:`signal_no`.
    """

    def __init__(self, signal_no: int) -> None:
        self.signal_no = signal_no
        try:
            description = signal.strsignal(signal_no) or "unknown signal"
        except ValueError:  # out of range
            description = "unknown signal"
        super().__init__(f"{describe_signal(signal_no)} received, exiting due to {description}.")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.signal_no,), self.__dict__)


def fd_limit_error(exc: OSError, rank: int, nprocs: int) -> OSError:
    """The ``OSError`` to raise when starting local rank ``rank`` of ``nprocs``
    hit the open-file limit (``exc``: EMFILE or ENFILE): it names the limit
    and the fix."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OSError(
        exc.errno,
        f"{exc.strerror} while starting local rank {rank} of {nprocs} (the {rank} "
        f"started were stopped): the open-file limit RLIMIT_NOFILE is {soft} (hard "
        f"{hard}), and each worker holds up to 4 fds (2 pipes, 2 log files) until the "
        "group ends. Raise it (`ulimit -n 65536`, or resource.setrlimit("
        "resource.RLIMIT_NOFILE, (hard, hard)) in the supervisor) or redirect fewer "
        "streams",
    )
