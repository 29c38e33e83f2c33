"""Where each rank's output goes: torch's ``LogsSpecs`` contract, and ours.

``start_processes(log_dir=..., redirects=..., tee=...)`` lays files out as
``{log_dir}/{rank}/stdout.log|stderr.log|error.json``.

``start_processes(logs_specs=...)`` takes a :class:`DefaultLogsSpecs` (torch's
constructor) or torch's own object, and uses torch's layout
``{log_dir}/{run_id}_<unique>/attempt_{k}/{rank}/...``.

In a :class:`LogsDest`, a stream path of ``""`` means "the console" and
``os.devnull`` means "discard" (torch's conventions).
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._types import Std, StdSpec
from .._validate import check_log_dir_not_file, check_log_dir_writable, check_std, log_dir_error

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "attempt_dir_path",
    "guard_temp_dir",
    "make_run_dir",
    "make_temp_dir",
    "plain_logs_dest",
    "prune_empty_dirs",
]

logger = logging.getLogger("aiolaunch")


#: temporary log roots -> forgetting their cleanup by the guardian
_TEMP_ROOTS: dict[str, Callable[[], None]] = {}


def make_temp_dir(prefix: str) -> str:
    """``tempfile.mkdtemp(prefix=prefix)``, a temporary log root of our own.

    Its empty folders are removed by :func:`prune_empty_dirs` - or, if the
    supervisor dies first (SIGKILL, a signal it does not handle), by the
    guardian, which is told about it here.
    """
    path = _mkdtemp(prefix)
    guard_temp_dir(path)
    return path


def _mkdtemp(prefix: str) -> str:
    """``tempfile.mkdtemp(prefix=prefix)``: a new folder, mode 0700, in
    ``tempfile.gettempdir()``, named ``prefix`` + 12 random hex digits. One
    ``getrandom`` and one ``mkdir``: tempfile's Python name generator cost as
    much as the ``mkdir`` itself on the launch path (~80 us cold)."""
    root = tempfile.gettempdir()
    for _ in range(100):
        path = os.path.join(root, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # pragma: no cover - 2**48 names
            continue
        return path
    raise FileExistsError(  # pragma: no cover
        errno.EEXIST, f"no unused name for a temporary folder {prefix}* in {root}"
    )


def guard_temp_dir(path: str) -> None:
    """Tell the guardian about a temporary log root (again, after a
    :func:`prune_empty_dirs` kept it and a later run uses it). Idempotent."""
    from .._workers._guardian import WATCH_DELAY, clean_up_after

    if path not in _TEMP_ROOTS:  # sent with the workers' registrations: one write
        _TEMP_ROOTS[path] = clean_up_after("P", path, WATCH_DELAY)


def make_run_dir(root: str, run_id: str) -> str:
    """Create ``{root}/{run_id}_<unique>``, the folder of one run: unique, so that
    a ``log_dir`` can be reused (torch's layout)."""
    return tempfile.mkdtemp(prefix=f"{run_id}_", dir=root)


def attempt_dir_path(run_dir: str, attempt: int | str, membership_round: int = 0) -> str:
    """``{run_dir}/attempt_{attempt}`` - with ``_round_{n}`` for a membership
    change of an elastic agent - the folder of one attempt's rank folders."""
    name = f"attempt_{attempt}"
    if membership_round:
        name += f"_round_{membership_round}"
    return os.path.join(run_dir, name)


@dataclass
class LogsDest:
    """Per-rank destinations, keyed by local rank (torch's ``LogsDest``)."""

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = ""
    filtered_stderr: str = ""
    #: Folders aiolaunch created on its own (``log_dir=None``), deepest first:
    #: at close, what holds nothing in them is removed (see :func:`prune_empty_dirs`).
    temp_dirs: list[str] = field(default_factory=list)
    #: The folder holding the rank folders (``""``: not known, e.g. torch's own specs).
    root: str = ""

    @classmethod
    def of(cls, dest: Any) -> LogsDest:
        """Ours, from what a ``LogsSpecs.reify`` returned: ours as it is, or
        torch's ``LogsDest`` (the one place its fields are read: torch before
        2.9 has no ``filtered_*``, and no version has ``temp_dirs`` or ``root``)."""
        if isinstance(dest, cls):
            return dest
        return cls(
            stdouts=dict(dest.stdouts),
            stderrs=dict(dest.stderrs),
            tee_stdouts=dict(dest.tee_stdouts),
            tee_stderrs=dict(dest.tee_stderrs),
            error_files=dict(dest.error_files),
            filtered_stdout=getattr(dest, "filtered_stdout", ""),
            filtered_stderr=getattr(dest, "filtered_stderr", ""),
        )


class LogsSpecs(ABC):
    """Turns per-rank environments into :class:`LogsDest` (torch's ABC).

    :param log_dir: base folder for logs.
    :param redirects: which streams go to files (``Std`` or ``{rank: Std}``).
    :param tee: which streams also go to the console, prefixed.
    :param local_ranks_filter: only these ranks reach the console.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        _check_specs_args(type(self).__name__, log_dir, redirects, tee, local_ranks_filter)
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Create the folders of one attempt and return its destinations.

        May set ``TORCHELASTIC_ERROR_FILE`` in each ``envs[rank]``.
        """

    @property
    @abstractmethod
    def root_log_dir(self) -> str:
        """The base folder."""


class DefaultLogsSpecs(LogsSpecs):
    """torch's default layout: ``{log_dir}/{run_id}_<unique>/attempt_{k}/{rank}/``.

    ``run_id`` and ``k`` come from ``TORCHELASTIC_RUN_ID`` and
    ``TORCHELASTIC_RESTART_COUNT`` in ``envs[0]``. A ``log_dir`` of ``None``
    is a fresh temporary folder, from which what holds nothing is removed when
    a run ends (a later run gets fresh folders); an existing, non-empty one is
    fine (each run gets its own unique sub-folder) and is never pruned. Log
    folders are created without following symlinks planted in a shared
    temporary directory. The arguments are checked before any folder is made.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        # Everything is checked before the folder is created: a bad argument
        # leaves no temporary folder behind.
        _check_specs_args("DefaultLogsSpecs", log_dir, redirects, tee, local_ranks_filter)
        self._temp = False
        if log_dir != os.devnull:
            if not log_dir:
                log_dir = make_temp_dir("aiolaunch_")
                self._temp = True
            else:
                log_dir = os.fspath(log_dir)
                check_log_dir_not_file("log_dir", log_dir)
                check_log_dir_writable("DefaultLogsSpecs(log_dir)", log_dir)
                try:
                    os.makedirs(log_dir, exist_ok=True)
                except OSError as exc:
                    raise log_dir_error("DefaultLogsSpecs(log_dir)", log_dir, exc) from exc
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._run_log_dir: str | None = None

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        nprocs = len(envs)
        env0 = envs.get(0, {})
        run_id = env0.get("TORCHELASTIC_RUN_ID", "test_run_id")
        attempt = env0.get("TORCHELASTIC_RESTART_COUNT", "0")
        if self._root_log_dir == os.devnull:
            dest = LogsDest()
            for rank in range(nprocs):
                dest.stdouts[rank] = dest.stderrs[rank] = os.devnull
                dest.tee_stdouts[rank] = dest.tee_stderrs[rank] = os.devnull
                dest.error_files[rank] = os.devnull
                envs[rank]["TORCHELASTIC_ERROR_FILE"] = ""
            return dest
        if self._temp:
            # An earlier run left nothing and its temporary folders were
            # removed: make fresh ones (never re-create a name in a shared /tmp).
            if not _real_dir(self._root_log_dir):
                self._root_log_dir = make_temp_dir("aiolaunch_")
                self._run_log_dir = None
            else:
                guard_temp_dir(str(self._root_log_dir))  # kept by the last run's prune
                if not _real_dir(self._run_log_dir):
                    self._run_log_dir = None
        if self._run_log_dir is None:
            assert self._root_log_dir is not None
            self._run_log_dir = make_run_dir(self._root_log_dir, run_id)
        attempt_dir = attempt_dir_path(self._run_log_dir, attempt)
        os.makedirs(attempt_dir, exist_ok=True)
        dest = _layout(
            attempt_dir, envs, nprocs, self._redirects, self._tee, self._local_ranks_filter
        )
        if self._temp:
            dest.temp_dirs = [attempt_dir, self._run_log_dir, str(self._root_log_dir)]
        return dest

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(root_log_dir={self._root_log_dir!r}, redirects={self._redirects!r}, "
            f"tee={self._tee!r}, local_ranks_filter={self._local_ranks_filter!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DefaultLogsSpecs):
            return NotImplemented
        return (
            self._root_log_dir == other._root_log_dir
            and self._redirects == other._redirects
            and self._tee == other._tee
            and self._local_ranks_filter == other._local_ranks_filter
        )

    __hash__ = None  # type: ignore[assignment]


def _check_specs_args(
    cls: str, log_dir: Any, redirects: Any, tee: Any, local_ranks_filter: Any
) -> None:
    if log_dir is not None and not isinstance(log_dir, str | os.PathLike):
        raise TypeError(
            f"{cls}(log_dir={log_dir!r}) must be a str path or None, not {type(log_dir).__name__}"
        )
    check_std(f"{cls}(redirects)", redirects)
    check_std(f"{cls}(tee)", tee)
    if local_ranks_filter is not None and (
        isinstance(local_ranks_filter, str | bytes)
        or not hasattr(local_ranks_filter, "__iter__")
        or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in local_ranks_filter
        )
    ):
        raise TypeError(
            f"{cls}(local_ranks_filter={local_ranks_filter!r}) must be a set of local ranks "
            "(ints >= 0), e.g. {0}, or None for every rank"
        )


def prune_empty_dirs(tops: Iterable[str], name: str = "") -> str | None:
    """Remove what holds nothing in folders aiolaunch created on its own.

    Walks each of ``tops`` (deepest first) bottom-up and removes every empty
    directory - rank folders of workers that wrote nothing, empty attempt
    folders, the root if it ends empty. Files are kept, 0-byte logs included
    (as torch keeps them, and ``result.stdouts`` may name them). Symlinks are
    never followed.

    :returns: the outermost folder that was kept because it holds logs or
        error files (logged at INFO), or ``None`` when everything was removed.
    """
    kept: str | None = None
    for top in tops:
        forget = _TEMP_ROOTS.pop(top, None)
        if forget is not None:
            forget()  # cleaned up here: the guardian must not touch it any more
        if _rmdir_quietly(top):
            continue  # the common case, one system call (not a symlink: rmdir fails there)
        if not os.path.isdir(top) or os.path.islink(top):
            continue
        if not _prune(top):
            kept = top
    if kept is not None:
        logger.info("aiolaunch: logs of %s kept in %s", name or "the run", kept)
    return kept


def _prune(path: str) -> bool:
    # rmdir first: an empty folder (most rank folders) costs one syscall, not
    # the open + getdents + close + rmdir of a walk (measured: the walk over
    # 256 rank folders was a visible part of a 256-worker shutdown). Only a
    # folder that is not empty is listed, and only its real subfolders
    # (never a symlink) are pruned in turn.
    if _rmdir_quietly(path):
        return True
    try:
        with os.scandir(path) as it:
            subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return False
    removed = False
    for d in subdirs:
        removed |= _prune(d)
    return removed and _rmdir_quietly(path)


def _real_dir(path: str | None) -> bool:
    return path is not None and os.path.isdir(path) and not os.path.islink(path)


def _rmdir_quietly(path: str) -> bool:
    # rmdir removes only an empty directory (never a symlink's target): a
    # folder that holds anything stays.
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


_OUT, _ERR = int(Std.OUT), int(Std.ERR)


def _bits(spec: StdSpec, nprocs: int) -> list[int]:
    """:func:`to_map` ``(spec, nprocs)`` as plain ints, indexed by rank."""
    if isinstance(spec, int):  # Std is an int subclass
        return [int(spec)] * nprocs
    return [int(spec.get(rank, 0)) for rank in range(nprocs)]


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


def _layout(
    base: str,
    envs: dict[int, dict[str, str]],
    nprocs: int,
    redirects: StdSpec,
    tee: StdSpec,
    local_ranks_filter: set[int] | None,
    flat_errors: bool = False,
) -> LogsDest:
    # Plain ints: an IntFlag's ``|`` and ``&`` make enum members, ~2 us each
    # and six a rank on the launch path.
    redirs, tees = _bits(redirects, nprocs), _bits(tee, nprocs)
    # torch 2.9+'s place for the duplicate filters' files (made only when used)
    dest = LogsDest(
        filtered_stdout=os.path.join(base, "filtered_stdout.log"),
        filtered_stderr=os.path.join(base, "filtered_stderr.log"),
        root=base,
    )
    for rank in range(nprocs):
        rank_dir = os.path.join(base, str(rank))
        rd = redirs[rank] | tees[rank]  # tee implies redirect
        flat = flat_errors and not rd  # no folder: its error file beside the others
        if not flat:
            mkdir_nofollow(rank_dir)
        dest.stdouts[rank] = os.path.join(rank_dir, "stdout.log") if rd & _OUT else ""
        dest.stderrs[rank] = os.path.join(rank_dir, "stderr.log") if rd & _ERR else ""
        if tees[rank] & _OUT:
            dest.tee_stdouts[rank] = dest.stdouts[rank]
        if tees[rank] & _ERR:
            dest.tee_stderrs[rank] = dest.stderrs[rank]
        if local_ranks_filter is not None and rank not in local_ranks_filter:
            dest.tee_stdouts.pop(rank, None)
            dest.tee_stderrs.pop(rank, None)
            if dest.stdouts[rank] == "":
                dest.stdouts[rank] = os.devnull
            if dest.stderrs[rank] == "":
                dest.stderrs[rank] = os.devnull
        error = f"error-{rank}.json" if flat else os.path.join(str(rank), "error.json")
        dest.error_files[rank] = os.path.join(base, error)
        envs[rank]["TORCHELASTIC_ERROR_FILE"] = dest.error_files[rank]
    return dest


def plain_logs_dest(
    log_dir: str,
    envs: dict[int, dict[str, str]],
    redirects: StdSpec,
    tee: StdSpec,
    local_ranks_filter: set[int] | None = None,
    *,
    flat_errors: bool = False,
) -> LogsDest:
    """aiolaunch's own layout: ``{log_dir}/{rank}/...`` (``log_dir`` must exist).

    Every rank folder is made now (a bad ``log_dir`` fails before anything
    starts; a symlink planted there is refused). ``flat_errors`` (a temporary
    ``log_dir``): a rank with no log file gets no folder, its error file is
    ``{log_dir}/error-{rank}.json`` - a folder costs a block, whose removal
    some filesystems discard synchronously.
    """
    return _layout(log_dir, envs, len(envs), redirects, tee, local_ranks_filter, flat_errors)
