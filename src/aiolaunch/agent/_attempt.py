"""One attempt of the agent's worker group: start it, await it, stop it.

:func:`run_attempt` starts the group of one rendezvous round with torchrun's
worker environment, awaits its outcome - or, with an elastic rendezvous, new
nodes waiting to join, which end the attempt without a result - and always
leaves the group stopped. :class:`AttemptLogs` says where each attempt's
logs go.
"""

from __future__ import annotations

import asyncio
import logging
import os
import string
from typing import TYPE_CHECKING, Any

import anyio

from .._api import start_processes
from .._logs._specs import attempt_dir_path, make_run_dir, make_temp_dir, prune_empty_dirs
from .._validate import log_dir_error
from ._env import substitute_local_rank, worker_envs
from ._numa import numa_cpus, wrap_for_numa

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from .._context import JobAttempt, PContext
    from .._results import RunProcsResult
    from ._rendezvous import GroupAssignment, Rendezvous
    from ._resilience import HostKeeper
    from ._spec import WorkerSpec

__all__ = ["AttemptLogs", "run_attempt"]

log = logging.getLogger("aiolaunch.agent")


class AttemptLogs:
    """Where the attempts of one agent put their logs.

    Attempt ``k`` of membership round ``m`` goes to
    ``{log_dir}/{run_id}_<unique>/attempt_{k}[_m]/`` (``log_dir=None``: a
    temporary folder, pruned of what holds nothing at the end), or follows
    ``logs_specs`` (torch's layout, its own folders).
    """

    def __init__(self, log_dir: str | None, logs_specs: Any, spec: WorkerSpec) -> None:
        self._log_dir = log_dir
        self._logs_specs = logs_specs
        self._spec = spec
        #: ``{log_dir}/{run_id}_<unique>`` once the first attempt started
        self.run_log_dir: str | None = None

    def kwargs(self, run_id: str, restart_count: int, membership_round: int) -> dict[str, Any]:
        """The log arguments of ``start_processes`` for one attempt."""
        if self._logs_specs is not None:
            return {"logs_specs": self._logs_specs}
        if self.run_log_dir is None:
            if self._log_dir is None:
                root = make_temp_dir("aiolaunch_")  # the guardian knows it too
            else:
                try:
                    os.makedirs(self._log_dir, exist_ok=True)
                except OSError as exc:
                    raise log_dir_error("log_dir", self._log_dir, exc) from exc
                root = self._log_dir
            self.run_log_dir = make_run_dir(root, run_id)
        return {
            "log_dir": attempt_dir_path(self.run_log_dir, restart_count, membership_round),
            "redirects": self._spec.redirects,
            "tee": self._spec.tee,
        }

    def prune(self) -> None:
        """``log_dir=None``: drop the folders that hold nothing (empty rank and
        attempt folders); what holds logs or error files is kept and logged."""
        if self._log_dir is not None or self._logs_specs is not None:
            return
        run_dir = self.run_log_dir
        if run_dir is None:
            return
        prune_empty_dirs([run_dir, os.path.dirname(run_dir)], self._spec.role)
        if not os.path.isdir(run_dir):
            self.run_log_dir = None  # a later run() makes fresh ones


