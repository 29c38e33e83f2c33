"""Per-group hang forensics: stack dumps, the watchdog loop, status, reports.

Where it sits (see docs/ARCHITECTURE.md): the context owns one
:class:`Forensics`. It gives every worker ``$AIOLAUNCH_STACKS_DIR`` (the
bootstraps register the dump signal there), serves the control socket, and -
with a :class:`Watchdog` - runs one task that samples ``/proc`` once per
period for the whole group; with a progress regex, a line listener of the log
pipeline (:class:`~._watchdog.ProgressLines`) marks the ranks that print. A
stall is handled in this order: event, stacks of every rank, report, *then*
the action (``fail`` marks the rank and wakes ``wait()``, which stops the
group through the usual shutdown path and calls :meth:`amend` on the result).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._logs._specs import make_temp_dir, prune_empty_dirs
from ._stacks import STACKS_DIR_ENV, StackReport, dump_stacks, rank_ranges
from ._watchdog import ProgressLines, RankActivity, Watchdog, wchan
from ._workers._guardian import clean_up_after

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._context import PContext
    from ._control import ControlServer, WorkerStatus
    from ._results import RunProcsResult

__all__ = ["Forensics", "Stall"]

logger = logging.getLogger("aiolaunch")

_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk-sleep",
    "T": "stopped",
    "t": "stopped",
    "Z": "exited",
    "I": "sleeping",
}


@dataclass
class Stall:
    """A rank the watchdog flagged: why, how long, and where it is."""

    rank: int
    pid: int
    idle_s: float
    reason: str
    verdict_line: str = ""
    stacks_file: str = ""
    detected: float = 0.0  # time.time()

    def message(self) -> str:
        """The text that becomes the rank's ``ProcessFailure.message``."""
        # The summary goes last, as an exception's line ends a traceback (the
        # agent's one-line log of the root cause shows the last line).
        head = f"stacks: {self.stacks_file}\n" if self.stacks_file else ""
        where = f"; {self.verdict_line}" if self.verdict_line else ""
        return f"{head}stalled: {self.reason}{where}"


