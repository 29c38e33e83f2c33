"""The run report: ``{log_dir}/report.json`` and a readable ``report.txt``.

Written when a group fails (from the context's shutdown) and when the
watchdog flags a stall (then without an outcome yet). It names the root
cause - rank, exit code or signal, the recorded exception and traceback, or
for programs without ``@record`` the last lines of their stderr log - the
ranks that failed on their own vs. those aiolaunch stopped, and the stalled
ranks with their stacks and the outlier verdict.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._forensics import Forensics
    from ._results import RunProcsResult

__all__ = ["write_report"]

_TAIL_LINES = 20


def _tail(path: str, n: int = _TAIL_LINES) -> tuple[list[str], str | None]:
    from ._results import stderr_tail

    return stderr_tail(path, n)


def build_report(fx: Forensics, result: RunProcsResult | None) -> dict[str, Any]:
    """The report as a JSON-ready dict."""
    ctx = fx._ctx
    data: dict[str, Any] = {
        "name": ctx.name,
        "log_dir": fx.log_dir,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "outcome": "running" if result is None else ("failed" if result.is_failed() else "ok"),
    }
    if result is not None and result.failures:
        from ._errors import ChildFailedError

        rank, f = ChildFailedError(ctx.name, result.failures).get_first_failure()
        tail, no_tail = _tail(ctx.stderrs.get(rank, ""))
        data["root_cause"] = {
            "rank": rank,
            "pid": f.pid,
            "exitcode": f.exitcode,
            "signal": None if f.exitcode >= 0 else f.signal_name(),
            "message": f.error_message,
            "traceback": f.py_callstack,
            "error_file": f.error_file,
            "stderr_tail": tail,
            "stderr_note": no_tail,  # why there is no tail
        }
        data["failed"] = sorted(r for r in result.failures if r not in fx.failing)
        data["stopped_by_aiolaunch"] = sorted(
            r for r, w in ctx._workers.items() if w.stopped_by_us and r not in result.failures
        )
    stalls = {**fx.flagged, **fx.failing}
    if stalls:
        data["stalled"] = [
            {
                "rank": s.rank,
                "pid": s.pid,
                "idle_s": s.idle_s,
                "reason": s.reason,
                "where": s.verdict_line,
                "stacks_file": s.stacks_file,
                "stacks": fx.stall_dumps.get(s.rank, ""),
            }
            for _, s in sorted(stalls.items())
        ]
    if fx.stall_report is not None:
        data["verdict"] = {**fx.stall_report.to_json(), "text": str(fx.stall_report)}
    return data


def format_report(data: dict[str, Any]) -> str:
    """``report.txt``: the report for people."""
    out = [f"aiolaunch report: group {data['name']!r} ({data['outcome']}), {data['time']}"]
    out.append(f"log dir: {data['log_dir']}")
    root = data.get("root_cause")
    if root:
        how = f"signal {root['signal']}" if root["signal"] else f"exit code {root['exitcode']}"
        out += ["", f"Root cause: rank {root['rank']} (pid {root['pid']}), {how}"]
        out.append(f"  {root['message']}".replace("\n", "\n  "))
        if root.get("traceback"):
            out.append("  " + root["traceback"].rstrip().replace("\n", "\n  "))
        if root.get("stderr_tail"):
            out.append("  last stderr lines:")
            out += [f"    {line}" for line in root["stderr_tail"]]
        elif root.get("stderr_note"):
            out.append(f"  no stderr lines here: {root['stderr_note']}")
        out.append(f"Failed on their own: {data.get('failed') or 'none'}")
        out.append(f"Stopped by aiolaunch: {data.get('stopped_by_aiolaunch') or 'none'}")
    verdict = data.get("verdict")
    if verdict:
        out += ["", "Where every rank is (innermost frames of the main thread):", verdict["text"]]
    for s in data.get("stalled", []):
        out += ["", f"Stalled: rank {s['rank']} (pid {s['pid']}): {s['reason']}"]
        if s["stacks_file"]:
            out.append(f"  stacks: {s['stacks_file']}")
        if s["stacks"]:
            out.append("  " + s["stacks"].rstrip().replace("\n", "\n  "))
    return "\n".join(out) + "\n"


def write_report(fx: Forensics, result: RunProcsResult | None) -> tuple[str, str] | None:
    """Write ``report.json`` and ``report.txt`` into the group's log dir.

    Returns their paths, or ``None`` when they cannot be written (logged:
    a report must never turn into a second failure).
    """
    import logging

    data = build_report(fx, result)
    paths = (os.path.join(fx.log_dir, "report.json"), os.path.join(fx.log_dir, "report.txt"))
    try:
        for path, text in zip(
            paths, (json.dumps(data, indent=2), format_report(data)), strict=True
        ):
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
    except OSError as exc:
        logging.getLogger("aiolaunch").warning("aiolaunch: cannot write the report: %s", exc)
        return None
    return paths