async def run_attempt(
    spec: WorkerSpec,
    assignment: GroupAssignment,
    rdzv: Rendezvous,
    *,
    job: JobAttempt,
    logs: Mapping[str, Any],
    start_method: str,
    shutdown_timeout: float,
    prefix_template: str | None,
    started: Callable[[dict[int, int]], None],
    preload: list[str] | None = None,
    keeper: HostKeeper | None = None,
) -> RunProcsResult | None:
    """Start one attempt and await it; ``None`` means "the round must re-form"
    (new nodes, a host gone: :meth:`Rendezvous.membership_changed`).

    ``job`` is what the group knows of the job: the restart count (its
    ranks' ``TORCHELASTIC_RESTART_COUNT`` and the live view's restarts) and
    the job's metrics endpoint, served by the group while it runs.
    ``started(pids)`` is called once every worker runs. With a ``keeper``
    (the agent's :class:`~._resilience.HostKeeper`): its attempt marker goes
    to every worker, its progress probe to every rank, and its ``ending()``
    is called once the outcome is known, before the workers are stopped
    (what the next round needs can start meanwhile). The group is closed on
    every way out (shielded: a cancelled agent leaves no worker behind).

    :raises SignalException: a stop signal reached the agent meanwhile.
    """
    n = spec.local_world_size
    envs = worker_envs(
        role=spec.role,
        local_world_size=n,
        assignment=assignment,
        restart_count=job.restarts,
        max_restarts=spec.max_restarts,
        environ=os.environ,
        virtual_local_rank=spec.virtual_local_rank,
    )
    marker = keeper.attempt_env() if keeper is not None else {}
    for env in envs.values():
        env.update(marker)
    args = {r: substitute_local_rank(spec.args, r) for r in range(n)}
    entrypoint = spec.entrypoint
    if spec.numa_options is not None:
        # torch computes the binding when it starts the workers; so do we
        entrypoint, args = wrap_for_numa(entrypoint, args, numa_cpus(spec.numa_options, n))
    prefixes: dict[int, str] | None = None
    if prefix_template is not None:
        template = string.Template(prefix_template)
        prefixes = {
            r: template.safe_substitute(
                role_name=spec.role, rank=assignment.base_global_rank + r, local_rank=r
            )
            for r in range(n)
        }
    ctx = await start_processes(
        name=spec.role,
        entrypoint=entrypoint,
        args=args,
        envs=envs,
        start_method=start_method,
        log_line_prefixes=prefixes,
        shutdown_timeout=shutdown_timeout,
        duplicate_stdout_filters=spec.duplicate_stdout_filters,
        duplicate_stderr_filters=spec.duplicate_stderr_filters,
        watchdog=spec.watchdog,
        preload=preload,
        ready=keeper.probe() if keeper is not None else None,
        **logs,
    ).in_job(job)
    started(ctx.pids())
    try:
        outcome = await _monitor(ctx, rdzv, spec.monitor_interval)
        if keeper is not None:
            # A failure restarts only while the job has restarts left (this
            # attempt's failure is the job's restart number job.restarts + 1);
            # a re-forming round always follows.
            failed = outcome is not None and outcome.is_failed()
            keeper.ending(restart=outcome is None or (failed and job.restarts < spec.max_restarts))
        return outcome
    finally:
        # A no-op after a result; after a membership change, a signal or
        # a cancellation it stops the group. Shielded so that a cancelled
        # run() cannot leave workers behind.
        with anyio.CancelScope(shield=True):
            await ctx.close(timeout=shutdown_timeout)


async def _monitor(ctx: PContext, rdzv: Rendezvous, interval: float) -> RunProcsResult | None:
    if not rdzv.elastic:
        # One machine: nothing but the workers' exits can change anything.
        result = await ctx.wait()
        assert result is not None
        return result
    wait_task = asyncio.ensure_future(ctx.wait())
    watch_task = asyncio.ensure_future(_watch_membership(rdzv, interval))
    reason = None
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
    if watch_task.done() and not watch_task.cancelled():
        reason = watch_task.result()
    log.info("the round re-forms: %s", reason)
    return None


async def _watch_membership(rdzv: Rendezvous, interval: float) -> str:
    """Why the round must re-form, once it must (new nodes, a host gone)."""
    try:
        return await rdzv.membership_changed(interval)
    except Exception:
        # The store may go away when the node hosting it finishes; the
        # workers' exits still decide the attempt.
        log.warning("membership check failed; no longer watching", exc_info=True)
        await asyncio.Event().wait()
        raise AssertionError("unreachable") from None
