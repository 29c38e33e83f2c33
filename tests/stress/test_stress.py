"""Stress tier: big groups, many in a row, seeded random faults.

Short tier (default, runs in CI): 64 function and 64 binary workers, 3 groups
each. Long tier (``AIOLAUNCH_STRESS=long``): 64 and 256 workers, 50 groups
each. ``AIOLAUNCH_STRESS_SEED`` picks the seed (default 12); a failure names
the seed and group, so it can be replayed.

Each group draws, per rank, the bytes it writes to stdout and stderr, its
return value (functions) and - in about half of the groups - a fault for a few
ranks: an exit code, a crash, or a signal it sends itself. Every worker writes
all its output *before* any fault happens (the faulty ranks wait until every
rank has written), so whatever fail-fast stops, no byte may be missing.

Per group: it ends within a bound (no hang); a clean group returns every
value; a faulty group fails with only faulty ranks, each with its own exit
code; every log file holds exactly its bytes; no process is left. Per test:
the fd count is back where it started.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import aiolaunch
from aiolaunch import Std
from aiolaunch.testing import Snapshot

pytestmark = pytest.mark.stress

LONG = os.environ.get("AIOLAUNCH_STRESS", "") == "long"
SEED = int(os.environ.get("AIOLAUNCH_STRESS_SEED", "12"))
SIZES = (64, 256) if LONG else (64,)
GROUPS = 50 if LONG else 3
OUTPUT_SIZES = (0, 1, 100, 4096, 65536, 300_000)
#: A group's bound: far above its real duration, only there to turn a hang into a failure.
GROUP_TIMEOUT = 240.0


def _pattern(tag: str, size: int) -> bytes:
    """``size`` bytes of ``tag\\n`` repeated: what a worker writes, and what the test expects."""
    line = (tag + "\n").encode()
    return (line * (size // len(line) + 1))[:size]


def _wait_markers(markers: str, n: int) -> None:
    deadline = time.monotonic() + 120
    while len(os.listdir(markers)) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def stress_fn(
    rank: int, n_out: int, n_err: int, ret_size: int, fault: str, n: int, markers: str
) -> Any:
    """The function worker: write, mark, then return or fault (after all ranks wrote)."""
    os.write(1, _pattern(f"o{rank}", n_out))  # fd level: nothing buffered at exit
    os.write(2, _pattern(f"e{rank}", n_err))
    open(os.path.join(markers, str(rank)), "w").close()
    if fault == "ok":
        return {"rank": rank, "blob": _pattern(f"r{rank}", ret_size)}
    _wait_markers(markers, n)
    kind, _, arg = fault.partition(":")
    if kind == "exit":
        os._exit(int(arg))
    if kind == "sig":
        os.kill(os.getpid(), int(arg))
        time.sleep(60)  # not reached: the signal's default action ends us
    raise ValueError(f"rank {rank} crashes")  # "crash"


#: The binary worker: $1 out bytes, $2 err bytes, $3 fault, $4 ranks, $5 markers, $6 rank.
STRESS_SH = r"""
set -e
pat() { yes "$1" | head -c "$2"; }
pat "o$6" "$1"
pat "e$6" "$2" >&2
: > "$5/$6"
[ "$3" = ok ] && exit 0
while [ "$(ls "$5" | wc -l)" -lt "$4" ]; do sleep 0.02; done
case $3 in
  exit:*) exit "${3#exit:}" ;;
  sig:*) kill -s "${3#sig:}" $$; sleep 60 ;;
  crash) kill -s SEGV $$; sleep 60 ;;
esac
"""


@dataclass
class Plan:
    """What one group's ranks do, drawn from one seeded generator."""

    kind: str
    n_out: list[int] = field(default_factory=list)
    n_err: list[int] = field(default_factory=list)
    ret_size: list[int] = field(default_factory=list)
    fault: list[str] = field(default_factory=list)

    def expected_exitcode(self, rank: int) -> int:
        kind, _, arg = self.fault[rank].partition(":")
        if kind == "exit":
            return int(arg)
        if kind == "sig":
            return -int(arg) if arg.isdigit() else -signal.Signals[f"SIG{arg}"]
        return 1 if self.kind == "function" else -signal.SIGSEGV


