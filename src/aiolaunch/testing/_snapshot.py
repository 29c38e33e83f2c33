"""The baseline before a test and what is new after it."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from ._long_lived import long_lived
from ._processes import all_pids, new_processes, session_token
from ._resources import open_fds, signal_state

__all__ = ["CHECKS", "DEFAULT_SETTLE_S", "Snapshot"]

CHECKS = ("processes", "fds", "signals")
DEFAULT_SETTLE_S = 2.0
_POLL_S = 0.02


@dataclass
class Snapshot:
    """What existed before a test: the baseline :meth:`leaks` compares to."""

    pids: set[int]
    fds: set[int]
    signals: dict[str, object]
    checks: tuple[str, ...] = CHECKS
    ignore_fds: set[int] = field(default_factory=set)

    @classmethod
    def take(cls, checks: tuple[str, ...] = CHECKS) -> Snapshot:
        session_token()
        return cls(all_pids(), set(open_fds()), signal_state(), checks)

    def leaks(self) -> list[str]:
        """Describe everything new since the snapshot (empty: no leak)."""
        problems: list[str] = []
        helper_pids, helper_fds = long_lived()
        if "processes" in self.checks:
            for proc in new_processes(self.pids):
                if proc.pid not in helper_pids:
                    problems.append(f"process {proc.describe()}")
        if "fds" in self.checks:
            for fd, target in sorted(open_fds().items()):
                if fd not in self.fds and fd not in helper_fds and fd not in self.ignore_fds:
                    problems.append(f"fd {fd} -> {target}")
        if "signals" in self.checks:
            now = signal_state()
            for name, before in self.signals.items():
                if now[name] != before:
                    problems.append(f"signal {name}: handler was {before!r}, now {now[name]!r}")
        return problems

    def wait_for_no_leaks(self, settle: float = DEFAULT_SETTLE_S) -> list[str]:
        """Poll :meth:`leaks` for up to ``settle`` seconds; return the last findings."""
        deadline = time.monotonic() + settle
        collected = False
        while True:
            problems = self.leaks()
            if not problems or time.monotonic() >= deadline:
                return problems
            if not collected:
                # An fd held only by garbage (an unclosed file in a cycle) is
                # released here, and shows up as a ResourceWarning instead.
                gc.collect()
                collected = True
            time.sleep(_POLL_S)  # allowed: a bounded settle; a stranger process has no exit event
