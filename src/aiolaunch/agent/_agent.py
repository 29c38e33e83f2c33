"""The elastic agent: rendezvous, start the group, await its exits, restart."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import anyio

from .._context import JobAttempt
from .._errors import SignalException
from .._results import root_cause
from .._signals._names import describe_signal
from .._validate import START_METHODS, check_log_dir_not_file
from ._attempt import AttemptLogs, run_attempt
from ._elastic_events import EventRecorder
from ._env import omp_notice
from ._quarantine import HostExcluded
from ._rendezvous import GroupAssignment, Rendezvous, SpareReleased, resolve
from ._resilience import HostKeeper, Resilience
from ._spec import RunResult, WorkerSpec, WorkerState
from ._warm import WarmStart

if TYPE_CHECKING:
    from .._events import Event
    from .._live._metrics import MetricsEndpoint
    from .._results import ProcessFailure

__all__ = ["LocalElasticAgent"]

log = logging.getLogger("aiolaunch.agent")


class LocalElasticAgent:
    """Runs one machine's worker group and keeps it alive: torch's ``LocalElasticAgent``, async.

    ``await agent.run()`` joins the rendezvous, starts ``spec.local_world_size``
    workers with torchrun's environment, and awaits them. Exits are events:
    the agent reacts the moment a worker fails, not at the next
    ``monitor_interval`` tick. A failure with restarts left stops the whole
    group and starts attempt ``k+1`` (``TORCHELASTIC_RESTART_COUNT=k+1``)
    after a new rendezvous round; new nodes waiting to join (torch
    rendezvous only) restart the group without using up a restart, as
    torchrun does.

    Logs of attempt ``k`` go to ``{log_dir}/{run_id}_<unique>/attempt_{k}/{local_rank}/``
    (``stdout.log``, ``stderr.log`` for redirected streams, ``error.json``).

    :param spec: what to run (:class:`WorkerSpec`).
    :param start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"`` for
        function entrypoints.
    :param exit_barrier_timeout: with a torch rendezvous, how long a
        finished agent waits for the other agents before it returns (their
        workers may still use the store it hosts).
    :param log_dir: base folder for logs; may be reused across runs (each run
        gets its own ``{run_id}_<unique>`` folder); ``None``: a temporary one.
    :param logs_specs: instead of ``log_dir`` and the spec's
        ``redirects``/``tee``, a :class:`~aiolaunch.LogsSpecs` (or torch's),
        e.g. ``DefaultLogsSpecs(local_ranks_filter={0})``; torch's layout.
    :param log_line_prefix_template: console prefix, a ``string.Template``
        over ``${role_name}``, ``${rank}``, ``${local_rank}`` (torch's
        ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``); ``None``: ``[{role}{local_rank}]:``.
    :param shutdown_timeout: grace period (seconds) between the death signal
        and SIGKILL when the group is stopped.
    :param restart_backoff: seconds to wait before the first restart, doubled
        for each further one (capped at ``restart_backoff_max``); ``0``
        (default, like torch): restart at once.
    :param restart_backoff_max: the cap of that delay.
    :param preload: warm start (``agent/_warm.py``): Python workers forked
        from a zygote that imported these modules once (``True``: torch),
        kept across attempts; on one node each attempt also gets a fresh
        store of the agent's own. ``None``/``False``: off.
    :param resilience: how the job treats its hosts (:class:`Resilience`:
        quarantine, a health check before each round, a stop to crash
        loops, resources a restart waits for); ``None``: none of it. With
        aiolaunch's rounds (``--rdzv-backend c10d``/``etcd-v3``) the
        restarts are the job's, counted the same on every host.

    *Signals*: while the workers run, SIGTERM, SIGINT, SIGHUP and SIGQUIT to
    this process are forwarded to them and :meth:`run` raises
    :class:`~aiolaunch.SignalException` once they are gone (main thread only;
    see :meth:`PContext.wait`).
    *Cancellation*: cancelling :meth:`run` stops the workers (shielded) and
    re-raises.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        logs_specs: Any = None,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: float = 30.0,
        restart_backoff: float = 0.0,
        restart_backoff_max: float = 30.0,
        preload: bool | list[str] | tuple[str, ...] | None = None,
        resilience: Resilience | None = None,
    ) -> None:
        _check_args(
            spec,
            start_method,
            log_dir,
            logs_specs,
            exit_barrier_timeout=exit_barrier_timeout,
            shutdown_timeout=shutdown_timeout,
            restart_backoff=restart_backoff,
            restart_backoff_max=restart_backoff_max,
        )
        self._spec = spec
        self._start_method = start_method
        self._exit_barrier_timeout = float(exit_barrier_timeout)
        self._logs = AttemptLogs(None if log_dir is None else os.fspath(log_dir), logs_specs, spec)
        self._prefix_template = log_line_prefix_template
        self._shutdown_timeout = float(shutdown_timeout)
        self._backoff = float(restart_backoff)
        self._backoff_max = float(restart_backoff_max)
        self._rdzv: Rendezvous = resolve(spec.rdzv_handler, local_addr=spec.local_addr)
        self._warm = WarmStart.for_agent(preload, spec, self._rdzv)
        self._keeper = HostKeeper(resilience, self._rdzv, self._shutdown_timeout)
        self._state = WorkerState.INIT
        self._restart_count = 0
        self._running = False
        self._events = EventRecorder(
            handler=spec.event_log_handler,
            role=spec.role,
            entry_point=spec.get_entrypoint_name(),
            rdzv_backend=_backend_name(self._rdzv),
            max_restarts=spec.max_restarts,
        )
        self._last: tuple[GroupAssignment, dict[int, int]] | None = None
        self._metrics: MetricsEndpoint | None = None

    @property
    def spec(self) -> WorkerSpec:
        """The worker spec."""
        return self._spec

    @property
    def state(self) -> WorkerState:
        """The worker group's state (``INIT`` before :meth:`run`)."""
        return self._state

    @property
    def run_id(self) -> str:
        """``TORCHELASTIC_RUN_ID`` of this run."""
        return self._rdzv.run_id

    @property
    def restart_count(self) -> int:
        """Restarts so far (``TORCHELASTIC_RESTART_COUNT`` of the current attempt)."""
        return self._restart_count

    @property
    def run_log_dir(self) -> str | None:
        """``{log_dir}/{run_id}_<unique>`` once :meth:`run` started (not with ``logs_specs``).

        With ``log_dir=None`` it is a temporary folder: at the end of
        :meth:`run` it is removed if it holds no file (then this is ``None``).
        """
        return self._logs.run_log_dir

    async def run(self) -> RunResult:
        """Run the worker group to its end, restarting it on failure.

        :returns: ``SUCCEEDED`` with ``return_values`` (binaries: ``None``),
            or ``FAILED`` with the last attempt's ``failures``; both keyed by
            global rank.
        :raises SignalException: a termination signal reached this process
            while the workers ran; they were stopped.
        """
        if self._running:
            raise RuntimeError("run() is already in progress on this agent")
        # The job's metrics address, bound before anything starts (a port in
        # use is an error now) and kept until the run ends: each attempt's
        # group shows itself on it, so a scraper's address outlives restarts.
        self._metrics = _job_metrics(self._spec)
        self._running = True
        try:
            if self._metrics is not None:
                await self._metrics.serve()
            try:
                result = await self._invoke_run()
            except SpareReleased as exc:  # the job ended without this spare: no failure
                log.info("[%s] %s", self._spec.role, exc)
                self._state, result = WorkerState.SUCCEEDED, RunResult(WorkerState.SUCCEEDED)
            self._events.run_ended(result, self._last)
            return result
        except (SignalException, HostExcluded) as exc:
            if isinstance(exc, SignalException):
                log.warning("received %s, stopped the workers", describe_signal(exc.sigval))
            else:
                log.error("[%s] %s", self._spec.role, exc.reason)
            self._state = WorkerState.STOPPED
            self._events.record("FAILED", "AGENT")
            await self._keeper.leave()  # the other hosts re-form at once
            raise
        except BaseException:
            if self._state != WorkerState.SUCCEEDED:
                self._state = WorkerState.UNKNOWN
            self._events.record("FAILED", "AGENT")
            raise
        finally:
            self._running = False
            self._keeper.close()
            await self._warm.aclose()
            if self._metrics is not None:
                await self._metrics.aclose()
                self._metrics = None
            self._logs.prune()

    async def _invoke_run(self) -> RunResult:
        spec = self._spec
        notice = omp_notice(spec.local_world_size, os.environ)
        if notice is not None:
            log.warning(notice)
        keeper = self._keeper
        self._restart_count = 0
        membership_round = 0
        delay = 0.0
        history: list[Event] = []  # the job's lifecycle events, over its attempts
        await keeper.begin()
        while True:
            assignment, self._restart_count, took_ms = await _next_round(
                self._rdzv, self._warm, keeper, spec
            )
            self._events.rendezvous_done(assignment, self._restart_count, took_ms)
            _log_rendezvous(spec, assignment, self._restart_count)
            try:
                result = await run_attempt(
                    spec,
                    assignment,
                    self._rdzv,
                    job=JobAttempt(
                        restarts=self._restart_count,
                        delay=delay,
                        metrics=self._metrics,
                        restarting=membership_round == 0,
                        history=history,
                    ),
                    logs=self._logs.kwargs(
                        assignment.run_id, self._restart_count, membership_round
                    ),
                    start_method=self._start_method,
                    shutdown_timeout=self._shutdown_timeout,
                    prefix_template=self._prefix_template,
                    started=functools.partial(self._started, assignment),
                    preload=self._warm.names,
                    keeper=keeper,
                )
            finally:
                with anyio.CancelScope(shield=True):
                    await self._warm.attempt_ended()
                    await keeper.after_attempt()
            if result is None:
                # membership change: a new round, same restart count (torch:
                # "membership changes do not count as retries")
                membership_round += 1
                await keeper.before_round()
                continue
            base = assignment.base_global_rank
            if not result.is_failed():
                self._state = WorkerState.SUCCEEDED
                if self._rdzv.elastic:
                    await self._rdzv.exit_barrier(self._exit_barrier_timeout)
                return RunResult(
                    state=WorkerState.SUCCEEDED,
                    return_values={base + r: v for r, v in result.return_values.items()},
                )
            self._state = WorkerState.STOPPED
            failures = {base + r: f for r, f in result.failures.items()}
            final = await _restart_or_stop(keeper, spec, failures, self._backoff, self._backoff_max)
            if not isinstance(final, RunResult):
                membership_round, delay = 0, final
                continue
            self._state = WorkerState.FAILED
            return final

    def _started(self, assignment: GroupAssignment, pids: dict[int, int]) -> None:
        self._keeper.started(assignment, pids)
        self._state = WorkerState.HEALTHY
        self._last = (assignment, pids)
        self._events.workers_started(assignment, pids)
        self._warm.started(assignment.master_addr)

    def __repr__(self) -> str:
        return (
            f"LocalElasticAgent(role={self._spec.role!r}, "
            f"local_world_size={self._spec.local_world_size}, run_id={self.run_id!r}, "
            f"state={self._state.value}, restart_count={self._restart_count})"
        )


