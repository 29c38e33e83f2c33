"""``--health-check CMD``: a host runs it before it joins each round.

:func:`run_check` runs the command (``/bin/sh -c``) in a session of its own,
with a timeout; whatever it leaves behind is killed with its process group.
It passes with exit status 0; anything else is a reason, in one line (the
exit status or the timeout, and the last line of its output).

:class:`HealthGate` is one agent's: :meth:`~HealthGate.start` starts the
check for the next round in a thread the moment an attempt ends (so it runs
while the workers are stopped and the host is made clean), and
:meth:`~HealthGate.admit` - called where the host is about to join a round,
in the rendezvous thread - takes that result, or runs the check now when
none was started (the first round, a spare called in).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import math
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

__all__ = ["HealthCheck", "HealthGate", "run_check"]

log = logging.getLogger("aiolaunch.agent")

#: the output of a check kept for its reason (its end says most)
_OUTPUT_LIMIT = 4096

# Process groups of checks still running, killed if the agent exits first.
_running: set[int] = set()
_running_lock = threading.Lock()


def _kill_running() -> None:
    with _running_lock:
        groups = list(_running)
    for pgid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


atexit.register(_kill_running)


@dataclass(frozen=True)
class HealthCheck:
    """The command and its time limit.

    :raises ValueError: an empty command or a bad timeout, naming the fix.
    """

    command: str
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.command, str) or not self.command.strip():
            raise ValueError(
                f"health_check={self.command!r} must be a shell command, e.g. 'nvidia-smi -L'"
            )
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, int | float)
            or not (math.isfinite(self.timeout) and self.timeout > 0)
        ):
            raise ValueError(
                f"health_check_timeout={self.timeout!r} must be a number of seconds > 0, e.g. 60"
            )


def run_check(check: HealthCheck, running: set[int] | None = None) -> str | None:
    """Run ``check`` now (blocking); ``None`` when it passed, else why not.

    ``running``: where its process group is noted while it runs (so that it
    can be killed from another thread).
    """
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", check.command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return f"could not run {check.command!r}: {exc}"
    with _running_lock:
        _running.add(proc.pid)
        if running is not None:
            running.add(proc.pid)
    try:
        try:
            out, _ = proc.communicate(timeout=check.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"{check.command!r} did not finish within {check.timeout:g} s (killed)"
    finally:
        # what it started in the background goes with it
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with _running_lock:
            _running.discard(proc.pid)
            if running is not None:
                running.discard(proc.pid)
    took = time.monotonic() - started
    if proc.returncode == 0:
        log.info("health check passed in %.3f s", took)
        return None
    lines = out[-_OUTPUT_LIMIT:].decode(errors="replace").strip().splitlines()
    last = f": {lines[-1].strip()}" if lines else ""
    code = proc.returncode
    how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
    return f"{check.command!r} failed ({how}){last}"


class HealthGate:
    """One agent's health check before each round (see the module docstring)."""

    def __init__(self, check: HealthCheck) -> None:
        self.check = check
        self._pending: concurrent.futures.Future[str | None] | None = None
        self._lock = threading.Lock()
        self._running: set[int] = set()
        self._threads: list[threading.Thread] = []
        #: the last reason a check gave, or None
        self.last_refusal: str | None = None

    def start(self) -> None:
        """Start the check for the next round in a thread (no-op when one runs)."""
        with self._lock:
            if self._pending is not None:
                return
            future: concurrent.futures.Future[str | None] = concurrent.futures.Future()
            self._pending = future

        def run() -> None:
            try:
                future.set_result(run_check(self.check, self._running))
            except BaseException as exc:  # pragma: no cover - run_check catches what it can
                future.set_exception(exc)

        thread = threading.Thread(target=run, name="aiolaunch-health-check", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def cancel(self) -> None:
        """The agent is done: a check still running is killed, and waited for."""
        with self._lock:
            self._pending = None
            groups = list(self._running)
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []

    def admit(self) -> str | None:
        """The started check's result (waited for), or a check run now; ``None``: join."""
        with self._lock:
            pending, self._pending = self._pending, None
        reason = pending.result() if pending is not None else run_check(self.check)
        self.last_refusal = reason
        if reason is not None:
            log.warning("health check failed: %s; this host does not join the round", reason)
        return reason
