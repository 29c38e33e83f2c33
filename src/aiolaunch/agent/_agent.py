"""The elastic agent: rendezvous, start the group, await its exits, restart."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import string
import time
from typing import TYPE_CHECKING, Any

import anyio

from .._api import start_processes
from .._errors import SignalException
from .._logs._specs import attempt_dir_path, make_run_dir, make_temp_dir, prune_empty_dirs
from .._results import root_cause
from .._signames import describe_signal
from .._validate import START_METHODS, check_log_dir_not_file, log_dir_error
from ._elastic_events import EventRecorder
from ._env import omp_notice, substitute_local_rank, worker_envs
from ._numa import numa_cpus, wrap_for_numa
from ._rendezvous import GroupAssignment, Rendezvous, resolve
from ._spec import RunResult, WorkerSpec, WorkerState

if TYPE_CHECKING:
    from .._context import PContext
    from .._results import ProcessFailure, RunProcsResult

__all__ = ["LocalElasticAgent"]

log = logging.getLogger("aiolaunch.agent")

#: the slowest pace of the membership check (``num_nodes_waiting``), seconds
_MEMBERSHIP_POLL_MIN = 1.0


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
    ) -> None:
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"spec={spec!r} must be an aiolaunch.agent.WorkerSpec")
        if start_method not in START_METHODS:
            raise ValueError(
                f"start_method={start_method!r} is not one of {', '.join(START_METHODS)}"
            )
        for what, value in (
            ("exit_barrier_timeout", exit_barrier_timeout),
            ("shutdown_timeout", shutdown_timeout),
            ("restart_backoff", restart_backoff),
            ("restart_backoff_max", restart_backoff_max),
        ):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{what}={value!r} must be a number of seconds >= 0")
        if logs_specs is not None and log_dir is not None:
            raise ValueError(
                "log_dir and logs_specs were both given; pass the folder inside logs_specs"
            )
        if log_dir is not None:
            check_log_dir_not_file("log_dir", os.fspath(log_dir))
        self._spec = spec
        self._start_method = start_method
        self._exit_barrier_timeout = float(exit_barrier_timeout)
        self._log_dir = None if log_dir is None else os.fspath(log_dir)
        self._logs_specs = logs_specs
        self._prefix_template = log_line_prefix_template
        self._shutdown_timeout = float(shutdown_timeout)
        self._backoff = float(restart_backoff)
        self._backoff_max = float(restart_backoff_max)
        self._rdzv: Rendezvous = resolve(spec.rdzv_handler, local_addr=spec.local_addr)
        self._state = WorkerState.INIT
        self._run_log_dir: str | None = None
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
        return self._run_log_dir

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
        self._running = True
        try:
            result = await self._invoke_run()
            self._record_final(result)
            return result
        except SignalException as exc:
            log.warning("received %s, stopped the workers", describe_signal(exc.sigval))
            self._state = WorkerState.STOPPED
            self._events.record("FAILED", "AGENT")
            raise
        except BaseException:
            if self._state != WorkerState.SUCCEEDED:
                self._state = WorkerState.UNKNOWN
            self._events.record("FAILED", "AGENT")
            raise
        finally:
            self._running = False
            self._prune_temp_logs()

    def _prune_temp_logs(self) -> None:
        # log_dir=None: the folders are ours; drop what holds nothing (empty
        # rank and attempt folders), keep and log what holds logs/error files.
        if self._log_dir is not None or self._logs_specs is not None:
            return
        run_dir = self._run_log_dir
        if run_dir is None:
            return
        prune_empty_dirs([run_dir, os.path.dirname(run_dir)], self._spec.role)
        if not os.path.isdir(run_dir):
            self._run_log_dir = None  # a later run() makes fresh ones

    async def _invoke_run(self) -> RunResult:
        spec = self._spec
        notice = omp_notice(spec.local_world_size, os.environ)
        if notice is not None:
            log.warning(notice)
        remaining = spec.max_restarts
        self._restart_count = 0
        membership_round = 0
        while True:
            rdzv_start = time.perf_counter()
            assignment = await self._rdzv.next_rendezvous(
                role=spec.role,
                local_world_size=spec.local_world_size,
                master_addr=spec.master_addr,
                master_port=spec.master_port,
            )
            # torch records both before the group learns its new size
            ev = self._events
            ev.run_id, ev.restart_count = assignment.run_id, self._restart_count
            ev.record("RENDEZVOUS", "AGENT", duration_ms=(time.perf_counter() - rdzv_start) * 1e3)
            ev.record("ASSIGN_WORKER_RANKS", "AGENT", duration_ms=0.0)
            ev.group_rank, ev.group_world_size = assignment.group_rank, assignment.group_world_size
            log.info(
                "[%s] rendezvous complete: run_id=%s group_rank=%d/%d ranks=%d..%d of %d "
                "master=%s:%d restart_count=%d",
                spec.role,
                assignment.run_id,
                assignment.group_rank,
                assignment.group_world_size,
                assignment.base_global_rank,
                assignment.base_global_rank + spec.local_world_size - 1,
                assignment.global_world_size,
                assignment.master_addr,
                assignment.master_port,
                self._restart_count,
            )
            result = await self._run_attempt(assignment, membership_round)
            if result is None:
                # membership change: a new round, same restart count (torch:
                # "membership changes do not count as retries")
                membership_round += 1
                log.info("[%s] new nodes are waiting to join; restarting the group", spec.role)
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
            failures = {base + r: f for r, f in result.failures.items()}
            rank, root = root_cause(failures)
            if remaining > 0:
                remaining -= 1
                self._restart_count += 1
                membership_round = 0
                delay = self._backoff_delay(self._restart_count)
                log.warning(
                    "[%s] worker group failed (rank %d: %s); %d/%d restarts left, restarting%s",
                    spec.role,
                    rank,
                    _describe(root),
                    remaining + 1,
                    spec.max_restarts,
                    f" in {delay:g}s" if delay else "",
                )
                self._state = WorkerState.STOPPED
                if delay:
                    await asyncio.sleep(delay)  # allowed: the backoff between attempts
                continue
            self._state = WorkerState.FAILED
            log.error(
                "[%s] worker group failed after %d restart(s); "
                "root cause: rank %d (local_rank %d) %s",
                spec.role,
                self._restart_count,
                rank,
                root.local_rank,
                _describe(root),
            )
            return RunResult(state=WorkerState.FAILED, failures=failures)

    def _record_final(self, result: RunResult) -> None:
        # torch's _record_worker_events, then the launcher's agent event
        if not self._events.enabled or self._last is None:
            return
        assignment, pids = self._last
        for r, pid in pids.items():
            g = assignment.base_global_rank + r
            failure = result.failures.get(g)
            if failure is not None or g in result.return_values:
                state = result.state.value
            else:
                state = "TERMINATED"  # stopped by the agent
            self._events.record(
                state,
                "WORKER",
                global_rank=g,
                local_rank=r,
                role_rank=assignment.base_role_rank + r,
                role_world_size=assignment.role_world_size,
                worker_id=str(pid),
                raw_error=json.dumps(failure.error_file_data) if failure else None,
                exit_code=failure.exitcode if failure else None,
                worker_pid=failure.pid if failure else None,
            )
        self._events.record(result.state.value, "AGENT")

    def _backoff_delay(self, restart_count: int) -> float:
        if self._backoff <= 0:
            return 0.0
        return float(min(self._backoff_max, self._backoff * 2 ** (restart_count - 1)))

    async def _run_attempt(
        self, assignment: GroupAssignment, membership_round: int
    ) -> RunProcsResult | None:
        """Start one attempt and await it; ``None`` means "stopped for new nodes"."""
        spec = self._spec
        n = spec.local_world_size
        envs = worker_envs(
            role=spec.role,
            local_world_size=n,
            assignment=assignment,
            restart_count=self._restart_count,
            max_restarts=spec.max_restarts,
            environ=os.environ,
            virtual_local_rank=spec.virtual_local_rank,
        )
        args = {r: substitute_local_rank(spec.args, r) for r in range(n)}
        entrypoint = spec.entrypoint
        if spec.numa_options is not None:
            # torch computes the binding when it starts the workers; so do we
            entrypoint, args = wrap_for_numa(
                entrypoint, args, numa_cpus(spec.numa_options, spec.local_world_size)
            )
        prefixes: dict[int, str] | None = None
        if self._prefix_template is not None:
            template = string.Template(self._prefix_template)
            prefixes = {
                r: template.safe_substitute(
                    role_name=spec.role, rank=assignment.base_global_rank + r, local_rank=r
                )
                for r in range(n)
            }
        logs: dict[str, Any]
        if self._logs_specs is not None:
            logs = {"logs_specs": self._logs_specs}
        else:
            logs = {
                "log_dir": self._attempt_dir(assignment.run_id, membership_round),
                "redirects": spec.redirects,
                "tee": spec.tee,
            }
        ctx = await start_processes(
            name=spec.role,
            entrypoint=entrypoint,
            args=args,
            envs=envs,
            start_method=self._start_method,
            log_line_prefixes=prefixes,
            shutdown_timeout=self._shutdown_timeout,
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
            watchdog=spec.watchdog,
            **logs,
        )
        self._state = WorkerState.HEALTHY
        pids = ctx.pids()
        self._last = (assignment, pids)
        for r, pid in pids.items():
            self._events.record(
                "START",
                "WORKER",
                global_rank=assignment.base_global_rank + r,
                local_rank=r,
                role_rank=assignment.base_role_rank + r,
                role_world_size=assignment.role_world_size,
                worker_id=str(pid),
            )
        try:
            return await self._monitor(ctx)
        finally:
            # A no-op after a result; after a membership change, a signal or
            # a cancellation it stops the group. Shielded so that a cancelled
            # run() cannot leave workers behind.
            with anyio.CancelScope(shield=True):
                await ctx.close(timeout=self._shutdown_timeout)

    def _attempt_dir(self, run_id: str, membership_round: int) -> str:
        if self._run_log_dir is None:
            if self._log_dir is None:
                root = make_temp_dir("aiolaunch_")  # the guardian knows it too
            else:
                try:
                    os.makedirs(self._log_dir, exist_ok=True)
                except OSError as exc:
                    raise log_dir_error("log_dir", self._log_dir, exc) from exc
                root = self._log_dir
            self._run_log_dir = make_run_dir(root, run_id)
        return attempt_dir_path(self._run_log_dir, self._restart_count, membership_round)

    async def _monitor(self, ctx: PContext) -> RunProcsResult | None:
        if not self._rdzv.elastic:
            # One machine: nothing but the workers' exits can change anything.
            result = await ctx.wait()
            assert result is not None
            return result
        wait_task = asyncio.ensure_future(ctx.wait())
        watch_task = asyncio.ensure_future(self._watch_membership())
        try:
            await asyncio.wait({wait_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watch_task, wait_task):
                if not task.done():
                    task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(watch_task, wait_task, return_exceptions=True)
        if not wait_task.cancelled():
            result = wait_task.result()  # raises SignalException after a signal
            if result is not None:
                return result
        return None

    async def _watch_membership(self) -> None:
        """Return when new agents wait to join (torch polls this each monitor tick)."""
        interval = max(self._spec.monitor_interval, _MEMBERSHIP_POLL_MIN)
        while True:
            await asyncio.sleep(interval)  # allowed: torch offers no event for joining nodes
            try:
                waiting = await self._rdzv.num_nodes_waiting()
            except Exception:
                # The store may go away when the node hosting it finishes; the
                # workers' exits still decide the attempt.
                log.warning("membership check failed; no longer watching", exc_info=True)
                await asyncio.Event().wait()
            if waiting > 0:
                return

    def __repr__(self) -> str:
        return (
            f"LocalElasticAgent(role={self._spec.role!r}, "
            f"local_world_size={self._spec.local_world_size}, run_id={self.run_id!r}, "
            f"state={self._state.value}, restart_count={self._restart_count})"
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