class Forensics:
    """Stacks, watchdog, status and reports of one :class:`PContext`."""

    def __init__(self, ctx: PContext, watchdog: Watchdog | None) -> None:
        self._ctx = ctx
        self.watchdog = watchdog
        self.log_dir, self._own_dir = _group_dir(ctx.error_files)
        self.log_dir = os.path.abspath(self.log_dir)
        # Made as start_processes returns (make_files), not before the first
        # spawn: a mkdir costs as much as a spawn. A worker's bootstrap that
        # gets there first makes it itself (_dump_handler.register).
        self.stacks_dir = os.path.join(self.log_dir, ".aiolaunch-stacks")
        if not os.access(self.log_dir, os.W_OK | os.X_OK):
            # A LogsSpecs with an unusual layout may leave no writable group
            # folder: dumps still work from a private one.
            self.stacks_dir = tempfile.mkdtemp(prefix="aiolaunch_stacks_")
        self._activity: dict[int, RankActivity] = {}
        self._progress = re.compile(watchdog.progress) if watchdog and watchdog.progress else None
        #: the progress regex's line listener (the group subscribes it), or None
        self.progress_lines = (
            ProgressLines(watchdog.progress, self._activity)
            if watchdog and watchdog.progress
            else None
        )
        self._dumps = 0
        self._dump_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._server: ControlServer | None = None
        self._forget_stacks: Callable[[], None] = lambda: None
        self._server_task: asyncio.Task[None] | None = None
        #: ranks flagged and not active since
        self.flagged: dict[int, Stall] = {}
        #: stalls that fail the group (action "fail", or "restart" without a policy)
        self.failing: dict[int, Stall] = {}
        self.stall_report: StackReport | None = None
        self.stall_dumps: dict[int, str] = {}
        self._closed = False
        #: a report was written (its paths)
        self.reported: tuple[str, str] | None = None

    # -- wiring -------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment every worker gets."""
        return {STACKS_DIR_ENV: self.stacks_dir}

    async def start(self, make_files: Callable[[], None] = lambda: None) -> None:
        """Start serving the control socket and start the watchdog. Called once all ranks started.

        The stacks folder, then ``make_files()`` (the group's other files),
        then the socket are made by a task of its own that runs as soon as the
        caller yields to the loop (together ~0.7 ms: off the path to
        ``start_processes`` returning); ``status``/``stacks`` clients are
        separate processes, which take far longer to start than that.
        """
        self._server_task = asyncio.ensure_future(self._serve(make_files))
        if self.watchdog is not None:
            self._task = asyncio.ensure_future(self._watch(self.watchdog))

    async def _serve(self, make_files: Callable[[], None]) -> None:
        from ._control import ControlServer

        try:
            os.makedirs(self.stacks_dir, mode=0o700, exist_ok=True)
        except OSError as exc:  # dumps are impossible; the job runs on
            logger.warning("aiolaunch: no stacks folder %s: %s", self.stacks_dir, exc)
        # removed by the guardian if the supervisor dies before cleanup()
        self._forget_stacks = clean_up_after("T", self.stacks_dir)
        make_files()
        try:
            self._server = await ControlServer.start(self.log_dir, self._handle)
        except OSError as exc:  # a status endpoint must never stop a job
            logger.warning("aiolaunch: no control socket in %s: %s", self.log_dir, exc)

    async def stop(self) -> None:
        """Stop the watchdog and the control socket (the group is ending). Idempotent."""
        # A server still being set up is stopped too (ControlServer.start
        # removes its files when cancelled).
        tasks = [t for t in (self._task, self._server_task) if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._server_task = None
        for act in self._activity.values():
            act.close()
        if self._server is not None:
            # Stop listening now; the socket's files go in cleanup() (file
            # I/O, off wait()'s path).
            self._server.close()

    def cleanup(self) -> None:
        """Remove the control socket's files, the dump scratch folder (and a
        temporary log dir of our own)."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.remove()
            self._server = None
        for act in self._activity.values():
            act.close()
        self._activity.clear()
        shutil.rmtree(self.stacks_dir, ignore_errors=True)
        self._forget_stacks()
        # A temporary log dir of our own is kept when it holds stacks or a report.
        if self._own_dir and not self._dumps and not self.reported:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if self._own_dir:  # gone, or kept with stacks or a report; the guardian forgets it
            prune_empty_dirs([self.log_dir])

    # -- stacks -------------------------------------------------------------
    def _rank_dir(self, rank: int) -> str:
        path = self._ctx.error_files.get(rank, "")
        if path and path != os.devnull:
            return os.path.dirname(os.path.abspath(path))
        d = os.path.join(self.log_dir, str(rank))
        os.makedirs(d, exist_ok=True)
        return d

    async def dump_stacks(self, ranks: list[int] | None, timeout: float) -> dict[int, str]:
        """:meth:`PContext.dump_stacks`: check the arguments, then :meth:`dump`.

        :raises ValueError: an unknown rank, or ``timeout`` not a finite number > 0.
        """
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf
        ):
            raise ValueError(
                f"dump_stacks(timeout={timeout!r}) must be a number of seconds > 0 (finite), "
                "e.g. timeout=5.0"
            )
        nprocs = self._ctx.nprocs
        if ranks is not None and not isinstance(ranks, list | tuple | set | frozenset | range):
            raise TypeError(f"dump_stacks(ranks={ranks!r}) must be a list of local ranks or None")
        bad = [r for r in ranks or () if isinstance(r, bool) or r not in range(nprocs)]
        if bad:
            raise ValueError(f"dump_stacks(ranks={ranks!r}): local ranks are 0..{nprocs - 1}")
        dumps, _ = await self.dump(ranks, float(timeout))
        return dumps

    async def dump(
        self, ranks: list[int] | None, timeout: float
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Dump live workers' stacks; write ``stacks-<n>.txt``. Returns (dumps, files)."""
        workers = self._ctx._workers
        wanted = sorted(workers) if ranks is None else sorted(ranks)
        async with self._dump_lock:  # numbered files; one signal round at a time
            self._dumps += 1
            n = self._dumps
            pids: dict[int, int] = {}
            dumps: dict[int, str] = {}
            for rank in wanted:
                w = workers.get(rank)
                if w is None:
                    dumps[rank] = "<not started>"
                elif not w.alive:
                    dumps[rank] = f"<pid {w.pid} exited with {w.returncode}>"
                else:
                    pids[rank] = w.pid
            dumps.update(await dump_stacks(self.stacks_dir, pids, timeout))
            for rank in pids:  # our dump's own write() must not look like output
                act = self._activity.get(rank)
                if act is not None and act.pid == pids[rank]:
                    act.rebase()
            files = self._write_dumps(dumps, n)
        return dict(sorted(dumps.items())), files

    def _write_dumps(self, dumps: dict[int, str], n: int) -> dict[int, str]:
        # Small files into the page cache: not worth a thread hop.
        files: dict[int, str] = {}
        for rank in sorted(dumps):
            path = os.path.join(self._rank_dir(rank), f"stacks-{n}.txt")
            try:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(dumps[rank])
                files[rank] = path
            except OSError as exc:
                logger.warning("aiolaunch: cannot write %s: %s", path, exc)
        return files

    # -- status ---------------------------------------------------------------
    def status(self) -> list[WorkerStatus]:
        """Every rank's state now (see :class:`WorkerStatus`)."""
        from ._control import WorkerStatus

        ctx = self._ctx
        now = time.monotonic()
        out: list[WorkerStatus] = []
        for rank in range(ctx.nprocs):
            w = ctx._workers.get(rank)
            if w is None:
                out.append(WorkerStatus(rank, 0, "starting", 0, None, 0.0, 0))
                continue
            restarts = ctx._restarts.attempts.get(rank, 0)
            if rank in ctx._restarts.pending:
                out.append(WorkerStatus(rank, w.pid, "restarting", restarts, None, 0.0, 0))
                continue
            if not w.alive:
                out.append(
                    WorkerStatus(rank, w.pid, "exited", restarts, None, 0.0, 0, w.returncode)
                )
                continue
            act = self._tracked(rank, w.pid, now)
            if self.watchdog is None or self._task is None:
                act.sample(now, progress=False)  # no watchdog: sample on demand
            act.refresh_stat()
            age = ctx._logs.last_output(rank)
            if age is not None:
                act.seen(now - age)
            state = _STATES.get(act.state, act.state)
            if rank in self.flagged:
                state = "stalled"
            age = None if act.last_output is None else round(now - act.last_output, 3)
            out.append(
                WorkerStatus(rank, w.pid, state, restarts, age, round(act.cpu_percent, 1), act.rss)
            )
        return out

    def _tracked(self, rank: int, pid: int, now: float) -> RankActivity:
        act = self._activity.get(rank)
        if act is None or act.pid != pid:  # first sight, or a restarted rank
            if act is not None:
                act.close()
            act = self._activity[rank] = RankActivity(pid, now)
            act.sample(now, progress=self._progress is not None)
            act.last_active = now
        return act

    async def _handle(self, req: dict[str, Any]) -> dict[str, Any]:
        cmd = req.get("cmd")
        if cmd == "status":
            return {
                "ok": True,
                "name": self._ctx.name,
                "log_dir": self.log_dir,
                "workers": [s.to_json() for s in self.status()],
            }
        if cmd == "stacks":
            timeout = float(req.get("timeout", 5.0))
            dumps, files = await self.dump(None, timeout)
            report = StackReport.from_dumps(dumps)
            return {
                "ok": True,
                "stacks": {str(r): t for r, t in dumps.items()},
                "files": {str(r): p for r, p in files.items()},
                "verdict": str(report),
                "report": report.to_json(),
            }
        return {"ok": False, "error": f"unknown command {cmd!r} (status, stacks)"}

    # -- watchdog -------------------------------------------------------------
    async def _watch(self, wd: Watchdog) -> None:
        ctx = self._ctx
        while True:
            await asyncio.sleep(wd.period)  # allowed: /proc has no change events
            now = time.monotonic()
            newly: list[Stall] = []
            for rank, w in list(ctx._workers.items()):
                if not w.alive or rank in ctx._restarts.pending:
                    self.flagged.pop(rank, None)
                    gone = self._activity.pop(rank, None)
                    if gone is not None:
                        gone.close()
                    continue
                fresh = rank not in self._activity or self._activity[rank].pid != w.pid
                act = self._tracked(rank, w.pid, now)
                if fresh:
                    continue
                if not act.sample(now, progress=self._progress is not None):
                    continue
                if self._progress is None and not act.sees_writes:
                    # No /proc/<pid>/io here: what the log pipeline saw instead.
                    age = ctx._logs.last_output(rank)
                    if age is not None:
                        act.seen(now - age)
                idle = now - act.last_active
                if idle < wd.stall_after:
                    self.flagged.pop(rank, None)  # active again: the next stall is new
                    continue
                if rank in self.flagged or rank in self.failing:
                    continue
                act.refresh_stat()
                if act.state == "D":
                    where = wchan(w.pid)
                    reason = (
                        f"in uninterruptible sleep (D state){f' in {where}' if where else ''}, "
                        f"no CPU for {idle:.1f}s (stall_after={wd.stall_after:g}s)"
                    )
                else:
                    what = "no progress line" if self._progress is not None else "no output"
                    reason = f"{what} and no CPU for {idle:.1f}s (stall_after={wd.stall_after:g}s)"
                stall = Stall(rank, w.pid, round(idle, 3), reason, detected=time.time())
                self.flagged[rank] = stall
                newly.append(stall)
            if newly:
                try:
                    await self._on_stall(wd, newly)
                except Exception:  # the watchdog must outlive a failed dump or report
                    logger.exception("aiolaunch: handling the stall of %r failed", ctx.name)

    async def _on_stall(self, wd: Watchdog, stalls: list[Stall]) -> None:
        from ._events import WorkerStalled

        ctx = self._ctx
        for s in stalls:
            ctx._bus.emit(
                WorkerStalled(rank=s.rank, time=time.monotonic(), idle_s=s.idle_s, reason=s.reason)
            )
        # Every rank's stacks before anything is stopped: the others show what
        # the stalled one is waiting for (or what waits for it).
        dumps, files = await self.dump(None, timeout=5.0)
        report = StackReport.from_dumps(dumps)
        self.stall_report, self.stall_dumps = report, dumps
        for s in stalls:
            s.verdict_line = report.line_for(s.rank) or ""
            s.stacks_file = files.get(s.rank, "")
        from ._report import write_report

        paths = self.reported = write_report(self, None)
        ranks = rank_ranges(s.rank for s in stalls)
        logger.warning(
            "aiolaunch: %s %s of %r stalled (%s); stacks of every rank dumped. Verdict:\n%s\n"
            "Report: %s",
            "rank" if len(stalls) == 1 else "ranks", ranks, ctx.name, stalls[0].reason,
            report, paths[1] if paths else "(not written)",
        )  # fmt: skip
        if wd.action == "observe":
            return
        # Ranks that stalled together usually wait for one another: when some
        # of them are the odd ones out, those are the failure, and the rest
        # (stopped by aiolaunch) are listed as stalled in the report only.
        chosen = [s for s in stalls if s.rank in report.outliers]
        if not chosen:
            # The odd one out may have gone quiet a moment after the others
            # (its stall would be detected next period): it is still the cause.
            chosen = self._quiet_outliers(wd, report.outliers, files) or stalls
        for s in chosen:
            w = ctx._workers.get(s.rank)
            if (
                wd.action == "restart"
                and s.rank in ctx._restarts._trackers
                and w is not None
                and w.alive
            ):
                # The rank's restart policy takes it from here: a SIGKILLed
                # worker is a failed exit (stacks are already on disk).
                w.failure_reason = f"stalled: {s.reason}"
                w.signal_tree(signal.SIGKILL)
                continue
            self.failing[s.rank] = s
        if self.failing:
            ctx._changed.set()

    def _quiet_outliers(
        self, wd: Watchdog, outliers: list[int], files: dict[int, str]
    ) -> list[Stall]:
        now = time.monotonic()
        out: list[Stall] = []
        for rank in outliers:
            act = self._activity.get(rank)
            if act is None or now - act.last_active < wd.period:
                continue
            idle = now - act.last_active
            reason = f"no output and no CPU for {idle:.1f}s while its peers stalled"
            s = Stall(rank, act.pid, round(idle, 3), reason, detected=time.time())
            s.verdict_line = (self.stall_report.line_for(rank) if self.stall_report else "") or ""
            s.stacks_file = files.get(rank, "")
            self.flagged[rank] = s
            out.append(s)
        return out

    # -- result ---------------------------------------------------------------
    def finish(self, result: RunProcsResult, *, conclude: bool = True) -> RunProcsResult:
        """The group ended: amend ``result``; with ``conclude`` also :meth:`conclude`
        (else the caller does, later: file I/O off ``wait()``'s path)."""
        result = self.amend(result)
        if conclude:
            self.conclude(result)
        return result

    def conclude(self, result: RunProcsResult) -> None:
        """Write the report if the group failed, then clean up. Plain file I/O
        on state that no longer changes: safe in a worker thread."""
        from ._report import write_report

        if self._closed:  # concluded (or cleaned up) already
            return
        if result.is_failed():
            self.reported = write_report(self, result)
            if self.reported is not None:
                logger.warning(
                    "aiolaunch: group %r failed; report: %s", self._ctx.name, self.reported[1]
                )
        self.cleanup()

    def amend(self, result: RunProcsResult) -> RunProcsResult:
        """Put the stalled ranks first among ``result.failures``, saying why."""
        from ._results import ProcessFailure

        if not self.failing:
            return result
        failures: dict[int, ProcessFailure] = {}
        # The outliers first: among ranks stalled together, the odd one out is
        # the root cause (the others wait for it).
        outliers = set(self.stall_report.outliers) if self.stall_report else set()
        for rank, s in sorted(self.failing.items(), key=lambda kv: (kv[0] not in outliers, kv[0])):
            old = result.failures.get(rank)
            w = self._ctx._workers[rank]
            f = old or ProcessFailure(
                local_rank=rank,
                pid=s.pid,
                exitcode=w.returncode if w.returncode is not None else -signal.SIGTERM,
                error_file=self._ctx.error_files.get(rank, ""),
            )
            f.message = s.message()
            f.timestamp = min(f.timestamp, int(s.detected))
            failures[rank] = f
        for rank, f in result.failures.items():
            failures.setdefault(rank, f)
        result.failures = failures
        result.return_values = {}
        return result


def _group_dir(error_files: dict[int, str]) -> tuple[str, bool]:
    # The folder holding the rank folders: {log_dir} in aiolaunch's layout,
    # {run}/attempt_N in torch's. Without one (logs to /dev/null), our own.
    for path in error_files.values():
        if path and path != os.devnull:
            return os.path.dirname(os.path.dirname(path)), False
    return make_temp_dir("aiolaunch_forensics_"), True
