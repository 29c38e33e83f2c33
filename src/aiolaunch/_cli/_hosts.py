"""The options of resilience across hosts: their flags, and the policy they make.

``--quarantine-after N``, ``--quarantine-window SECONDS``,
``--quarantine-ttl SECONDS``, ``--health-check CMD``,
``--health-check-timeout SECONDS``, ``--max-no-progress-restarts N`` (with
``--progress-regex``) and ``--restart-resources LIST`` become an
:class:`aiolaunch.agent.Resilience` (:func:`resilience_from_args`); each bad
value is an error naming the flag and the fix, before anything starts.
Standard library only at import (``aiolaunch --help`` stays instant).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._actions import EnvOption, comma_list

if TYPE_CHECKING:
    import argparse

__all__ = ["add_host_flags", "resilience_from_args"]

DEFAULT_WINDOW = 3600.0
DEFAULT_TTL = 3600.0
DEFAULT_CHECK_TIMEOUT = 60.0


def add_host_flags(p: argparse.ArgumentParser) -> None:
    """Add the resilience options (aiolaunch's own) to the parser."""
    add = p.add_argument
    add(
        "--quarantine-after",
        "--quarantine_after",
        action=EnvOption,
        type=int,
        default=None,
        metavar="N",
        help="A host charged with N failed rounds (its workers failed first, or it died) "
        "within --quarantine-window leaves the job and is not re-admitted for "
        "--quarantine-ttl; the record is kept in the rendezvous store (c10d, etcd-v3) and "
        "its agent exits with status 3 (default: off).",
    )
    add(
        "--quarantine-window",
        "--quarantine_window",
        action=EnvOption,
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"The window of --quarantine-after (default {DEFAULT_WINDOW:g}).",
    )
    add(
        "--quarantine-ttl",
        "--quarantine_ttl",
        action=EnvOption,
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"How long a quarantined host stays out (default {DEFAULT_TTL:g}).",
    )
    add(
        "--health-check",
        "--health_check",
        action=EnvOption,
        default=None,
        metavar="CMD",
        help="A shell command run on each host before it joins every round (the first too); "
        "a non-zero exit or a timeout keeps the host out of that round (a spare takes its "
        "place) and the reason is logged (default: none).",
    )
    add(
        "--health-check-timeout",
        "--health_check_timeout",
        action=EnvOption,
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"The time limit of --health-check (default {DEFAULT_CHECK_TIMEOUT:g}).",
    )
    add(
        "--max-no-progress-restarts",
        "--max_no_progress_restarts",
        action=EnvOption,
        type=int,
        default=None,
        metavar="N",
        help="Stop restarting after N attempts in a row without progress (no line matching "
        "--progress-regex on any host): exit status 2 (do not retry) "
        "and a termination message naming the crash loop. Needs --progress-regex.",
    )
    add(
        "--restart-resources",
        "--restart_resources",
        action=EnvOption,
        type=comma_list,
        default=[],
        metavar="LIST",
        help="Before a restart starts workers on a host, wait (up to the shutdown timeout) "
        "until no process of the last attempt holds these: paths or globs (/dev/nvidia*) and "
        "port:N (must bind again). The last attempt's processes are always waited for.",
    )


def _seconds(flag: str, value: float | None, default: float) -> float:
    if value is None:
        return default
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag}={value:g} must be a number of seconds > 0, e.g. {default:g}")
    return float(value)


def resilience_from_args(args: argparse.Namespace, *, rounds: bool) -> Any:
    """The :class:`~aiolaunch.agent.Resilience` of the options, or ``None`` when none is given.

    :param rounds: whether the rendezvous is aiolaunch's rounds (``c10d`` or
        ``etcd-v3``), which keep the quarantine records.
    :raises ValueError: a bad value or combination, naming the flag and the fix.
    """
    q_after = args.quarantine_after
    if q_after is None:
        for flag, value in (
            ("--quarantine-window", args.quarantine_window),
            ("--quarantine-ttl", args.quarantine_ttl),
        ):
            if value is not None:
                raise ValueError(f"{flag} needs --quarantine-after N (quarantine is off)")
    elif q_after < 1:
        raise ValueError(f"--quarantine-after={q_after} must be >= 1, e.g. --quarantine-after 2")
    elif not rounds:
        raise ValueError(
            "--quarantine-after keeps its records in the rendezvous store of several hosts: "
            "use --rdzv-backend c10d or etcd-v3 (one machine has no other host to go on with)"
        )
    if args.health_check is not None and not args.health_check.strip():
        raise ValueError("--health-check='' is empty; pass a command, e.g. 'nvidia-smi -L'")
    if args.health_check is None and args.health_check_timeout is not None:
        raise ValueError("--health-check-timeout needs --health-check CMD")
    n = args.max_no_progress_restarts
    if n is not None:
        if n < 1:
            raise ValueError(
                f"--max-no-progress-restarts={n} must be >= 1, e.g. --max-no-progress-restarts 3"
            )
        if args.progress_regex is None:
            raise ValueError(
                "--max-no-progress-restarts needs --progress-regex REGEX: the pattern of your "
                "progress lines, e.g. --progress-regex '^step '"
            )
    resources = tuple(r.strip() for r in args.restart_resources if r.strip())
    given = (q_after, args.health_check, n, resources or None)
    if all(v is None for v in given):
        return None
    from ..agent._clean import parse_resources
    from ..agent._resilience import Resilience

    parse_resources(resources)  # its messages name --restart-resources
    return Resilience(
        quarantine_after=q_after,
        quarantine_window=_seconds("--quarantine-window", args.quarantine_window, DEFAULT_WINDOW),
        quarantine_ttl=_seconds("--quarantine-ttl", args.quarantine_ttl, DEFAULT_TTL),
        health_check=args.health_check,
        health_check_timeout=_seconds(
            "--health-check-timeout", args.health_check_timeout, DEFAULT_CHECK_TIMEOUT
        ),
        max_no_progress_restarts=n,
        progress_regex=args.progress_regex if n is not None else None,
        restart_resources=resources,
    )
