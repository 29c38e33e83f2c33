"""Checks of the command line that need more than argparse: each message names
the flag (or the ``PET_*`` variable it came from) and the fix.

Nothing starts here; :func:`aiolaunch._cli.main` prints ``aiolaunch: error: ...``
and exits 2 for any of them.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from typing import TYPE_CHECKING, Any

from ._parser import DEFAULT_SIGNALS, env_name

if TYPE_CHECKING:
    import argparse

__all__ = [
    "check_event_log_handler",
    "check_executable",
    "check_log_dir",
    "check_metrics",
    "check_node",
    "endpoint_of",
    "load_logs_specs_class",
    "local_ranks",
    "make_log_dir",
    "numa_from_flag",
    "parse_endpoint",
    "shutdown_timeout",
    "signal_environ",
    "source",
    "std_setting",
    "watchdog_from_args",
]


def watchdog_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~aiolaunch.Watchdog` of ``--stall-timeout`` and its flags, or ``None``."""
    if args.stall_timeout is None:
        # --max-no-progress-restarts reads the progress regex too (_hosts.py)
        progress = None if args.max_no_progress_restarts is not None else args.progress_regex
        for flag, value in (
            ("--on-stall", args.on_stall),
            ("--progress-regex", progress),
            ("--straggler-sample", args.straggler_sample),
        ):
            if value is not None:
                raise ValueError(f"{flag} needs --stall-timeout SECONDS (the watchdog is off)")
        _check_progress_regex(args.progress_regex)
        return None
    from .._hangs._watchdog import Watchdog, stall_after_problem

    if not (math.isfinite(args.stall_timeout) and args.stall_timeout > 0):
        raise ValueError(
            f"--stall-timeout={args.stall_timeout} must be a number of seconds > 0, "
            "e.g. --stall-timeout 600"
        )
    why = stall_after_problem(args.stall_timeout)
    if why is not None:
        raise ValueError(
            f"--stall-timeout={args.stall_timeout} {why}; pass seconds from 1 to 2592000 "
            "(30 days), e.g. --stall-timeout 600, or drop the flag for no watchdog"
        )
    _check_progress_regex(args.progress_regex)
    sample = args.straggler_sample
    if sample is not None and not (math.isfinite(sample) and sample >= 0.1):
        raise ValueError(
            f"--straggler-sample={sample} must be a stack-sample period in seconds >= 0.1, "
            "e.g. --straggler-sample 1"
        )
    return Watchdog(
        stall_after=float(args.stall_timeout),
        progress=args.progress_regex,
        action=args.on_stall or "fail",
        stragglers=None if sample is None else float(sample),
    )


def _check_progress_regex(regex: str | None) -> None:
    if regex is None:
        return
    from .._hangs._watchdog import matches_every_line

    try:
        every = matches_every_line(regex)
    except re.error as exc:
        raise ValueError(
            f"--progress-regex={regex!r} is not a valid regular expression "
            f"({exc}); fix it, e.g. --progress-regex '^step '"
        ) from None
    if every:
        raise ValueError(
            f"--progress-regex={regex!r} matches every line (it matches an "
            "empty one), so any output would count as progress; pass a pattern of your "
            "progress lines, e.g. --progress-regex '^step ', or drop the flag"
        )


def source(flag: str, value: object) -> str:
    """``--flag``, or ``$PET_FLAG`` when the value came from there."""
    env = env_name(flag.lstrip("-").replace("-", "_"))
    return f"${env}" if os.environ.get(env) == str(value) else flag


def local_ranks(spec: str, nproc: int) -> set[int] | None:
    """``--local-ranks-filter``: the set of local ranks (some of ``0..nproc-1``), or ``None``."""
    if not spec:
        return None
    try:
        ranks = {int(r) for r in spec.split(",")}
    except ValueError:
        raise ValueError(
            f"--local-ranks-filter={spec!r} must be a comma-separated "
            "list of integers, e.g. --local-ranks-filter 0,1,2"
        ) from None
    if min(ranks) < 0:
        raise ValueError(
            f"--local-ranks-filter={spec!r} has a negative rank; local ranks are 0..{nproc - 1}"
        )
    if not ranks & set(range(nproc)):
        raise ValueError(
            f"--local-ranks-filter={spec!r} names no worker of this node (local ranks "
            f"0..{nproc - 1}): no output would reach the console; use e.g. "
            "--local-ranks-filter 0, or -r 3 to send it to log files only"
        )
    return ranks


