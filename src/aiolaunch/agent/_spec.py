"""What the agent runs (:class:`WorkerSpec`) and what it reports (:class:`RunResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from .._child._bootstrap import BOOTSTRAP
from .._types import Std

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._hangs._watchdog import Watchdog
    from .._results import ProcessFailure

__all__ = ["RunResult", "WorkerSpec", "WorkerState"]


class WorkerState(str, Enum):
    """The state of a worker group; the group changes state as a unit (torch's names).

    ``INIT`` (created, not started) → ``HEALTHY`` (running) → ``SUCCEEDED`` or
    ``FAILED``. ``STOPPED`` is a group the agent stopped on purpose (a restart
    or a membership change); ``UNHEALTHY`` and ``UNKNOWN`` exist for torch
    compatibility.
    """

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        """Whether ``state`` means the worker processes exist (``HEALTHY``/``UNHEALTHY``)."""
        return state in {WorkerState.HEALTHY, WorkerState.UNHEALTHY}


@dataclass
class WorkerSpec:
    """The blueprint of one agent's worker group (torch's ``WorkerSpec``).

    :param role: the workers' role (``ROLE_NAME``; the console prefix).
    :param local_world_size: workers on this machine (``LOCAL_WORLD_SIZE``).
    :param entrypoint: a callable (function workers) or a str naming a binary
        (e.g. ``sys.executable``).
    :param args: arguments of every worker; ``"${local_rank}"`` inside a str
        argument becomes the worker's local rank.
    :param max_restarts: how many times a failed group is started again.
    :param monitor_interval: accepted for torch compatibility: worker exits are
        events, not polls. With a torch rendezvous it paces the check for new
        nodes waiting to join (at least once a second).
    :param redirects: streams written to log files (``Std`` or ``{local_rank: Std}``).
    :param tee: streams also shown on the console, prefixed; implies redirect.
    :param master_addr: overrides the ``MASTER_ADDR`` the rendezvous chose.
    :param master_port: overrides the ``MASTER_PORT`` the rendezvous chose.
    :param local_addr: this machine's address, as seen by the others.
    :param rdzv_handler: ``None`` for one machine (no torch needed), a
        :class:`~aiolaunch.agent.StaticRendezvous` to fix its run id, address
        or port, or a torch ``RendezvousHandler`` (e.g. c10d) for several
        machines.
    :param event_log_handler: torch's ``elastic.events`` handler the agent
        records its events through (``"null"``: none; ``"console"``: one JSON
        line per event on stderr; any handler registered with torch).
    :param numa_options: a torch ``NumaOptions``: bind worker ``local_rank``
        to the CPUs near GPU ``local_rank``, exactly as torch computes them
        (binaries through ``numactl --physcpubind``, functions through
        ``sched_setaffinity``); it fails, as torch does, where that cannot be
        done (no GPU, no ``numactl``) unless ``should_fall_back_if_binding_fails``.
    :param duplicate_stdout_filters: see :func:`aiolaunch.start_processes`.
    :param duplicate_stderr_filters: see :func:`aiolaunch.start_processes`.
    :param virtual_local_rank: every worker gets ``LOCAL_RANK=0`` and sees
        only its own GPU (``CUDA_VISIBLE_DEVICES`` = entry ``local_rank`` of
        the agent's ``CUDA_VISIBLE_DEVICES``, else ``local_rank``), as torch.
    :param watchdog: a :class:`aiolaunch.Watchdog` for every attempt's group
        (a restarted group is watched again from scratch).
    :param metrics_port: serve every attempt's Prometheus metrics on this
        port (see :func:`aiolaunch.start_processes`; the port is bound again
        for each attempt); ``None``: no metrics.
    :param metrics_host: the address to serve them on (``127.0.0.1``).
    """

    role: str
    local_world_size: int
    entrypoint: Callable[..., Any] | str
    args: tuple[Any, ...] = ()
    max_restarts: int = 0
    monitor_interval: float = 0.1
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    rdzv_handler: Any = None
    event_log_handler: str = "null"
    numa_options: Any = None
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    watchdog: Watchdog | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        # Validate here, before anything starts: each message names the field
        # and the fix.
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"role={self.role!r} must be a non-empty str, e.g. 'trainer'")
        if (
            not isinstance(self.local_world_size, int)
            or isinstance(self.local_world_size, bool)
            or self.local_world_size < 1
        ):
            raise ValueError(
                f"local_world_size={self.local_world_size!r} must be an int >= 1 "
                "(the number of workers on this machine)"
            )
        if not (callable(self.entrypoint) or isinstance(self.entrypoint, str)):
            raise TypeError(
                f"entrypoint={self.entrypoint!r} must be a callable or a str naming a binary"
            )
        if isinstance(self.entrypoint, str) and not self.entrypoint:
            raise ValueError("entrypoint='' is empty; name a binary, e.g. sys.executable")
        if not isinstance(self.args, tuple):
            raise TypeError(f"args={self.args!r} must be a tuple; wrap it: args=tuple(...)")
        if (
            not isinstance(self.max_restarts, int)
            or isinstance(self.max_restarts, bool)
            or self.max_restarts < 0
        ):
            raise ValueError(f"max_restarts={self.max_restarts!r} must be an int >= 0")
        if (
            isinstance(self.monitor_interval, bool)
            or not isinstance(self.monitor_interval, int | float)
            or not 0 < self.monitor_interval < math.inf
        ):
            raise ValueError(
                f"monitor_interval={self.monitor_interval!r} must be a number > 0 (seconds)"
            )
        if self.master_port is not None and (
            isinstance(self.master_port, bool)
            or not isinstance(self.master_port, int)
            or not 0 < self.master_port < 65536
        ):
            raise ValueError(
                f"master_port={self.master_port!r} must be an int in 1..65535, "
                "or None to let the rendezvous choose"
            )
        if self.watchdog is not None:
            from .._hangs._watchdog import Watchdog

            if not isinstance(self.watchdog, Watchdog):
                raise TypeError(f"watchdog={self.watchdog!r} must be an aiolaunch.Watchdog or None")
        if self.metrics_port is not None:
            from .._validate import check_port

            check_port("metrics_port", self.metrics_port, zero=True)
        for what, value in (("redirects", self.redirects), ("tee", self.tee)):
            if isinstance(value, dict):
                bad = [r for r in value if not isinstance(r, int) or r >= self.local_world_size]
                if bad:
                    raise ValueError(
                        f"{what} has local rank(s) {bad}, but local ranks are "
                        f"0..{self.local_world_size - 1}"
                    )
            elif not isinstance(value, Std):
                raise TypeError(f"{what}={value!r} must be a Std or a {{local_rank: Std}} dict")

    def get_entrypoint_name(self) -> str:
        """The name of the entrypoint, as torch reports it.

        A function's ``__name__``; for a binary, the binary, except that
        for the Python interpreter it is the first argument that is not an
        option (the script or module).
        """
        return entrypoint_name(self.entrypoint, self.args)


def entrypoint_name(entrypoint: Callable[..., Any] | str, args: tuple[Any, ...]) -> str:
    """torch's ``_get_entrypoint_name``: the name used in failure summaries."""
    import sys

    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            names = [str(a) for a in args if not str(a).startswith("-")]
            # the CLI's `-m aiolaunch._child._bootstrap`
            if names[:1] == [BOOTSTRAP]:
                names = names[1:]
            return names[0] if names else ""
        return entrypoint
    return str(getattr(entrypoint, "__name__", type(entrypoint).__name__))


@dataclass
class RunResult:
    """The outcome of :meth:`LocalElasticAgent.run`, keyed by *global* rank.

    :param state: ``SUCCEEDED`` or ``FAILED``.
    :param return_values: ``{global_rank: value}`` (binaries: ``None``) on success.
    :param failures: ``{global_rank: ProcessFailure}`` of the last attempt;
        each failure keeps its *local* rank in ``failure.local_rank``.
    :param stopped_early: why the agent stopped restarting before
        ``max_restarts`` was used up (a crash loop: attempts in a row without
        progress), or ``None``.
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stopped_early: str | None = None

    def is_failed(self) -> bool:
        """Whether the group failed (after all its restarts)."""
        return self.state == WorkerState.FAILED
