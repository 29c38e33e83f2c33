"""Every pre-spawn check. Nothing here has a side effect.

Each message names the argument, the bad value and the fix.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ._types import Std

__all__ = ["START_METHODS", "check_start_inputs", "pickle_payloads"]

START_METHODS = ("spawn", "fork", "forkserver")


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


def _check_std(what: str, value: Any, nprocs: int) -> None:
    if isinstance(value, Std):
        return
    if isinstance(value, Mapping):
        for rank, std in value.items():
            if not isinstance(rank, int) or not 0 <= rank < nprocs:
                raise ValueError(
                    f"{what} has rank {rank!r}, but local ranks are 0..{nprocs - 1}; "
                    "drop it or fix args"
                )
            if not isinstance(std, Std):
                raise TypeError(f"{what}[{rank}] is {std!r}; use aiolaunch.Std (e.g. Std.ALL)")
        return
    raise TypeError(
        f"{what}={value!r} is neither a Std nor a {{rank: Std}} dict; "
        "use e.g. Std.ALL or {0: Std.ERR} (Std.from_str parses '0:3,1:0')"
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
        _check_std("redirects", redirects, nprocs)
        _check_std("tee", tee, nprocs)
        if log_dir is not None:
            if not isinstance(log_dir, str | os.PathLike):
                raise TypeError(f"log_dir must be a str path or None, got {type(log_dir).__name__}")
            path = os.fspath(log_dir)
            if os.path.isfile(path):
                raise NotADirectoryError(
                    f"log_dir={path!r} is a file; pass a directory (created if missing) or None"
                )
            if os.path.isdir(path) and os.listdir(path):
                raise ValueError(
                    f"log_dir={path!r} is not empty; pass an empty or new directory, or None "
                    "for a fresh temporary one (logs_specs=DefaultLogsSpecs(...) may reuse "
                    "a folder: each run gets its own sub-folder)"
                )
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
    if os.sep in entrypoint:
        if not os.path.isfile(entrypoint):
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
