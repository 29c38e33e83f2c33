"""The stop-deadline file: when survivors of a stopping group get SIGKILL.

Every worker's environment names it (``$AIOLAUNCH_STOP_DEADLINE_FILE``) beside
the grace period (``$AIOLAUNCH_SHUTDOWN_TIMEOUT``), so a worker's own cleanup
can see how long it has. The file is empty while the group runs; before the
death signal goes out the supervisor writes the wall-clock time (Unix
seconds) at which survivors get SIGKILL - rewritten to "now" when a second
signal escalates - and it is removed once the group is gone. One small class,
owned by the group's ending (``_ending.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

__all__ = ["SHUTDOWN_TIMEOUT_ENV", "STOP_DEADLINE_FILE_ENV", "StopDeadline"]

logger = logging.getLogger("aiolaunch")

#: In every worker's environment: the grace (seconds) between the death signal
#: and SIGKILL when ``wait()`` stops the group.
SHUTDOWN_TIMEOUT_ENV = "AIOLAUNCH_SHUTDOWN_TIMEOUT"
#: In every worker's environment: a file that holds, once the group is being
#: stopped, the wall-clock time (Unix seconds) at which survivors get SIGKILL.
STOP_DEADLINE_FILE_ENV = "AIOLAUNCH_STOP_DEADLINE_FILE"
_NAME = "stop_deadline"


class StopDeadline:
    """The deadline file ``{folder}/stop_deadline`` of one group.

    ``folder`` is the group's private folder (so a supervisor killed by
    SIGKILL leaves the file there, not in the temp folder); it may not exist
    yet when workers start: :meth:`make` creates the empty file as
    ``start_processes`` returns, off the launch path. No method raises: a
    worker without a deadline file still gets its death signal.
    """

    def __init__(self, folder: str, grace: float) -> None:
        self.path = os.path.join(folder, _NAME)
        self.grace = float(grace)
        self._removed = False

    def env(self) -> dict[str, str]:
        """What every worker's environment gets."""
        return {
            SHUTDOWN_TIMEOUT_ENV: repr(self.grace),
            STOP_DEADLINE_FILE_ENV: "" if self._removed else self.path,
        }

    def make(self) -> None:
        """Make the (empty) file."""
        if self._removed:
            return
        try:
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        except OSError as exc:  # the workers run on; set() tries again
            logger.warning("aiolaunch: no stop deadline file for the workers: %s", exc)

    def set(self, grace: float) -> None:
        """Record that survivors get SIGKILL ``grace`` seconds from now."""
        if self._removed:
            return
        tmp = self.path + ".tmp"
        try:
            try:
                f = open(tmp, "w")  # noqa: SIM115
            except FileNotFoundError:
                # Stopped before the folder was made (make's caller).
                os.makedirs(os.path.dirname(tmp), mode=0o700, exist_ok=True)
                f = open(tmp, "w")  # noqa: SIM115
            with f:
                f.write(f"{time.time() + max(0.0, grace):.3f}\n")
            os.replace(tmp, self.path)  # a worker never reads half of it
        except OSError as exc:  # e.g. /tmp full: the signal still goes out
            logger.warning("aiolaunch: could not write the stop deadline: %s", exc)

    def remove(self) -> None:
        """Remove the file (idempotent; :meth:`set` does nothing afterwards)."""
        if not self._removed:
            self._removed = True
            with contextlib.suppress(OSError):
                os.unlink(self.path)
