"""The run report: ``{log_dir}/report.json`` and a readable ``report.txt``.

Written when a group fails (after its result) and when the watchdog flags a
stall (then without an outcome yet). It names the root cause - rank, exit
code or signal, the recorded exception and traceback, or for programs
without ``@record`` the last lines of their stderr log - the ranks that
failed on their own vs. those aiolaunch stopped, the stalled ranks with
their stacks and the outlier verdict, where every live rank was at the
first failure (with a watchdog), the collectives' verdict (torch ranks, with a
watchdog: ``"collective"``, one sentence in ``report.txt``), and the
stragglers named.

:class:`RunReport` is a plain frozen dataclass built from plain values
(:meth:`RunReport.build`); it knows nothing of the context that made it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._results import root_cause, stderr_tail
from .._sections import sections as job_sections

if TYPE_CHECKING:
    from collections.abc import Container, Iterable, Mapping

    from .._results import RunProcsResult
    from ._collective import CollectiveVerdict
    from ._stacks import StackReport
    from ._stall import Stall

__all__ = ["AtFailure", "RunReport", "Straggler", "write_report"]

logger = logging.getLogger("aiolaunch")

_TAIL_LINES = 20


@dataclass(frozen=True)
class RootCause:
    """The failure that came first (:func:`aiolaunch._results.root_cause`)."""

    rank: int
    pid: int
    exitcode: int
    signal: str | None
    message: str
    traceback: str | None
    error_file: str
    stderr_tail: list[str]
    #: why there is no tail (stderr went to the console, /dev/null, nothing written)
    stderr_note: str | None = None


@dataclass(frozen=True)
class StalledRank:
    """A stalled rank as the report shows it."""

    rank: int
    pid: int
    idle_s: float
    reason: str
    where: str
    stacks_file: str
    stacks: str


@dataclass(frozen=True)
class AtFailure:
    """Where every live rank was when ``rank`` failed (with a watchdog: their
    stacks are dumped before they are stopped)."""

    rank: int
    verdict: StackReport
    stacks: dict[int, str]
    files: dict[int, str]

    def lines(self) -> str:
        """The verdict's lines (``ranks 0,2: where``), one per place."""
        return str(self.verdict)


@dataclass(frozen=True)
class Straggler:
    """A rank the watchdog named a straggler.

    ``source``: ``"collectives"`` (its arrivals at collectives: ``lateness_s``
    is its median lateness, ``samples`` the collectives compared) or
    ``"stacks"`` (stack samples: ``lateness_s`` is ``None``).
    """

    rank: int
    wait_share: float
    peers_wait_share: float
    samples: int
    lateness_s: float | None = None
    source: str = "stacks"


