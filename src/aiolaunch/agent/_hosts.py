"""The job's hosts as the live view shows them: ``status``, ``/metrics``, ``top``, the report.

:func:`hosts_section` makes the ``"hosts"`` section (plain values) from what
an agent last read of the rendezvous state and the job's records - no I/O,
so a ``status`` request never waits on the store. :func:`hosts_metrics`
renders it in Prometheus' text format. The agent registers both with the
live view's sections (``_sections.py``) while it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._quarantine import in_force, summary

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["hosts_metrics", "hosts_section"]


def hosts_section(
    *,
    state: Any,
    me: Any,
    host: Callable[[Any], str],
    table: dict[str, Any],
    restarts: int,
    now: float,
) -> dict[str, Any]:
    """``{"round", "host", "members", "spares", "waiting", "restarts", "quarantine",
    "summary"}`` (hosts by address; ``quarantine``: the records in force)."""
    members = [host(n) for n in sorted(state.participants, key=state.participants.__getitem__)]
    spares = sorted(host(n) for n in state.redundancy_list)
    waiting = sorted(host(n) for n in state.wait_list)
    quarantine = in_force(table, now)
    parts = [
        f"round {state.round}: {len(members)} host(s)",
        f"{len(spares)} spare(s)",
        f"{restarts} restart(s)",
        summary(table, now),
    ]
    return {
        "round": int(state.round),
        "host": host(me),
        "role": "running"
        if me in state.participants
        else ("spare" if me in state.redundancy_list else "waiting"),
        "members": members,
        "spares": spares,
        "waiting": waiting,
        "restarts": restarts,
        "quarantine": quarantine,
        "summary": ", ".join(parts),
    }


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def hosts_metrics(section: dict[str, Any]) -> list[str]:
    """The section's samples: rounds, restarts, hosts by role, quarantined hosts."""
    out = [
        "# HELP aiolaunch_job_round The rendezvous round the job runs in.",
        "# TYPE aiolaunch_job_round gauge",
        f"aiolaunch_job_round {int(section.get('round', 0))}",
        "# HELP aiolaunch_job_restarts_total Restarts of the job (every host counts the same).",
        "# TYPE aiolaunch_job_restarts_total counter",
        f"aiolaunch_job_restarts_total {int(section.get('restarts', 0))}",
        "# HELP aiolaunch_job_hosts Hosts of the job by role (running, spare, waiting).",
        "# TYPE aiolaunch_job_hosts gauge",
    ]
    for role, key in (("running", "members"), ("spare", "spares"), ("waiting", "waiting")):
        out.append(f'aiolaunch_job_hosts{{role="{role}"}} {len(section.get(key, []))}')
    records: dict[str, dict[str, Any]] = section.get("quarantine", {})
    out += [
        "# HELP aiolaunch_host_quarantined_until_seconds Hosts kept out of the job, "
        "until when (Unix time).",
        "# TYPE aiolaunch_host_quarantined_until_seconds gauge",
    ]
    out += [
        f'aiolaunch_host_quarantined_until_seconds{{host="{_label(h)}"}} {float(r["until"])!r}'
        for h, r in sorted(records.items())
    ]
    return out