async def _next_round(
    rdzv: Rendezvous, warm: WarmStart, keeper: HostKeeper, spec: WorkerSpec
) -> tuple[GroupAssignment, int, float]:
    """``(this agent's assignment, the restart count, ms it took)`` of the next round.

    The restart count is the job's (with aiolaunch's rounds: the same on every
    host, a spare that never failed included), never past ``max_restarts``.
    """
    began = time.perf_counter()
    assignment = await rdzv.next_rendezvous(
        role=spec.role,
        local_world_size=spec.local_world_size,
        master_addr=spec.master_addr,
        master_port=spec.master_port,
    )
    assignment = await warm.assignment(assignment)
    restarts = min(await keeper.restart_count(), spec.max_restarts)
    return assignment, restarts, (time.perf_counter() - began) * 1e3


async def _restart_or_stop(
    keeper: HostKeeper,
    spec: WorkerSpec,
    failures: dict[int, ProcessFailure],
    backoff: float,
    backoff_max: float,
) -> RunResult | float:
    """After a failed attempt: the seconds waited before the restart (the
    backoff; the health check passed), else the final result - the job's
    restarts are used up, or a crash loop stopped it (``stopped_early``)."""
    rank, root = root_cause(failures)
    why = f"rank {rank} {_describe(root)}"
    restarts, streak = await keeper.record_failure(why, failures.values())
    loop = keeper.crash_loop(streak, why)
    if loop is None and restarts <= spec.max_restarts:
        delay = _backoff(backoff, backoff_max, restarts)
        log.warning(
            "[%s] worker group failed (%s); %d/%d restarts left, restarting%s",
            spec.role,
            why,
            spec.max_restarts - restarts + 1,
            spec.max_restarts,
            f" in {delay:g}s" if delay else "",
        )
        if delay:
            await asyncio.sleep(delay)  # allowed: the backoff between attempts
        await keeper.before_round()
        return delay
    if loop is not None:
        log.error("[%s] %s", spec.role, loop)
    else:
        log.error(
            "[%s] worker group failed after %d restart(s); root cause: rank %d (local_rank %d) %s",
            spec.role,
            restarts - 1,
            rank,
            root.local_rank,
            _describe(root),
        )
    return RunResult(state=WorkerState.FAILED, failures=failures, stopped_early=loop)


