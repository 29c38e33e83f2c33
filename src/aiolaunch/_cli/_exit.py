"""The command line's exit status and termination message: what schedulers read.

=====================  ==================================================
exit status            meaning
=====================  ==================================================
``0``                  every worker succeeded
``1``                  the workers failed (after ``--max-restarts``), as
                       torchrun; with ``--exit-code root-cause`` the root
                       cause's own code instead (``128 + N`` where signal
                       ``N`` killed it)
``2`` (do not retry)   bad arguments, or the script, module or binary to
                       run does not exist: nothing started, and a retry
                       of the same command fails the same way; or a crash
                       loop (``--max-no-progress-restarts``: attempts in
                       a row without progress), named in the termination
                       message
``3`` (host excluded)  this host may not take part: it is quarantined
                       (``--quarantine-after``) or its ``--health-check``
                       failed until the job ended; the job goes on (or
                       ended) on the other hosts. Retry on another host,
                       not here
``128 + N``            this process was stopped by signal ``N`` (143 for
                       SIGTERM, 130 for SIGINT, 129 SIGHUP, 131 SIGQUIT);
                       the workers were stopped first
=====================  ==================================================

Schedulers (Slurm's ``ExitCode``, a Kubernetes ``podFailurePolicy``, a retry
wrapper) read these; docs/schedulers.md keys its examples on them and
``tests/test_exit_status.py`` checks each against the real command.

The termination message: on a non-zero exit, one short text (the root cause:
rank, exit code, error) is written to ``$AIOLAUNCH_TERMINATION_LOG`` - or,
when that is unset, to ``/dev/termination-log`` if it exists and is
writable (Kubernetes shows it as the container's termination reason). At
most :data:`TERMINATION_LOG_LIMIT` bytes (Kubernetes' own limit); an empty
``AIOLAUNCH_TERMINATION_LOG`` turns it off.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._results import ProcessFailure

__all__ = [
    "EXIT_DO_NOT_RETRY",
    "EXIT_FAILED",
    "EXIT_HOST_EXCLUDED",
    "EXIT_MODES",
    "TERMINATION_LOG_LIMIT",
    "failure_exit_status",
    "failure_message",
    "signal_exit_status",
    "termination_log_path",
    "write_termination_message",
]

log = logging.getLogger("aiolaunch.cli")

#: the workers failed (torchrun's status for every failure)
EXIT_FAILED = 1
#: a failure a retry cannot fix: bad arguments, nothing to run (argparse's 2), a crash loop
EXIT_DO_NOT_RETRY = 2
#: this host is kept out of the job (quarantined, or its health check failed)
EXIT_HOST_EXCLUDED = 3
#: ``--exit-code`` values: ``torchrun`` (1 for any worker failure) or ``root-cause``
EXIT_MODES = ("torchrun", "root-cause")
#: Kubernetes reads at most this many bytes of a termination message
TERMINATION_LOG_LIMIT = 4096
#: the file Kubernetes reads by default (``terminationMessagePath``)
DEFAULT_TERMINATION_LOG = "/dev/termination-log"


def signal_exit_status(signum: int) -> int:
    """The status of a run stopped by signal ``signum``: ``128 + signum`` (the shell's rule)."""
    return 128 + signum


def failure_exit_status(failure: ProcessFailure, mode: str) -> int:
    """The status of a run whose root cause is ``failure``.

    ``mode="torchrun"``: 1. ``mode="root-cause"``: the worker's own exit code,
    ``128 + N`` for a worker killed by signal ``N``, and 1 where that would be
    0 or out of range (a failure always exits non-zero).
    """
    if mode == "torchrun":
        return EXIT_FAILED
    if mode != "root-cause":
        raise ValueError(f"--exit-code={mode!r} must be one of {', '.join(EXIT_MODES)}")
    code = failure.exitcode
    if code < 0:
        return signal_exit_status(-code)
    return code if 0 < code < 256 else EXIT_FAILED


def failure_message(name: str, failures: Mapping[int, ProcessFailure]) -> str:
    """The root cause in a few lines: what failed, where, how, and its error.

    ``name`` is the entrypoint's name; ``failures`` is keyed by global rank.
    """
    from .._results import root_cause
    from .._signals._names import exit_signal_name

    rank, failure = root_cause(failures)
    sig = exit_signal_name(failure.exitcode)
    how = f"exitcode {failure.exitcode}" + (f" ({sig})" if sig else "")
    others = len(failures) - 1
    head = (
        f"{name} failed: rank {rank} (local_rank {failure.local_rank}) on "
        f"{socket.gethostname()}, {how}, pid {failure.pid}"
    )
    if others:
        head += f"; {others} other rank(s) failed after it"
    text = failure.py_callstack or failure.error_message
    return f"{head}\n{text.strip()}" if text and text.strip() else head


def termination_log_path(environ: Mapping[str, str] | None = None) -> str | None:
    """Where the termination message goes, or ``None`` (nowhere).

    ``$AIOLAUNCH_TERMINATION_LOG`` when set (empty: nowhere), else
    ``/dev/termination-log`` when it exists and is writable.
    """
    env = os.environ if environ is None else environ
    path = env.get("AIOLAUNCH_TERMINATION_LOG")
    if path is not None:
        return path or None
    if os.path.exists(DEFAULT_TERMINATION_LOG) and os.access(DEFAULT_TERMINATION_LOG, os.W_OK):
        return DEFAULT_TERMINATION_LOG
    return None


def _clip(text: str, limit: int) -> bytes:
    """``text`` in at most ``limit`` UTF-8 bytes: the head line and the tail
    (the end of a traceback says most), cut at character boundaries.

    A line longer than a quarter of ``limit`` is first shortened in its
    middle, so that a huge exception message (the traceback's last line)
    keeps its start - the exception's type - and its end.
    """
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return data
    text = "\n".join(_shorten(line, limit // 4) for line in text.split("\n"))
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return data
    head, _, rest = text.partition("\n")
    marker = "\n[...]\n"
    head_b = head.encode("utf-8", "replace")[: limit // 2]
    room = limit - len(head_b) - len(marker)
    tail_b = rest.encode("utf-8", "replace")[-room:] if room > 0 else b""
    out = head_b.decode("utf-8", "ignore") + marker + tail_b.decode("utf-8", "ignore")
    return out.encode("utf-8")[:limit]


def _shorten(line: str, limit: int) -> str:
    """``line`` in at most ``limit`` UTF-8 bytes (about): its start and its end."""
    data = line.encode("utf-8", "replace")
    marker = " [...] "
    if len(data) <= limit or limit <= 2 * len(marker):
        return line
    half = (limit - len(marker)) // 2
    return data[:half].decode("utf-8", "ignore") + marker + data[-half:].decode("utf-8", "ignore")


def write_termination_message(text: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Write ``text`` (clipped to 4096 bytes) as the termination message.

    :returns: the path written, or ``None`` (no destination, or it failed:
        logged, never raised - the exit status matters more).
    """
    path = termination_log_path(environ)
    if path is None:
        return None
    try:
        with open(path, "wb") as f:
            f.write(_clip(text, TERMINATION_LOG_LIMIT))
    except OSError as exc:
        log.warning("could not write the termination message to %s: %s", path, exc)
        return None
    return path