def _plan(rng: random.Random, n: int, kind: str) -> Plan:
    plan = Plan(kind=kind)
    faulty_group = rng.random() < 0.5
    faulty = set(rng.sample(range(n), rng.randint(1, 3))) if faulty_group else set()
    for rank in range(n):
        plan.n_out.append(rng.choice(OUTPUT_SIZES))
        plan.n_err.append(rng.choice(OUTPUT_SIZES[:4]))
        plan.ret_size.append(rng.choice((0, 10, 5000, 200_000)))
        if rank not in faulty:
            plan.fault.append("ok")
            continue
        pick = rng.choice(("exit", "crash", "sig"))
        if pick == "exit":
            plan.fault.append(f"exit:{rng.randint(1, 100)}")
        elif pick == "sig":
            sig = rng.choice((signal.SIGTERM, signal.SIGKILL, signal.SIGABRT))
            plan.fault.append(f"sig:{int(sig) if kind == 'function' else sig.name[3:]}")
        else:
            plan.fault.append("crash")
    return plan


async def _run_group(tmp: Path, kind: str, n: int, plan: Plan, where: str) -> None:
    markers = tmp / "markers"
    markers.mkdir()
    # Baseline of processes, fds and handlers: the group must leave none behind.
    snap = Snapshot.take(checks=("processes", "fds"))  # handlers: checked per test
    if kind == "function":
        entry: Any = stress_fn
        args: dict[int, tuple[Any, ...]] = {
            r: (r, plan.n_out[r], plan.n_err[r], plan.ret_size[r], plan.fault[r], n, str(markers))
            for r in range(n)
        }
        method = "forkserver"  # cheap per worker, and no fork of this threaded process
    else:
        entry = "/bin/sh"
        args = {
            r: (
                "-c",
                STRESS_SH,
                "sh",
                str(plan.n_out[r]),
                str(plan.n_err[r]),
                plan.fault[r],
                str(n),
                str(markers),
                str(r),
            )
            for r in range(n)
        }
        method = "spawn"
    async with aiolaunch.start_processes(
        name="st",
        entrypoint=entry,
        args=args,
        envs={r: {} for r in range(n)},
        log_dir=str(tmp / "logs"),
        start_method=method,
        redirects=Std.ALL,
        shutdown_timeout=30,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), GROUP_TIMEOUT)
    assert result is not None, where
    faulty = {r for r in range(n) if plan.fault[r] != "ok"}
    if not faulty:
        assert not result.is_failed(), (where, result.failures)
        if kind == "function":
            want = {r: {"rank": r, "blob": _pattern(f"r{r}", plan.ret_size[r])} for r in range(n)}
            assert result.return_values == want, where
    else:
        assert result.is_failed(), where
        assert result.failures, where
        assert set(result.failures) <= faulty, (where, set(result.failures) - faulty)
        for r, failure in result.failures.items():
            assert failure.exitcode == plan.expected_exitcode(r), (where, r, plan.fault[r])
    for r in range(n):
        out = Path(result.stdouts[r]).read_bytes()
        err = Path(result.stderrs[r]).read_bytes()
        assert out == _pattern(f"o{r}", plan.n_out[r]), (where, r, len(out), plan.n_out[r])
        if plan.fault[r] == "ok":
            assert err == _pattern(f"e{r}", plan.n_err[r]), (where, r, len(err))
        else:  # what a fault adds follows: a traceback, sh's "Terminated"
            assert err.startswith(_pattern(f"e{r}", plan.n_err[r])), (where, r, err[-200:])
    # Nothing left: no process, no fd, no handler (bounded settle, in a thread
    # so this loop still reaps what exits meanwhile).
    leaks = await asyncio.to_thread(snap.wait_for_no_leaks, 30.0)
    assert not leaks, (where, leaks[:5])


@pytest.mark.timeout(3600 if LONG else 600)  # the groups' own bounds catch a hang first
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["function", "binary"])
async def test_groups_in_a_row(tmp_path: Path, kind: str, n: int) -> None:
    rng = random.Random(f"{SEED}-{kind}-{n}")
    fds_after: list[int] = []
    for g in range(GROUPS):
        plan = _plan(rng, n, kind)
        where = f"seed={SEED} kind={kind} n={n} group={g}"
        group_dir = tmp_path / f"g{g}"
        group_dir.mkdir()
        await _run_group(group_dir, kind, n, plan, where)
        fds_after.append(len(os.listdir("/proc/self/fd")))
    # Flat from the first group on (it may open long-lived helpers: the guardian's pipe).
    assert fds_after == [fds_after[0]] * GROUPS, f"fds grew across groups: {fds_after}"