@dataclass(frozen=True)
class RunReport:
    """Everything the report says, as plain values."""

    name: str
    log_dir: str
    time: str
    outcome: str  # "running" (a stall, no outcome yet), "failed" or "ok"
    root_cause: RootCause | None = None
    #: ranks that failed on their own (not for a stall)
    failed: list[int] | None = None
    stopped_by_aiolaunch: list[int] | None = None
    stalled: list[StalledRank] = field(default_factory=list)
    verdict: StackReport | None = None
    at_failure: AtFailure | None = None
    stragglers: list[Straggler] = field(default_factory=list)
    collective: CollectiveVerdict | None = None
    #: the job's sections of the live view when it was written (its hosts)
    sections: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        *,
        name: str,
        log_dir: str,
        result: RunProcsResult | None,
        stopped: Iterable[int] = (),
        forced: Container[int] = (),
        stderrs: Mapping[int, str] | None = None,
        stalls: Iterable[Stall] = (),
        verdict: StackReport | None = None,
        dumps: Mapping[int, str] | None = None,
        at_failure: AtFailure | None = None,
        stragglers: Iterable[Straggler] = (),
        collective: CollectiveVerdict | None = None,
    ) -> RunReport:
        """The report of group ``name``.

        :param result: the outcome, or ``None`` while it runs.
        :param stopped: ranks the supervisor stopped on purpose.
        :param forced: ranks failed for a stall (not "failed on their own").
        :param stderrs: ``{rank: stderr log path}`` for the root cause's tail.
        :param stalls: the stalled ranks, with ``dumps`` their stacks.
        :param at_failure: where the live ranks were at the first failure.
        :param stragglers: the ranks named stragglers.
        :param collective: the collectives' verdict (a stall's, or the first failure's).
        """
        outcome = "running" if result is None else ("failed" if result.is_failed() else "ok")
        cause: RootCause | None = None
        failed = stopped_list = None
        if result is not None and result.failures:
            rank, f = root_cause(result.failures)
            tail, no_tail = stderr_tail((stderrs or {}).get(rank, ""), _TAIL_LINES)
            cause = RootCause(
                rank=rank,
                pid=f.pid,
                exitcode=f.exitcode,
                signal=None if f.exitcode >= 0 else f.signal_name(),
                message=f.error_message,
                traceback=f.py_callstack,
                error_file=f.error_file,
                stderr_tail=tail,
                stderr_note=no_tail,
            )
            failed = sorted(r for r in result.failures if r not in forced)
            stopped_list = sorted(r for r in stopped if r not in result.failures)
        stalled = [
            StalledRank(
                s.rank,
                s.pid,
                s.idle_s,
                s.reason,
                s.verdict_line,
                s.stacks_file,
                (dumps or {}).get(s.rank, ""),
            )
            for s in sorted(stalls, key=lambda s: s.rank)
        ]
        return cls(
            name=name,
            log_dir=log_dir,
            time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            outcome=outcome,
            root_cause=cause,
            failed=failed,
            stopped_by_aiolaunch=stopped_list,
            stalled=stalled,
            verdict=verdict,
            at_failure=at_failure,
            stragglers=sorted(stragglers, key=lambda s: s.rank),
            collective=collective,
            sections=job_sections(),
        )

    def to_json(self) -> dict[str, Any]:
        """``report.json``'s content."""
        data: dict[str, Any] = {
            "name": self.name,
            "log_dir": self.log_dir,
            "time": self.time,
            "outcome": self.outcome,
        }
        if self.root_cause is not None:
            data["root_cause"] = vars(self.root_cause).copy()
            data["failed"] = self.failed
            data["stopped_by_aiolaunch"] = self.stopped_by_aiolaunch
        if self.stalled:
            data["stalled"] = [vars(s).copy() for s in self.stalled]
        if self.verdict is not None:
            data["verdict"] = {**self.verdict.to_json(), "text": str(self.verdict)}
        if self.at_failure is not None:
            a = self.at_failure
            data["at_failure"] = {
                "rank": a.rank,
                "verdict": {**a.verdict.to_json(), "text": str(a.verdict)},
                "stacks": {str(r): t for r, t in sorted(a.stacks.items())},
                "files": {str(r): p for r, p in sorted(a.files.items())},
            }
        if self.stragglers:
            data["stragglers"] = [vars(s).copy() for s in self.stragglers]
        if self.collective is not None:
            data["collective"] = self.collective.to_json()
        data.update(self.sections)
        return data

    def to_text(self) -> str:
        """``report.txt``: the report for people."""
        out = [f"aiolaunch report: group {self.name!r} ({self.outcome}), {self.time}"]
        out.append(f"log dir: {self.log_dir}")
        out += [f"{k}: {v['summary']}" for k, v in sorted(self.sections.items()) if "summary" in v]
        root = self.root_cause
        if root is not None:
            how = f"signal {root.signal}" if root.signal else f"exit code {root.exitcode}"
            out += ["", f"Root cause: rank {root.rank} (pid {root.pid}), {how}"]
            out.append(f"  {root.message}".replace("\n", "\n  "))
            if root.traceback:
                out.append("  " + root.traceback.rstrip().replace("\n", "\n  "))
            if root.stderr_tail:
                out.append("  last stderr lines:")
                out += [f"    {line}" for line in root.stderr_tail]
            elif root.stderr_note:
                out.append(f"  no stderr lines here: {root.stderr_note}")
            out.append(f"Failed on their own: {self.failed or 'none'}")
            out.append(f"Stopped by aiolaunch: {self.stopped_by_aiolaunch or 'none'}")
        c = self.collective
        if c is not None:
            out += ["", f"Collectives ({c.verdict}): {c.text}."]
            if c.dumps:
                out.append(f"  records: {c.dumps} (torchfrtrace reads the folder)")
        if self.verdict is not None:
            out += ["", "Where every rank is (innermost frames of the main thread):"]
            out.append(str(self.verdict))
        if self.at_failure is not None:
            a = self.at_failure
            out += ["", f"Where every rank was when rank {a.rank} failed (stacks dumped then):"]
            out.append(a.lines())
            for rank, path in sorted(a.files.items()):
                out.append(f"  rank {rank}: {path}")
        for g in self.stragglers:
            if g.source == "collectives" and g.lateness_s is not None:
                line = (
                    f"Straggler: rank {g.rank} arrived {g.lateness_s:.3f}s after the earliest "
                    f"rank at collectives (median of {g.samples}); it was the last to arrive at "
                    f"{100 * (1 - g.wait_share):.0f}% of them"
                )
            else:
                line = (
                    f"Straggler: rank {g.rank} waited in collectives in {100 * g.wait_share:.0f}% "
                    f"of its {g.samples} stack samples, its peers in "
                    f"{100 * g.peers_wait_share:.0f}%"
                )
            out += ["", line]
        for s in self.stalled:
            out += ["", f"Stalled: rank {s.rank} (pid {s.pid}): {s.reason}"]
            if s.stacks_file:
                out.append(f"  stacks: {s.stacks_file}")
            if s.stacks:
                out.append("  " + s.stacks.rstrip().replace("\n", "\n  "))
        return "\n".join(out) + "\n"


def write_report(report: RunReport) -> tuple[str, str] | None:
    """Write ``report.json`` and ``report.txt`` into ``report.log_dir``.

    Returns their paths, or ``None`` when they cannot be written (logged:
    a report must never turn into a second failure).
    """
    paths = (
        os.path.join(report.log_dir, "report.json"),
        os.path.join(report.log_dir, "report.txt"),
    )
    texts = (json.dumps(report.to_json(), indent=2), report.to_text())
    try:
        for path, text in zip(paths, texts, strict=True):
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
    except OSError as exc:
        logger.warning("aiolaunch: cannot write the report: %s", exc)
        return None
    return paths
