"""torch's ``elastic.events`` records (torchrun's ``--event-log-handler``).

The agent records what torch's agent records, with the same names, sources and
metadata keys: ``torchelastic.worker.status.RENDEZVOUS`` (AGENT, with
``duration_ms``) and ``...ASSIGN_WORKER_RANKS`` after each rendezvous,
``...START`` (WORKER) for each worker started, and at the end
``...SUCCEEDED`` / ``...FAILED`` / ``...TERMINATED`` per worker plus the
agent's own ``SUCCEEDED`` / ``FAILED``.

With torch installed they go through ``torch.distributed.elastic.events.record``
to the named handler, so handlers registered with torch work. Without torch,
``"null"`` and ``"console"`` (one JSON line per event on stderr, torch's
``Event.serialize()`` format) are served here. ``"null"`` costs nothing and
imports nothing.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._rendezvous import GroupAssignment
    from ._spec import RunResult

__all__ = ["EventRecorder"]

_OWN_HANDLERS = ("null", "console")


@dataclass
class EventRecorder:
    """Builds and records torch-shaped events for one agent run."""

    handler: str
    role: str
    entry_point: str
    rdzv_backend: str
    max_restarts: int
    run_id: str = ""
    group_rank: int = 0
    group_world_size: int | None = None
    restart_count: int = 0
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._record: Any = None
        if self.handler == "null":
            return
        try:
            from torch.distributed.elastic import events
        except ImportError:
            if self.handler not in _OWN_HANDLERS:
                raise ValueError(
                    f"event_log_handler={self.handler!r} needs torch (without it: "
                    f"{', '.join(_OWN_HANDLERS)})"
                ) from None
            self._record = self._record_console
        else:
            from torch.distributed.elastic.events.handlers import get_logging_handler

            get_logging_handler(self.handler)  # KeyError now, not at the first event
            self._record = self._record_torch(events)

    @property
    def enabled(self) -> bool:
        """Whether events go anywhere."""
        return self._record is not None

    def _record_torch(self, events: Any) -> Any:
        def record(name: str, source: str, metadata: dict[str, Any]) -> None:
            event = events.Event(name=name, source=events.EventSource[source], metadata=metadata)
            events.record(event, self.handler)

        return record

    def _record_console(self, name: str, source: str, metadata: dict[str, Any]) -> None:
        if os.environ.get("LOGLEVEL", "INFO").upper() not in ("DEBUG", "INFO"):
            return  # torch's events logger has the level of $LOGLEVEL
        event = {"name": name, "source": source, "timestamp": 0, "metadata": metadata}
        sys.stderr.write(json.dumps(event) + "\n")

    def record(
        self,
        state: str,
        source: str,
        *,
        global_rank: int | None = None,
        local_rank: int | None = None,
        role_rank: int | None = None,
        role_world_size: int | None = None,
        worker_id: str | None = None,
        raw_error: str | None = None,
        exit_code: int | None = None,
        worker_pid: int | None = None,
        duration_ms: float | None = None,
    ) -> None:
        """Record ``torchelastic.worker.status.{state}`` (torch's metadata layout)."""
        if self._record is None:
            return
        md: dict[str, Any] = {
            "group_world_size": self.group_world_size,
            "entry_point": self.entry_point,
        }
        if source == "WORKER":
            # torch stores these as 1-tuples (JSON lists)
            md["local_rank"] = (local_rank,)
            md["role_rank"] = (role_rank,)
            md["role_world_size"] = (role_world_size,)
            md["exit_code"] = (exit_code,)
            md["worker_pid"] = (worker_pid,)
        metadata = {
            "run_id": self.run_id,
            "global_rank": global_rank,
            "group_rank": self.group_rank,
            "worker_id": worker_id,
            "role": self.role,
            "hostname": socket.getfqdn(),
            "state": state,
            "total_run_time": int(time.monotonic() - self.started),
            "rdzv_backend": self.rdzv_backend,
            "raw_error": raw_error,
            "metadata": json.dumps(md),
            "agent_restarts": self.restart_count,
            "duration_ms": duration_ms,
        }
        self._record(f"torchelastic.worker.status.{state}", source, metadata)

    def rendezvous_done(
        self, assignment: GroupAssignment, restart_count: int, duration_ms: float
    ) -> None:
        """Record ``RENDEZVOUS`` and ``ASSIGN_WORKER_RANKS`` of a round, as torch
        does: both before the group learns its new size."""
        self.run_id, self.restart_count = assignment.run_id, restart_count
        self.record("RENDEZVOUS", "AGENT", duration_ms=duration_ms)
        self.record("ASSIGN_WORKER_RANKS", "AGENT", duration_ms=0.0)
        self.group_rank = assignment.group_rank
        self.group_world_size = assignment.group_world_size

    def workers_started(self, assignment: GroupAssignment, pids: Mapping[int, int]) -> None:
        """Record ``START`` for each worker of an attempt (torch's ``_record_worker_events``)."""
        for r, pid in pids.items():
            self.record(
                "START",
                "WORKER",
                global_rank=assignment.base_global_rank + r,
                local_rank=r,
                role_rank=assignment.base_role_rank + r,
                role_world_size=assignment.role_world_size,
                worker_id=str(pid),
            )

    def run_ended(
        self, result: RunResult, last: tuple[GroupAssignment, Mapping[int, int]] | None
    ) -> None:
        """Record each worker's final state of the last attempt, then the agent's."""
        if not self.enabled or last is None:
            return
        assignment, pids = last
        for r, pid in pids.items():
            g = assignment.base_global_rank + r
            failure = result.failures.get(g)
            if failure is not None or g in result.return_values:
                state = result.state.value
            else:
                state = "TERMINATED"  # stopped by the agent
            self.record(
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
        self.record(result.state.value, "AGENT")
