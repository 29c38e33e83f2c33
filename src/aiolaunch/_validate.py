"""Every pre-spawn check. Nothing here has a side effect.

Each message names the argument, the bad value and the fix.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
import signal
import stat
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ._types import START_METHODS, Std

__all__ = [
    "START_METHODS",
    "check_port",
    "check_seconds",
    "check_signal",
    "check_start_inputs",
    "check_std",
    "pickle_payloads",
]


# A file name holds 255 bytes: "aiolaunch_{name}_" + mkdtemp's 8 characters.
_MAX_TEMP_NAME = 255 - len("aiolaunch__") - 8


def _check_rank_keys(what: str, d: Mapping[int, Any], nprocs: int) -> None:
    keys = set(d)
    want = set(range(nprocs))
    if keys != want:
        missing = sorted(want - keys)
        extra = sorted(keys - want, key=repr)
        detail = []
        if missing:
            detail.append(f"missing {missing}")
        if extra:
            detail.append(f"unexpected {extra}")
        raise ValueError(
            f"{what} must have exactly the local ranks {{0, ..., {nprocs - 1}}} of args as keys "
            f"({', '.join(detail)}); give one entry per worker"
        )


def check_std(what: str, value: Any, nprocs: int | None = None) -> None:
    """Check a ``redirects``/``tee`` setting: a :class:`Std` or ``{rank: Std}``.

    Values outside ``Std.ALL`` (``Std(8)``) and plain ints are refused;
    ``nprocs=None`` (a ``LogsSpecs``, built before the group size is known)
    only requires ranks to be ints >= 0.
    """
    if isinstance(value, Std):
        _check_std_value(what, value)
        return
    if isinstance(value, Mapping):
        for rank, std in value.items():
            if (
                isinstance(rank, bool)
                or not isinstance(rank, int)
                or rank < 0
                or (nprocs is not None and rank >= nprocs)
            ):
                local = "an int >= 0" if nprocs is None else f"0..{nprocs - 1}"
                raise ValueError(
                    f"{what} has rank {rank!r}, but local ranks are {local}; drop it or fix args"
                )
            if not isinstance(std, Std):
                raise TypeError(f"{what}[{rank}] is {std!r}; use aiolaunch.Std (e.g. Std.ALL)")
            _check_std_value(f"{what}[{rank}]", std)
        return
    raise TypeError(
        f"{what}={value!r} is neither a Std nor a {{rank: Std}} dict; "
        "use e.g. Std.ALL or {0: Std.ERR} (Std.from_str parses '0:3,1:0')"
    )


def _check_std_value(what: str, std: Std) -> None:
    # IntFlag keeps unknown bits (Std(8) is a "Std"), so check the range.
    if not 0 <= int(std) <= int(Std.ALL):
        raise ValueError(
            f"{what}={int(std)} is not a Std: use Std.NONE, Std.OUT, Std.ERR or Std.ALL (0-3)"
        )


def check_seconds(what: str, value: Any, *, forever: str = "") -> None:
    """Check a duration: a real number of seconds >= 0, or ``None``.

    ``forever``: what ``None`` (and, where allowed, a negative value) means;
    when given, negative values are accepted too (``wait(timeout=-1)``).
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{what}={value!r} must be a number of seconds (int or float) or None, "
            f"not {type(value).__name__}; e.g. {what}=1.5"
        )
    if math.isnan(value) or (value < 0 and not forever):
        raise ValueError(
            f"{what}={value!r} must be a number of seconds >= 0"
            + (f" ({forever})" if forever else " (or None to wait without a limit)")
        )


