"""What an agent does for the job's hosts between its attempts: :class:`Resilience` and its keeper.

:class:`Resilience` is the policy (the command line's ``--quarantine-*``,
``--health-check*``, ``--max-no-progress-restarts``, ``--progress-regex``,
``--restart-resources``). :class:`HostKeeper` carries it out for one agent,
so that the agent's loop stays a loop: the health check before each round
(run by the rendezvous itself with aiolaunch's rounds, where a spare can
take the host's place; before the rendezvous otherwise), the progress of
each attempt, the clean restart, the job's count of restarts and of
attempts without progress (:mod:`._ledger`), and the ``"hosts"`` section of
the live view.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from .._sections import register_section
from ._clean import ATTEMPT_ENV, make_clean, parse_resources
from ._health import HealthCheck, HealthGate
from ._hosts import hosts_metrics
from ._progress import ProgressTracker
from ._quarantine import HostExcluded, QuarantinePolicy, lost_a_peer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from .._results import ProcessFailure
    from ._progress import ProgressProbe
    from ._rendezvous import GroupAssignment, Rendezvous

__all__ = ["HostKeeper", "Resilience"]

log = logging.getLogger("aiolaunch.agent")


@dataclass(frozen=True)
class Resilience:
    """How the job treats its hosts (all off by default).

    :param quarantine_after: a host charged with this many failed rounds
        within ``quarantine_window`` seconds leaves the job for
        ``quarantine_ttl`` seconds (needs aiolaunch's rounds: c10d or etcd-v3).
    :param health_check: a shell command run on the host before it joins
        each round (the first too); a non-zero exit or ``health_check_timeout``
        keeps the host out of that round.
    :param max_no_progress_restarts: stop restarting after this many attempts
        in a row that made no progress (no line matching ``progress_regex``
        in any rank of any host).
    :param progress_regex: what a progress line looks like (``re.search``).
    :param restart_resources: paths or globs (``/dev/nvidia*``) and
        ``port:N`` that no process of an attempt may still hold when the
        next one starts on this host.
    :raises ValueError: a bad value, naming the argument and the fix.
    """

    quarantine_after: int | None = None
    quarantine_window: float = 3600.0
    quarantine_ttl: float = 3600.0
    health_check: str | None = None
    health_check_timeout: float = 60.0
    max_no_progress_restarts: int | None = None
    progress_regex: str | None = None
    restart_resources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.quarantine()  # each builder checks its values
        self.check()
        n = self.max_no_progress_restarts
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"max_no_progress_restarts={n!r} must be an int >= 1, e.g. 3")
            if self.progress_regex is None:
                raise ValueError(
                    "max_no_progress_restarts needs progress_regex (--progress-regex): the "
                    "pattern of your progress lines, e.g. '^step '"
                )
        if self.progress_regex is not None:
            try:
                re.compile(self.progress_regex)
            except (re.error, TypeError) as exc:
                raise ValueError(
                    f"progress_regex={self.progress_regex!r} is not a regular expression: {exc}"
                ) from None
        if not isinstance(self.restart_resources, tuple):
            raise TypeError(f"restart_resources={self.restart_resources!r} must be a tuple of str")
        parse_resources(self.restart_resources)

    def quarantine(self) -> QuarantinePolicy | None:
        if self.quarantine_after is None:
            return None
        return QuarantinePolicy(self.quarantine_after, self.quarantine_window, self.quarantine_ttl)

    def check(self) -> HealthCheck | None:
        if self.health_check is None:
            return None
        return HealthCheck(self.health_check, self.health_check_timeout)


class HostKeeper:
    """One agent's side of :class:`Resilience` (see the module docstring).

    :param bound: how long a clean restart may wait (the shutdown timeout).
    """

    def __init__(self, policy: Resilience | None, rdzv: Rendezvous, bound: float) -> None:
        if policy is not None and not isinstance(policy, Resilience):
            raise TypeError(f"resilience={policy!r} must be an aiolaunch.agent.Resilience")
        self.policy = policy or Resilience()
        self._rdzv = rdzv
        self._bound = bound
        check = self.policy.check()
        self._gate = None if check is None else HealthGate(check)
        self.progress = ProgressTracker(self.policy.progress_regex, self._report_progress)
        self._round = 0
        self._ended_at: float | None = None
        self._attempts = 0
        self._token = ""
        self._pids: list[int] = []
        self._tasks: set[asyncio.Future[None]] = set()
        self._unregister: Callable[[], None] = _nothing

    async def begin(self) -> None:
        """Before the first round: tell the rendezvous the policy, show the hosts."""
        rdzv = self._rdzv
        if self.policy.quarantine_after is not None and rdzv.hosts() is None:
            raise ValueError(
                "quarantine_after keeps its records in the store of aiolaunch's rounds: use "
                "a c10d or etcd-v3 handler made by aiolaunch (the command line's "
                "--rdzv-backend c10d|etcd-v3)"
            )
        admit = self._gate.admit if self._gate is not None and rdzv.admits else None
        rdzv.configure(quarantine=self.policy.quarantine(), admit=admit)
        if rdzv.hosts() is not None:
            self._unregister = register_section("hosts", rdzv.hosts, hosts_metrics)
        await self.before_round()

    async def before_round(self) -> None:
        """The health check, where the rendezvous does not run it itself: a host
        that fails it cannot run (no spare can stand in)."""
        if self._gate is None or self._rdzv.admits:
            return
        reason = await anyio.to_thread.run_sync(self._gate.admit, abandon_on_cancel=True)
        if reason is not None:
            host = self._rdzv.host
            raise HostExcluded(f"{host} failed its health check: {reason}", "health-check")

    async def restart_count(self) -> int:
        """The job's restarts so far (every host counts the same)."""
        return int(await anyio.to_thread.run_sync(self._rdzv.ledger.restarts))

    def attempt_env(self) -> dict[str, str]:
        """The marker of the next attempt's processes (:mod:`._clean`)."""
        self._attempts += 1
        self._token = f"{os.getpid()}-{os.urandom(4).hex()}-{self._attempts}"
        return {ATTEMPT_ENV: self._token}

    def probe(self) -> ProgressProbe | None:
        """The progress probe of every rank (``start_processes(ready=...)``)."""
        return self.progress.probe()

    def started(self, assignment: GroupAssignment, pids: dict[int, int]) -> None:
        self._round = assignment.rdzv_round
        self._pids = list(pids.values())
        self.progress.attempt_started()

    def ending(self, *, restart: bool) -> None:
        """The attempt's outcome is known (``restart``: a next round may follow):
        the next round's health check starts now, while the workers are stopped."""
        # When this host learned its attempt ended: the host whose worker
        # failed first learns first (its peers' workers fail after it).
        self._ended_at = time.time()
        if self._gate is not None and restart:
            self._gate.start()

    async def after_attempt(self) -> None:
        """The workers are stopped: make sure nothing of the attempt is left."""
        if not self._token:
            return
        report = await make_clean(
            self._token, self._pids, self.policy.restart_resources, (self._bound)
        )
        (log.info if report.clean and not report.killed else log.warning)(
            "restart of this host: %s", report.describe()
        )
        tasks, self._tasks = self._tasks, set()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _report_progress(self) -> None:
        ledger, round_ = self._rdzv.ledger, self._round

        async def write() -> None:
            try:
                await anyio.to_thread.run_sync(ledger.mark_progress, round_)
            except Exception as exc:  # the store may be gone; the attempt goes on
                log.info("could not record the round's progress: %s", exc)

        self._tasks.add(asyncio.ensure_future(write()))

    async def record_failure(self, why: str, failures: Iterable[ProcessFailure]) -> tuple[int, int]:
        """This host's workers failed: ``(the job's restarts, attempts in a row
        without progress)``, the same on every host.

        The record says whether a worker was killed by a signal (SIGABRT aside:
        NCCL's watchdog aborts the victims of a lost peer too) and whether
        every error names a lost peer (:func:`~._quarantine.lost_a_peer`):
        what the charge of the round to one host weighs first.
        """
        failures = list(failures)
        crashed = any(f.exitcode < 0 and -f.exitcode != signal.SIGABRT for f in failures)
        texts = [f"{f.error_message}\n{f.py_callstack or ''}" for f in failures]
        peer = bool(texts) and all(lost_a_peer(t) for t in texts)
        rdzv = self._rdzv
        record = functools.partial(
            rdzv.ledger.record,
            self._round,
            "failed",
            rdzv.node_id,
            rdzv.host,
            why,
            self._ended_at,
            signal=crashed,
            peer=peer,
        )
        with anyio.CancelScope(shield=True):
            got = await anyio.to_thread.run_sync(record)
        return got

    def crash_loop(self, streak: int, why: str) -> str | None:
        """The termination message when ``streak`` attempts in a row made no progress."""
        n = self.policy.max_no_progress_restarts
        if n is None or streak < n:
            return None
        return (
            f"crash loop: {streak} attempt(s) in a row made no progress (no line matching "
            f"--progress-regex {self.policy.progress_regex!r} on any host); "
            f"stopped (--max-no-progress-restarts {n}): a retry fails the same way until "
            f"the cause is fixed. Last failure: {why}"
        )

    async def leave(self) -> None:
        """This agent goes (a signal): the other hosts know at once."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await self._rdzv.leave()
            except Exception as exc:
                log.info("could not leave the rendezvous: %s", exc)

    def close(self) -> None:
        """The run is over: no section any more, no check left running."""
        self._unregister()
        self._unregister = _nothing
        if self._gate is not None:
            self._gate.cancel()


def _nothing() -> None:
    pass
