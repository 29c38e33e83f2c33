"""Restart after an early failure: failure -> the next attempt's first all_reduce.

    python benchmarks/bench_early_restart.py [--delays 0,1,10] [--trials 5]
        [--launcher aiolaunch|aiolaunch-cold|torchrun] [--json OUT]

One trial: ``LAUNCHER --standalone --nproc-per-node 2 --max-restarts 1
_early_script.py DELAY``, a gloo job (no DDP) whose rank 1 exits 1 ``DELAY``
seconds after its first all_reduce while rank 0 sleeps; the turnaround is
rank 1's ``fail`` stamp -> the later first all_reduce of attempt 1. A
failure in the first second lands while the zygote imports its later
modules (``torch._dynamo``), one at 10 s long after. Trials of the delays
run interleaved (0, 1, 10, 0, 1, 10, ...). Prints, per delay, the median,
min and max turnaround, and the trials that failed (no attempt 1, a
non-zero exit, a hang); exits 1 if any did.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_warm import LAUNCHERS, read_stamps, run_launcher  # noqa: E402

SCRIPT = os.path.join(HERE, "_early_script.py")


def trial(launcher: str, delay: float, tmp: str, timeout: float) -> dict:
    d = tempfile.mkdtemp(dir=tmp)
    stamp = os.path.join(d, "stamps")
    env = dict(os.environ, BENCH_STAMP=stamp)
    opts = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    rc, _t0, tail = run_launcher(launcher, opts, [str(delay)], env, d, timeout, SCRIPT)
    st = read_stamps(stamp)
    if rc is None:
        return {"ok": False, "error": f"hung (killed after {timeout} s): {tail}"}
    if rc != 0:
        return {"ok": False, "error": f"exit status {rc}: {tail}"}
    firsts = [st[1, r, "first"] for r in range(2) if (1, r, "first") in st]
    if (0, 1, "fail") not in st or len(firsts) != 2:
        return {"ok": False, "error": f"attempt 1 did not reach its first all_reduce: {st}"}
    return {"ok": True, "turnaround_ms": (max(firsts) - st[0, 1, "fail"]) * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delays", default="0,1,10", help="seconds after the first all_reduce")
    p.add_argument("--trials", type=int, default=5, help="trials per delay")
    p.add_argument("--launcher", default="aiolaunch", choices=sorted(LAUNCHERS))
    p.add_argument("--timeout", type=float, default=120.0, help="a trial's limit (s)")
    p.add_argument("--json", help="write the samples and errors here")
    args = p.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    samples: dict[float, list[float]] = {d: [] for d in delays}
    errors: dict[float, list[str]] = {d: [] for d in delays}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-early-") as tmp:
        for i in range(args.trials):
            for delay in delays:
                got = trial(args.launcher, delay, tmp, args.timeout)
                if got["ok"]:
                    samples[delay].append(got["turnaround_ms"])
                    print(f"trial {i} delay {delay:g} s: {got['turnaround_ms']:.1f} ms", flush=True)
                else:
                    errors[delay].append(got["error"])
                    print(f"trial {i} delay {delay:g} s: FAILED {got['error']}", flush=True)
    print(f"{args.launcher}, load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    for delay in delays:
        xs = samples[delay]
        if xs:
            print(
                f"  failure {delay:g} s after start: median {statistics.median(xs):.1f} ms "
                f"(min {min(xs):.1f}, max {max(xs):.1f}, n={len(xs)}), {len(errors[delay])} failed"
            )
        else:
            print(f"  failure {delay:g} s after start: no sample, {len(errors[delay])} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "launcher": args.launcher,
                    "samples": {str(d): samples[d] for d in delays},
                    "errors": {str(d): errors[d] for d in delays},
                },
                f,
                indent=1,
            )
    return 1 if any(errors.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