def check_signal(what: str, value: Any) -> None:
    """Check a signal to send: a valid signal number other than 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{what}={value!r} must be a signal number, e.g. signal.SIGTERM or signal.SIGKILL"
        )
    try:
        signal.Signals(value)
    except ValueError:
        ok = False
    else:
        ok = value != 0
    if not ok:
        raise ValueError(
            f"{what}={value!r} is not a signal that stops a process; "
            "use signal.SIGTERM (the default), signal.SIGINT or signal.SIGKILL"
        )


def check_port(what: str, value: Any, *, zero: bool = False) -> None:
    """Check a TCP port: an int in 1..65535 (0 too where ``zero``: "any free port")."""
    low = 0 if zero else 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{what} must be an int TCP port ({low}..65535), got {value!r} "
            f"({type(value).__name__}); e.g. 29500"
        )
    if not low <= value <= 65535:
        raise ValueError(f"{what}={value!r} is not a TCP port; use {low}..65535, e.g. 29500")


def check_log_dir_writable(what: str, path: str) -> None:
    """Refuse a folder that cannot be created or written, before anything is created.

    Checks the nearest existing ancestor: a file there, or no write access
    (not detected for root: creation errors are translated where they happen).
    """
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise NotADirectoryError(
            f"{what}={path!r} cannot be created: {probe!r} is not a directory; "
            "pass a folder under a writable directory, or None"
        )
    target_exists = probe == os.path.abspath(path)
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "it is not writable" if target_exists else f"{probe!r} is not writable"
        raise PermissionError(
            f"{what}={path!r} cannot be used: {where}; pass a folder you can write, "
            "or None for a temporary one"
        )


def check_log_dir_not_file(what: str, path: str) -> None:
    """Refuse a log folder that exists as a file (:class:`NotADirectoryError`
    naming ``what``): the one rule for ``start_processes``, ``DefaultLogsSpecs``
    and the agent."""
    if os.path.isfile(path):
        raise NotADirectoryError(
            f"{what}={path!r} is a file; pass a directory (created if missing) or None"
        )


def log_dir_error(what: str, path: str, exc: OSError) -> OSError:
    """A clear error for a log folder whose creation failed (``exc`` as cause)."""
    return type(exc)(
        exc.errno,
        f"{what}={path!r} could not be created ({exc.strerror}); pass a folder you "
        "can write, or None for a temporary one",
    )


def check_start_inputs(
    *,
    name: Any,
    entrypoint: Any,
    args: Any,
    envs: Any,
    start_method: Any,
    log_dir: Any,
    redirects: Any,
    tee: Any,
    logs_specs: Any,
    log_line_prefixes: Any,
    shutdown_timeout: Any,
    console_dedup: Any = None,
) -> None:
    """Raise before anything starts if any argument of ``start_processes`` is bad."""
    if not isinstance(name, str):
        raise TypeError(
            f"name must be a str (it prefixes console lines), got {type(name).__name__}"
        )
    if not (callable(entrypoint) or isinstance(entrypoint, str)):
        raise TypeError(
            f"entrypoint must be a callable (function workers) or a str naming a binary "
            f"(binary workers), got {type(entrypoint).__name__}"
        )
    if not isinstance(args, Mapping):
        raise TypeError(f"args must be a dict {{local_rank: tuple}}, got {type(args).__name__}")
    if not args:
        raise ValueError("args is empty: pass {0: (...), ..., n-1: (...)}, one tuple per worker")
    nprocs = len(args)
    _check_rank_keys("args", args, nprocs)
    for rank, a in args.items():
        if not isinstance(a, tuple | list):
            raise TypeError(
                f"args[{rank}] is a {type(a).__name__}; pass a tuple of arguments, e.g. ({a!r},)"
            )
    if not isinstance(envs, Mapping):
        raise TypeError(
            f"envs must be a dict {{local_rank: {{str: str}}}}, got {type(envs).__name__}"
        )
    _check_rank_keys("envs", envs, nprocs)
    for rank, env in envs.items():
        if not isinstance(env, Mapping):
            raise TypeError(f"envs[{rank}] must be a dict of str to str, got {type(env).__name__}")
        for k, v in env.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"envs[{rank}] has a non-str key {k!r} ({type(k).__name__}); "
                    "environment names must be str"
                )
            if not isinstance(v, str):
                raise TypeError(
                    f"envs[{rank}][{k!r}] is {v!r} ({type(v).__name__}); environment values "
                    f"must be str: use str({v!r})"
                )
            if not k or "=" in k or "\0" in k:
                raise ValueError(
                    f"envs[{rank}] has the name {k!r}: an environment name must be non-empty "
                    "and contain neither '=' nor a NUL byte; fix the key"
                )
            if "\0" in v:
                raise ValueError(
                    f"envs[{rank}][{k!r}] contains a NUL byte, which an environment value "
                    "cannot hold; remove it (pass binary data through a file)"
                )
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method={start_method!r} is not one of {', '.join(START_METHODS)}; "
            "use 'spawn' (the default) unless you know you need another"
        )
    if start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"start_method={start_method!r} is not available on this platform; use 'spawn'"
        )
    if isinstance(entrypoint, str):
        _check_binary(entrypoint)
        for rank, a in args.items():
            for i, item in enumerate(a):
                if "\0" in str(item):
                    raise ValueError(
                        f"args[{rank}][{i}] contains a NUL byte, which a command-line "
                        "argument cannot hold; remove it (pass binary data through a file)"
                    )
    elif start_method == "fork":
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        try:
            initialized = bool(cuda is not None and cuda.is_initialized())
        except Exception:
            initialized = False
        if initialized:
            raise ValueError(
                "start_method='fork' cannot be used after CUDA was initialized in this "
                "process (forked children cannot use CUDA); use start_method='spawn'"
            )
    if logs_specs is not None:
        if log_dir is not None or redirects != Std.NONE or tee != Std.NONE:
            raise ValueError(
                "pass either logs_specs or log_dir/redirects/tee, not both; logs_specs "
                "carries its own log_dir, redirects and tee"
            )
        if not callable(getattr(logs_specs, "reify", None)):
            raise TypeError(
                "logs_specs must be an aiolaunch.LogsSpecs (or torch's); "
                f"got {type(logs_specs).__name__}"
            )
    else:
        check_std("redirects", redirects, nprocs)
        check_std("tee", tee, nprocs)
        if log_dir is None:
            bad = [c for c in (os.sep, "\0") if c in name]
            if bad:
                raise ValueError(
                    f"name={name!r} contains {bad[0]!r}, which cannot be part of the "
                    "temporary log folder's name (log_dir=None); use a name without it, "
                    "or pass log_dir"
                )
            if len(os.fsencode(name)) > _MAX_TEMP_NAME:
                raise ValueError(
                    f"name={name[:20]!r}... is {len(os.fsencode(name))} bytes long, too long "
                    f"for the temporary log folder's name (log_dir=None: at most "
                    f"{_MAX_TEMP_NAME}); use a shorter name, or pass log_dir"
                )
        else:
            if not isinstance(log_dir, str | os.PathLike):
                raise TypeError(f"log_dir must be a str path or None, got {type(log_dir).__name__}")
            path = os.fspath(log_dir)
            if not isinstance(path, str) or "\0" in path:
                raise ValueError(f"log_dir={path!r} must be a str path without NUL bytes")
            check_log_dir_not_file("log_dir", path)
            if os.path.isdir(path) and os.listdir(path):
                raise ValueError(
                    f"log_dir={path!r} is not empty; pass an empty or new directory, or None "
                    "for a fresh temporary one (logs_specs=DefaultLogsSpecs(...) may reuse "
                    "a folder: each run gets its own sub-folder)"
                )
            check_log_dir_writable("log_dir", path)
    if log_line_prefixes is not None:
        if not isinstance(log_line_prefixes, Mapping):
            raise TypeError("log_line_prefixes must be a dict {local_rank: str} or None")
        for rank, prefix in log_line_prefixes.items():
            if rank not in args:
                raise ValueError(
                    f"log_line_prefixes has rank {rank!r}, but local ranks are 0..{nprocs - 1}"
                )
            if not isinstance(prefix, str):
                raise TypeError(f"log_line_prefixes[{rank}] must be a str, got {prefix!r}")
    if (
        isinstance(shutdown_timeout, bool)
        or not isinstance(shutdown_timeout, int | float)
        or not shutdown_timeout >= 0
    ):
        raise ValueError(
            f"shutdown_timeout={shutdown_timeout!r} must be a number of seconds >= 0 "
            "(the grace between the death signal and SIGKILL)"
        )

    if console_dedup is not None and (
        isinstance(console_dedup, bool)
        or not isinstance(console_dedup, int | float)
        or not 0 <= console_dedup <= 60
    ):
        raise ValueError(
            f"console_dedup={console_dedup!r} must be a window in seconds between 0 and 60 "
            "(e.g. 0.05), or None to show every rank's lines"
        )


def _check_binary(entrypoint: str) -> None:
    if not entrypoint:
        raise ValueError("entrypoint is an empty str; name a binary, e.g. 'python3'")
    if "\0" in entrypoint:
        raise ValueError(f"entrypoint={entrypoint!r} contains a NUL byte; name a binary")
    words = entrypoint.split()
    if len(words) > 1 and _binary_exists(words[0]) and not _binary_exists(entrypoint):
        raise FileNotFoundError(
            f"entrypoint={entrypoint!r} names a binary and its arguments; the arguments go "
            f"in args: entrypoint={words[0]!r}, args={{0: {tuple(words[1:])!r}, ...}}"
        )
    if os.sep in entrypoint:
        try:  # one stat for both checks below (this runs on every call)
            mode = os.stat(entrypoint).st_mode
        except (OSError, ValueError):
            mode = 0
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(
                f"entrypoint={entrypoint!r} is a directory; name the binary inside it "
                "(e.g. entrypoint='/path/to/dir/program')"
            )
        if not stat.S_ISREG(mode):
            raise FileNotFoundError(
                f"entrypoint={entrypoint!r} does not exist; fix the path to the binary"
            )
        if not os.access(entrypoint, os.X_OK):
            raise PermissionError(
                f"entrypoint={entrypoint!r} is not executable; chmod +x it or run it "
                "through its interpreter (e.g. entrypoint='python3', args=(path, ...))"
            )
    elif shutil.which(entrypoint) is None:
        raise FileNotFoundError(
            f"entrypoint={entrypoint!r} was not found on PATH; pass its full path or fix PATH"
        )


def _binary_exists(entrypoint: str) -> bool:
    if os.sep in entrypoint:
        return os.path.isfile(entrypoint)
    return shutil.which(entrypoint) is not None


def pickle_payloads(
    entrypoint: Callable[..., Any], args: Mapping[int, Any]
) -> tuple[bytes, dict[int, bytes]]:
    """Serialize the entrypoint once and ``args[rank]`` per rank, by value where needed.

    :raises TypeError: naming the rank and argument that cannot be pickled,
        the pickling error as ``__cause__``.
    """
    import cloudpickle

    try:
        fn_bytes = cloudpickle.dumps(entrypoint)
    except Exception as exc:
        raise TypeError(
            f"entrypoint {entrypoint!r} cannot be pickled for a worker process: {exc}. "
            "Define it at module level or avoid capturing unpicklable objects "
            "(locks, sockets, open files)"
        ) from exc
    payloads: dict[int, bytes] = {}
    for rank in sorted(args):
        a = tuple(args[rank])
        try:
            args_bytes = cloudpickle.dumps(a)
        except Exception as exc:
            culprit = ""
            for i, item in enumerate(a):
                try:
                    cloudpickle.dumps(item)
                except Exception:
                    culprit = f"[{i}] ({type(item).__name__})"
                    break
            raise TypeError(
                f"args[{rank}]{culprit} cannot be pickled for a worker process: {exc}. "
                "Pass picklable values (create locks, sockets and files inside the worker)"
            ) from exc
        payloads[rank] = args_bytes
    return fn_bytes, payloads