def _job_metrics(spec: WorkerSpec) -> MetricsEndpoint | None:
    """The job's metrics endpoint of ``spec.metrics_port`` (``None``: none).

    :raises OSError: the port cannot be bound (the message names the fix).
    """
    if spec.metrics_port is None:
        return None
    from .._live._metrics import MetricsEndpoint, bind_metrics, render_sections

    sock = bind_metrics(spec.metrics_host, spec.metrics_port)
    return MetricsEndpoint(sock, idle=render_sections)


def _backoff(base: float, cap: float, restart_count: int) -> float:
    """The delay before restart ``restart_count``: ``base`` doubled per restart, capped."""
    if base <= 0:
        return 0.0
    return float(min(cap, base * 2 ** (restart_count - 1)))


def _log_rendezvous(spec: WorkerSpec, a: GroupAssignment, restart_count: int) -> None:
    log.info(
        "[%s] rendezvous complete: run_id=%s group_rank=%d/%d ranks=%d..%d of %d "
        "master=%s:%d restart_count=%d",
        spec.role,
        a.run_id,
        a.group_rank,
        a.group_world_size,
        a.base_global_rank,
        a.base_global_rank + spec.local_world_size - 1,
        a.global_world_size,
        a.master_addr,
        a.master_port,
        restart_count,
    )


def _backend_name(rdzv: Rendezvous) -> str:
    handler = getattr(rdzv, "handler", None)
    get_backend = getattr(handler, "get_backend", None)
    return str(get_backend()) if callable(get_backend) else "static"


def _describe(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        what = f"killed by {failure.signal_name()}"
    else:
        what = f"exit code {failure.exitcode}"
    lines = failure.error_message.strip().splitlines()
    return f"{what}: {lines[-1]}" if lines else what


def _check_args(
    spec: WorkerSpec,
    start_method: str,
    log_dir: str | os.PathLike[str] | None,
    logs_specs: Any,
    **seconds: float,
) -> None:
    """LocalElasticAgent's argument checks: each error names the argument and the fix."""
    if not isinstance(spec, WorkerSpec):
        raise TypeError(f"spec={spec!r} must be an aiolaunch.agent.WorkerSpec")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not one of {', '.join(START_METHODS)}")
    for what, value in seconds.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"{what}={value!r} must be a number of seconds >= 0")
    if logs_specs is not None and log_dir is not None:
        raise ValueError(
            "log_dir and logs_specs were both given; pass the folder inside logs_specs"
        )
    if log_dir is not None:
        check_log_dir_not_file("log_dir", os.fspath(log_dir))
