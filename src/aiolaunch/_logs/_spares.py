"""Spare temporary log roots: the emptied root of one group becomes the next one's.

Where ext4 is mounted with ``discard`` (this project's hosts), removing a
folder frees its block and the kernel discards it synchronously: the
``rmdir`` of a group's emptied temporary root blocked 0.35-0.5 ms in
``blkdev_issue_discard`` (perf, #26) - a quarter of ``close()`` of 8 workers
- and the ``mkdir`` of the next root cost 0.1-0.2 ms on the launch path. A
rename costs neither. So a group whose temporary root ends empty moves it,
renamed ``.spare-<pid>-<hex>``, into ``{tmp}/aiolaunch-<uid>`` (the per-user
folder of running groups, which lives as long as the process anyway:
``_control``), and the next temporary root this process makes in ``{tmp}``
is that folder renamed to its new name.

Guarantees: a spare is empty when it is put aside (listed first), private
(mode 0700, in a folder of this user that others cannot enter), used only by
the process that made it (never by a forked child), at most
:data:`MAX_SPARES` per process and temp folder; it is removed when the
process exits (``atexit``), or by the guardian if the process is killed (it
knows the per-user folder, so that a spare is not one registration and one
removal of it per group). Anything unusual (the per-user folder unsafe or
gone, a rename that fails) falls back to ``mkdir`` / ``rmdir``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["MAX_SPARES", "keep_spare", "take_spare"]

#: Spare roots one process keeps at most per temp folder (groups that end at
#: the same time).
MAX_SPARES = 2


class _Spares:
    """This process's spares: ``(tmp, path)`` - the folder they serve and where
    the spare is; and per ``tmp`` its per-user folder (checked once) with the
    call that forgets the folder's guardian registration."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []
        self.folders: dict[str, tuple[str, Callable[[], None]]] = {}


_lock = threading.Lock()
_state = _Spares()


def _after_fork_in_child() -> None:
    global _lock, _state
    _lock = threading.Lock()  # another thread may have held it at the fork
    _state = _Spares()  # the parent's spares are not the child's
    # (an atexit handler inherited from the parent then removes the child's own)


os.register_at_fork(after_in_child=_after_fork_in_child)


def take_spare(path: str) -> bool:
    """Rename a spare of this process to ``path``, a new temporary root in the
    folder that holds it; whether it did (else the caller makes ``path``)."""
    tmp = os.path.dirname(path)
    with _lock:
        spares = _state
        for i, (where, _) in enumerate(spares.items):
            if where == tmp:
                spare = spares.items.pop(i)[1]
                break
        else:
            return False
    try:
        os.rename(spare, path)
    except OSError:  # gone (a temp cleaner), or the name is taken: make a new one
        with contextlib.suppress(OSError):
            os.rmdir(spare)
        return False
    return True  # the caller registers ``path`` with the guardian


def keep_spare(path: str) -> bool:
    """Put the empty temporary root ``path`` aside for the next group of this
    process; whether it did (else the caller removes it). A folder that holds
    anything is never kept."""
    tmp = os.path.dirname(path)
    with _lock:
        spares = _state
        if sum(where == tmp for where, _ in spares.items) >= MAX_SPARES:
            return False
        folder = _folder(spares, tmp)
        if folder is None:
            return False
        try:
            with os.scandir(path) as entries:
                if next(entries, None) is not None:
                    return False
        except OSError:  # gone already, or not a folder we can read
            return False
        spare = os.path.join(folder, f".spare-{os.getpid()}-{os.urandom(6).hex()}")
        try:
            os.rename(path, spare)
        except OSError:  # e.g. the per-user folder was removed meanwhile
            spares.folders.pop(tmp, None)  # checked again next time
            return False
        spares.items.append((tmp, spare))
    return True


def _folder(spares: _Spares, tmp: str) -> str | None:
    """``{tmp}/aiolaunch-<uid>``, made if missing, if it is a private folder of
    this user (another user could have planted it in a shared ``/tmp``)."""
    known = spares.folders.get(tmp)
    if known is not None:
        return known[0]
    from .._live._control import unsafe_registry
    from .._workers._guardian import clean_up_after

    folder = os.path.join(tmp, f"aiolaunch-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    # unsafe_registry() passes a folder that is gone (removed meanwhile): isdir.
    if unsafe_registry(folder) is not None or not os.path.isdir(folder):
        return None
    if not spares.folders:
        atexit.register(_remove_spares)
    # Should this process die - or end without atexit (os._exit, as a forked
    # child does) - the guardian removes the empty folders in it: our spares
    # (another process's too, which then makes its next root with mkdir), and
    # the folder itself if that leaves it empty; never a registry entry (a
    # symlink). Sent at once, not batched: such a process may end right after
    # this close().
    spares.folders[tmp] = (folder, clean_up_after("P", folder))
    return folder


def _remove_spares() -> None:
    """At exit: remove this process's spares, then their per-user folders if
    nothing else is listed there (as ``_control`` does for its entries)."""
    with _lock:
        items, _state.items = _state.items, []
        folders, _state.folders = list(_state.folders.values()), {}
    for _, spare in items:
        with contextlib.suppress(OSError):
            os.rmdir(spare)
    for folder, forget in folders:
        with contextlib.suppress(OSError):  # fails harmlessly while others are listed
            os.rmdir(folder)
        forget()
