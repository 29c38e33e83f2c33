"""``StopDeadline``: the stop-deadline file the workers read, on real files."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from aiolaunch._deadline import STOP_DEADLINE_FILE_ENV, StopDeadline
from aiolaunch._workers._guardian import guardian

if TYPE_CHECKING:
    from pathlib import Path


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_made_empty_then_written_in_place_then_rewritten(tmp_path: Path) -> None:
    guardian()  # its pipe stays open (the file's cleanup is registered there)
    before = _fds()
    d = StopDeadline(str(tmp_path), 7.0)
    path = tmp_path / ".aiolaunch-stop_deadline"
    assert d.env()[STOP_DEADLINE_FILE_ENV] == str(path)
    d.make()
    assert path.read_text() == "" and (path.stat().st_mode & 0o777) == 0o600
    inode = path.stat().st_ino
    d.set(5.0)
    assert abs(float(path.read_text()) - (time.time() + 5)) < 2
    assert path.stat().st_ino == inode, "the first write goes into the file made at start"
    d.make()  # late (the group stopped first): changes nothing
    d.set(0.0)  # a second signal: now
    assert abs(float(path.read_text()) - time.time()) < 2
    d.remove()
    assert not path.exists()
    assert d.env()[STOP_DEADLINE_FILE_ENV] == ""
    d.set(3.0)  # after remove: nothing
    assert not path.exists()
    assert _fds() == before, "the kept-open file is closed"


def test_set_before_make_and_without_the_folder(tmp_path: Path) -> None:
    d = StopDeadline(str(tmp_path), 1.0)
    d.set(2.0)  # stopped before make() ran: the file is made then
    assert abs(float((tmp_path / ".aiolaunch-stop_deadline").read_text()) - time.time() - 2) < 2
    d.remove()
    later = tmp_path / "not" / "yet"
    d2 = StopDeadline(str(later), 1.0)
    d2.make()  # no folder: a warning, no file, no error
    d2.set(4.0)  # made with its folder
    assert abs(float((later / ".aiolaunch-stop_deadline").read_text()) - time.time() - 4) < 2
    d2.remove()
    assert not (later / ".aiolaunch-stop_deadline").exists()


def test_a_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep")
    (tmp_path / ".aiolaunch-stop_deadline").symlink_to(target)
    d = StopDeadline(str(tmp_path), 1.0)
    d.make()
    d.set(1.0)  # O_NOFOLLOW refuses the link; the rename replaces it
    assert target.read_text() == "keep"
    d.remove()