def signal_environ(args: argparse.Namespace) -> dict[str, str]:
    """The signal lists, checked, for the supervisor's environment.

    torchrun hands ``--signals-to-handle`` to the workers' supervisor through
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``; ``--forward-signals`` (or an
    ``AIOLAUNCH_FORWARD_SIGNALS`` already set) goes the same way. Unlike
    torchrun, a name that is no signal stops the launch here: a typo in
    the preemption signal would otherwise let it kill the supervisor.
    """
    from .._signals._plan import FORWARD_SIGNALS_ENV, parse_signals

    environ: dict[str, str] = {}
    inherited = os.environ.get(FORWARD_SIGNALS_ENV)
    for flag, value, env, example in (
        (
            "--signals-to-handle",
            args.signals_to_handle,
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
            DEFAULT_SIGNALS,
        ),
        ("--forward-signals", args.forward_signals, FORWARD_SIGNALS_ENV, "SIGUSR1"),
    ):
        what = source(flag, value)
        if value is None:
            if not inherited:
                continue
            value, what = inherited, f"${FORWARD_SIGNALS_ENV}"
        try:
            found = parse_signals(value, what=what, strict=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None
        if not found:
            raise ValueError(
                f"{what}={value!r} names no signal; pass e.g. {flag} {example}, or drop it"
            )
        environ[env] = value
    return environ


def shutdown_timeout(flag: int | None) -> float:
    """``--shutdown-timeout``, else ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 (seconds)."""
    if flag is not None:
        if flag < 0:
            raise ValueError(
                f"{source('--shutdown-timeout', flag)}={flag} must be a number of seconds >= 0 "
                "(between the stop signal and SIGKILL), e.g. --shutdown-timeout 30"
            )
        return float(flag)
    text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if not text:
        return 30.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # NaN too
        raise ValueError(
            f"$TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text!r} must be a number of seconds >= 0, "
            "e.g. 30; fix or unset it (or pass --shutdown-timeout)"
        )
    return value


def check_log_dir(path: str | None) -> None:
    """``--log-dir``: a folder that exists or can be made (not made here)."""
    from .._validate import check_log_dir_writable

    if path is None:
        return
    flag = source("--log-dir", path)
    if not path:
        raise ValueError(f"{flag}='' is empty; pass a folder, or drop it for a temporary one")
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(
            f"{flag}={path!r} is not a directory; pass a folder (created if missing), or "
            "drop it for a temporary one"
        )
    try:
        check_log_dir_writable(flag, path)
    except OSError as exc:
        raise ValueError(str(exc).replace("or None for a temporary one", "or drop it")) from None


def check_node(args: argparse.Namespace, max_nodes: int) -> None:
    """--node-rank, --master-addr, --master-port: checked before a rendezvous waits on them."""
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ValueError(
            f"{source('--master-port', args.master_port)}={args.master_port} is not a TCP "
            "port; use 1..65535, e.g. --master-port 29500"
        )
    if not args.master_addr:
        raise ValueError(
            "--master-addr='' is empty; pass the host name or address of the node of "
            "rank 0, e.g. --master-addr 10.0.0.1"
        )
    static = args.rdzv_backend == "static" and not args.standalone
    if args.node_rank < 0 or (static and max_nodes > 1 and args.node_rank >= max_nodes):
        raise ValueError(
            f"{source('--node-rank', args.node_rank)}={args.node_rank} is not a node of "
            f"--nnodes={args.nnodes}: use 0..{max_nodes - 1} (0 on the master node)"
        )


def make_log_dir(path: str | None) -> None:
    """Make ``--log-dir`` now, after every other check (nothing is left behind
    when one fails): root passes the ``access()`` checks on ``/proc`` or a
    read-only mount; only making the folder tells."""
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise FileNotFoundError(
            f"--log-dir={path!r} cannot be created ({exc.strerror}); pass a folder you can "
            "write, or drop it for a temporary one"
        ) from None


def check_executable(path: str, what: str) -> None:
    """A binary to run: on ``PATH``, or a path to an executable file."""
    if os.sep not in path:
        if shutil.which(path) is None:
            raise FileNotFoundError(
                f"{what}: {path!r} was not found on PATH; pass its full path or fix PATH"
            )
        return
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: {path!r} does not exist; fix the path")
    if not os.access(path, os.X_OK):
        raise PermissionError(f"{what}: {path!r} is not executable; chmod +x it")


def check_event_log_handler(name: str) -> None:
    """``--event-log-handler``: ``null``, or a handler registered with torch."""
    if name == "null":
        return
    try:
        from torch.distributed.elastic.events import handlers
    except ImportError:
        known = ["null", "console"]
    else:
        known = sorted(handlers._log_handlers)
    if name not in known:
        raise ValueError(
            f"--event-log-handler={name!r} is not a registered handler; use one of {known}"
        )


def numa_from_flag(mode: str | None) -> Any:
    """``--numa-binding``: torch's ``NumaOptions`` (needs torch), or ``None``."""
    if mode is None:
        return None
    try:
        from torch.numa.binding import AffinityMode, NumaOptions
    except ImportError:
        raise ValueError(
            f"--numa-binding={mode} needs torch (pip install 'aiolaunch[torch]')"
        ) from None
    return NumaOptions(affinity_mode=AffinityMode(mode))


def std_setting(std_cls: Any, flag: str, value: str) -> Any:
    """``--redirects`` / ``--tee``: ``Std.from_str(value)``, the message naming ``flag``."""
    try:
        return std_cls.from_str(value)
    except (ValueError, KeyError) as exc:
        raise ValueError(
            f"{flag}={value!r} must be 0-3 for every rank, or LOCAL_RANK:VALUE pairs "
            f"such as 0:3,1:1 ({exc})"
        ) from None


def load_logs_specs_class(name: str) -> Any:
    """``--logs-specs``: the class of that ``torchrun.logs_specs`` entry point."""
    from importlib import metadata

    for group in ("aiolaunch.logs_specs", "torchrun.logs_specs"):
        eps = metadata.entry_points().select(group=group, name=name)
        for ep in eps:
            return ep.load()
    raise ValueError(
        f"--logs-specs={name!r}: no entry point of that name in the 'torchrun.logs_specs' "
        "(or 'aiolaunch.logs_specs') group"
    )


def parse_endpoint(endpoint: str, default_port: int | None) -> tuple[str, int | None]:
    """``"host[:port]"`` (``[v6]:port`` too) → ``(host, port)`` (torch's rules)."""
    endpoint = endpoint.strip()
    if not endpoint:
        return "localhost", default_port
    if endpoint.startswith("[") and endpoint.endswith("]"):
        host, rest = endpoint, None
    else:
        host, sep, rest_ = endpoint.rpartition(":")
        if not sep:
            host, rest = endpoint, None
        else:
            rest = rest_
    if len(host) > 1 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
    port = default_port
    if rest is not None:
        if not rest.isdigit() or not 0 <= int(rest) < 65536:
            raise ValueError(
                f"the port of the endpoint {endpoint!r} must be an integer in 0..65535"
            )
        port = int(rest)
    if not re.match(r"^[\w.:-]+$", host):
        raise ValueError(
            f"the host of the endpoint {endpoint!r} must be a hostname, an IPv4 or an IPv6 address"
        )
    return host, port


def endpoint_of(
    args: argparse.Namespace, endpoint: str, default_port: int | None
) -> tuple[str, int | None]:
    """:func:`parse_endpoint`, its message naming the flag the endpoint came from."""
    try:
        return parse_endpoint(endpoint, default_port)
    except ValueError as exc:
        flag = "--rdzv-endpoint" if args.rdzv_endpoint else "--master-addr/--master-port"
        raise ValueError(f"{flag}: {exc}") from None


def check_metrics(args: argparse.Namespace) -> None:
    """``--metrics-port`` (0..65535; 0: any free port) and ``--metrics-host``."""
    port, host = args.metrics_port, args.metrics_host
    if port is None:
        if host != "127.0.0.1":
            raise ValueError("--metrics-host needs --metrics-port PORT (metrics are off)")
        return
    if not 0 <= port <= 65535:
        raise ValueError(
            f"{source('--metrics-port', port)}={port} is not a TCP port; use 1..65535, or 0 "
            "for any free port, e.g. --metrics-port 9400"
        )
    if not host:
        raise ValueError(
            "--metrics-host='' is empty; pass the address to listen on, e.g. "
            "--metrics-host 0.0.0.0 (every interface), or drop it for 127.0.0.1"
        )
