"""Rank folders made by one ``/bin/mkdir`` process while workers are spawned."""

from __future__ import annotations

import contextlib
import os
import signal
import stat

from .._workers._spawn import spawn

__all__ = ["BACKGROUND_MIN", "RankDirs", "mkdir_nofollow"]


def mkdir_nofollow(path: str) -> None:
    # mkdir fails on an existing entry (a planted symlink included); an
    # existing real directory of ours is fine.
    try:
        os.mkdir(path)
    except FileExistsError:
        if os.path.islink(path) or not os.path.isdir(path):
            raise FileExistsError(
                f"{path!r} exists and is not a directory aiolaunch created; refusing to follow it"
            ) from None


#: From this many ranks on, start_processes makes rank folders 1.. in the background.
BACKGROUND_MIN = 8

_MKDIR = "/bin/mkdir"


class RankDirs:
    """Makes rank folders with one ``mkdir`` process while workers are spawned.

    Why: on ext4 a ``mkdir`` costs ~0.12 ms of CPU and more of wall time,
    about as much as spawning a worker; made one after the other before the
    first spawn they were a third to a half of a 64-256 worker launch. One
    ``/bin/mkdir -- dir1 dir2 ...`` (spawned once, ~0.3 ms) makes them in
    rank order on another CPU while the loop thread forks workers. Not a
    thread: on Python < 3.12 the GIL is held across ``vfork``, so a thread
    between two ``mkdir`` calls waits for the spawner and falls behind.

    Guarantee kept: a rank's folder exists before its worker is spawned
    (:meth:`wait` checks it with ``lstat``, and makes it itself if the
    process has not got there yet), so ``TORCHELASTIC_ERROR_FILE`` can be
    written from the worker's first instruction, and every folder exists
    once ``start_processes`` returned. A planted symlink or any other
    non-directory is refused with the same error as before (``mkdir`` never
    follows one); the ranks already started are then stopped.
    """

    def __init__(self, paths: dict[int, str]) -> None:
        self._paths = paths  # rank -> folder, in rank order
        self._last = max(paths)
        self._pid = 0
        self._pidfd = -1
        try:
            devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            try:
                self._pid = spawn(
                    [_MKDIR, "--", *paths.values()], {}, stdout=devnull, stderr=devnull
                )
            finally:
                os.close(devnull)
        except OSError:  # no /bin/mkdir: wait() makes each folder itself
            return
        try:
            # Killed through a pidfd only: never a recycled pid.
            self._pidfd = os.pidfd_open(self._pid)
        except (AttributeError, OSError):
            self._pidfd = -1

    def wait(self, rank: int) -> None:
        """Return once ``rank``'s folder exists (at once for a rank not in the batch).

        :raises FileExistsError: something other than a directory is there.
        :raises OSError: the folder could not be made.
        """
        path = self._paths.get(rank)
        if path is None:
            return
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            mkdir_nofollow(path)  # the process is not there yet (or failed)
            return
        if not stat.S_ISDIR(st.st_mode):
            mkdir_nofollow(path)  # raises the refusal (a symlink, a file)
        if rank == self._last:
            self.close()  # ranks start in order: every folder exists; reap it now

    def close(self) -> None:
        """Stop the ``mkdir`` process and reap it: no folder appears after
        this (called when the group ends, and when its start failed).
        Idempotent. Once every rank was waited for, every folder exists and
        stopping it changes nothing."""
        if not self._pid:
            return
        if self._pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            os.close(self._pidfd)
            self._pidfd = -1
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self._pid, 0)
        self._pid = 0
