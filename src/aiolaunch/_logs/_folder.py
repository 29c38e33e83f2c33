"""The group's folder: where its own files go beside the rank folders, and their lifetime.

One :class:`GroupFolder` per group, made by the context from the log layout
and handed to whoever writes there: the hang forensics (stack dumps, the
report), the live view (``control.sock``, attach sockets) and the ending (the
stop-deadline file). It owns the folder's lifetime: the dump scratch folder
is removed, and a folder made by aiolaunch itself only if nothing worth
keeping was written into it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from .._workers._guardian import clean_up_after
from ._specs import make_temp_dir, prune_empty_dirs

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = ["GroupFolder"]


class GroupFolder:
    """The group's folder (see the module docstring).

    :param root: the folder holding the rank folders, if the log layout knows
        it (``{log_dir}`` in aiolaunch's layout, ``{run}/attempt_N`` in
        torch's); else it is derived from the error files, and where there is
        none (every stream to ``/dev/null``), a temporary folder is made.
    :param error_files: each rank's error file (its rank folder's place).
    """

    def __init__(self, root: str, error_files: Mapping[int, str]) -> None:
        self._error_files = dict(error_files)
        path, self._own = _group_dir(root, self._error_files)
        #: the folder holding the rank folders, ``control.sock`` and the report
        self.path = os.path.abspath(path)
        #: where workers register for stack dumps and dumps are written first;
        #: made by the first worker that registers, not here (a folder costs a
        #: mkdir and an rmdir on the launch path)
        self.stacks_dir = os.path.join(self.path, ".aiolaunch-stacks")
        #: where the group's own small files go (the stop-deadline file)
        self.private_dir = self.path
        if not os.access(self.path, os.W_OK | os.X_OK):
            # A LogsSpecs with an unusual layout may leave no writable group
            # folder: dumps still work from a private one.
            self.stacks_dir = self.private_dir = tempfile.mkdtemp(prefix="aiolaunch_stacks_")
        self._forget: Callable[[], None] = lambda: None
        self._released = False

    @property
    def own(self) -> bool:
        """Whether aiolaunch made the folder itself (no log folder to put it in)."""
        return self._own

    def guard(self) -> None:
        """Have the guardian remove the stacks folder if the supervisor dies before
        :meth:`release` (it may exist by now: the first worker that registers makes it)."""
        self._forget = clean_up_after("T", self.stacks_dir)

    def rank_dir(self, rank: int) -> str:
        """``rank``'s folder: its error file's, else one made now under :attr:`path`
        (logs to ``/dev/null``, or a flat error file)."""
        path = self._error_files.get(rank, "")
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and path != os.devnull and folder != self.path:
            return folder
        d = os.path.join(self.path, str(rank))
        os.makedirs(d, exist_ok=True)
        return d

    def release(self) -> None:
        """Remove the stacks folder, and a folder of our own that holds nothing
        (one with stack dumps or a report is kept). Idempotent."""
        if self._released:
            return
        self._released = True
        _remove_folder(self.stacks_dir)
        self._forget()
        if self._own:  # gone, or kept with dumps or a report; the guardian forgets it
            prune_empty_dirs([self.path])

    def __repr__(self) -> str:
        return f"<GroupFolder {self.path!r} own={self._own}>"


def _remove_folder(path: str) -> None:
    try:
        os.rmdir(path)  # one rmdir: empty, unless a dump wrote into it
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def _group_dir(root: str, error_files: Mapping[int, str]) -> tuple[str, bool]:
    # The folder holding the rank folders; without one (logs to /dev/null), our own.
    if root:
        return root, False
    for path in error_files.values():
        if path and path != os.devnull:
            return os.path.dirname(os.path.dirname(path)), False
    return make_temp_dir("aiolaunch_forensics_"), True
