"""Restart soak: a real gloo DDP job restarted N times, a random rank SIGKILLed at a random step.

    python benchmarks/warm_soak.py [--launcher aiolaunch|aiolaunch-cold|torchrun]
                                   [--restarts 200] [--nproc 2] [--steps 20]
                                   [--hang-after 60] [--json OUT]

One job: ``LAUNCHER --standalone --nproc-per-node NPROC --max-restarts R
_warm_script.py soak R STEPS``. In attempts 0..R-1 a rank chosen at random
(seeded by the attempt) stamps ``fail`` and SIGKILLs itself at a random step
of DDP training; attempt R trains to the end. Every restart is classified:

- ``ok``: every rank of the next attempt reached its first all_reduce; its
  turnaround (kill -> that all_reduce, the later rank) is a sample;
- ``failed``: the next attempt started but some rank never reached its first
  all_reduce (it crashed: e.g. a stale peer address), so another restart
  followed - or the job ran out of restarts and exited non-zero;
- ``hung``: no stamp for ``--hang-after`` seconds; the job is killed (its
  whole session) and a new job runs the restarts still owed.

Prints (and writes with ``--json``) the counts, the turnaround p50/p99 and
the load average at start and end. Exits 0 when every restart was ``ok``.
Not a test: torchrun is expected to fail some (its agent shares one store
across attempts); the closing note of #23 reports both launchers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_warm import LAUNCHERS, SCRIPT, kill_job, read_stamps  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run_job(args: argparse.Namespace, restarts: int, folder: str) -> dict:
    """One job owing ``restarts`` restarts; its classified restarts."""
    stamp = os.path.join(folder, "stamps")
    env = dict(os.environ, BENCH_STAMP=stamp, PYTHONPATH=HERE)
    argv = [
        *LAUNCHERS[args.launcher],
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        "--max-restarts",
        str(restarts),
        SCRIPT,
        "soak",
        str(restarts),
        str(args.steps),
    ]
    with open(os.path.join(folder, "launcher.log"), "wb") as log:
        p = subprocess.Popen(
            argv, env=env, cwd=folder, stdout=log, stderr=log, start_new_session=True
        )
        hung = False
        last, seen = time.monotonic(), -1
        while p.poll() is None:
            time.sleep(0.2)
            size = os.path.getsize(stamp) if os.path.exists(stamp) else 0
            if size != seen:
                seen, last = size, time.monotonic()
            elif time.monotonic() - last > args.hang_after:
                hung = True
                break
        kill_job(p, stamp)
        rc = p.returncode
    st = read_stamps(stamp)
    attempts = sorted({a for a, _, _ in st})
    status: list[float | str] = []  # per restart: its turnaround, or "failed" / "hung"
    for a in attempts:
        kill = next((t for (x, _, w), t in st.items() if x == a and w == "fail"), None)
        if kill is None:
            continue
        firsts = [st.get((a + 1, r, "first")) for r in range(args.nproc)]
        if all(f is not None for f in firsts):
            status.append((max(f for f in firsts if f is not None) - kill) * 1e3)
        elif a + 1 in attempts or hung:
            status.append("failed")  # started, but some rank never got to its all_reduce
    if hung:
        if status and status[-1] == "failed":
            status[-1] = "hung"
        else:
            status.append("hung")  # the attempt after the last kill never got going
    return {
        "ok": [x for x in status if isinstance(x, float)],
        "failed": status.count("failed"),
        "hung": status.count("hung"),
        "done": len(status),
        "rc": None if hung else rc,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launcher", choices=sorted(LAUNCHERS), default="aiolaunch")
    ap.add_argument("--restarts", type=int, default=200)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hang-after", type=float, default=60.0)
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=0.0,
        help="start no new job after this long (0: no limit); the summary says what was owed",
    )
    args = ap.parse_args()
    load0, t0 = os.getloadavg(), time.monotonic()
    total = {"ok": [], "failed": 0, "hung": 0, "jobs": 0, "job_rcs": []}
    owed = args.restarts
    with tempfile.TemporaryDirectory(prefix="warm_soak_") as tmp:
        while owed > 0 and not (args.max_seconds and time.monotonic() - t0 > args.max_seconds):
            folder = os.path.join(tmp, f"job{total['jobs']}")
            os.makedirs(folder)
            got = run_job(args, owed, folder)
            total["jobs"] += 1
            total["job_rcs"].append(got["rc"])
            total["ok"] += got["ok"]
            total["failed"] += got["failed"]
            total["hung"] += got["hung"]
            if got["done"] == 0:  # nothing happened at all: do not loop forever
                with open(os.path.join(folder, "launcher.log")) as f:
                    print(f.read()[-2000:], file=sys.stderr)
                break
            owed -= got["done"]
            print(
                f"job {total['jobs']}: {len(got['ok'])} ok, {got['failed']} failed, "
                f"{got['hung']} hung (exit {got['rc']}); {owed} restarts owed",
                flush=True,
            )
            _summary(args, total, owed, load0, t0, write=True)
    summary = _summary(args, total, owed, load0, t0, write=True)
    print(json.dumps(summary, indent=1))
    ok = total["ok"]
    return 0 if not total["failed"] and not total["hung"] and len(ok) == args.restarts else 1


def _summary(
    args: argparse.Namespace, total: dict, owed: int, load0: tuple, t0: float, *, write: bool
) -> dict:
    ok = total["ok"]
    summary = {
        "launcher": args.launcher,
        "restarts": len(ok) + total["failed"] + total["hung"],
        "ok": len(ok),
        "failed": total["failed"],
        "hung": total["hung"],
        "jobs": total["jobs"],
        "job_exit_statuses": total["job_rcs"],
        "turnaround_ms": {"p50": percentile(ok, 50), "p99": percentile(ok, 99), "n": len(ok)},
        "not_run": owed,
        "seconds": round(time.monotonic() - t0, 1),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
    }
    if write and args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "samples_ms": ok}, f, indent=1)
    return summary


if __name__ == "__main__":
    sys.exit(main())
