"""Restart after an early failure: failure -> the next attempt's first all_reduce.

    python benchmarks/bench_early_restart.py [--delays 0,1,10] [--trials 5] [--ddp]
        [--launcher aiolaunch|aiolaunch-cold|torchrun] [--baseline SRC] [--json OUT]

One trial: ``LAUNCHER --standalone --nproc-per-node 2 --max-restarts 1
_early_script.py DELAY``, a gloo job (no DDP) whose rank 1 exits 1 ``DELAY``
seconds after its first all_reduce while rank 0 sleeps; the turnaround is
rank 1's ``fail`` stamp -> the later first all_reduce of attempt 1 (and,
to tell the launcher's part from the workers', -> the later start of
attempt 1's scripts). A failure in the first second lands while the zygote
imports its later modules (``torch._dynamo``), one at 10 s long after.
``--ddp``: the job wraps a DDP model first (warm_restart's job at delay 0).

``--baseline SRC``: also run the aiolaunch whose ``src`` folder is SRC (e.g.
``git archive HEAD~1 src | tar -x -C /tmp/base`` -> ``/tmp/base/src``, put
first on ``PYTHONPATH``), interleaved trial by trial with this one. Trials
run in rounds: every delay, every variant, in an order rotated each round.
Prints, per variant and delay, the median, min and max turnaround and the
trials that failed (no attempt 1, a non-zero exit, a hang); exits 1 if any
did.
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


def trial(
    launcher: str, delay: float, tmp: str, timeout: float, src: str | None, ddp: bool
) -> dict:
    d = tempfile.mkdtemp(dir=tmp)
    stamp = os.path.join(d, "stamps")
    env = dict(os.environ, BENCH_STAMP=stamp)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    opts = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    args = [str(delay), *(["ddp"] if ddp else [])]
    rc, _t0, tail = run_launcher(launcher, opts, args, env, d, timeout, SCRIPT)
    st = read_stamps(stamp)
    if rc is None:
        return {"ok": False, "error": f"hung (killed after {timeout} s): {tail}"}
    if rc != 0:
        return {"ok": False, "error": f"exit status {rc}: {tail}"}
    firsts = [st[1, r, "first"] for r in range(2) if (1, r, "first") in st]
    starts = [st[1, r, "start"] for r in range(2) if (1, r, "start") in st]
    if (0, 1, "fail") not in st or len(firsts) != 2 or len(starts) != 2:
        return {"ok": False, "error": f"attempt 1 did not reach its first all_reduce: {st}"}
    return {
        "ok": True,
        "turnaround_ms": (max(firsts) - st[0, 1, "fail"]) * 1e3,
        "started_ms": (max(starts) - st[0, 1, "fail"]) * 1e3,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delays", default="0,1,10", help="seconds after the first all_reduce")
    p.add_argument("--trials", type=int, default=5, help="trials per delay and variant")
    p.add_argument("--launcher", default="aiolaunch", choices=sorted(LAUNCHERS))
    p.add_argument("--baseline", metavar="SRC", help="another aiolaunch's src folder")
    p.add_argument("--ddp", action="store_true", help="wrap a DDP model first")
    p.add_argument("--timeout", type=float, default=120.0, help="a trial's limit (s)")
    p.add_argument("--json", help="write the samples and errors here")
    args = p.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    variants: dict[str, str | None] = {args.launcher: None}
    if args.baseline:
        variants[f"{args.launcher}-base"] = os.path.abspath(args.baseline)
    cells = [(v, d) for d in delays for v in variants]
    samples: dict[tuple[str, float], list[float]] = {c: [] for c in cells}
    started: dict[tuple[str, float], list[float]] = {c: [] for c in cells}
    errors: dict[tuple[str, float], list[str]] = {c: [] for c in cells}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-early-") as tmp:
        for i in range(args.trials):
            for variant, delay in cells[i % len(cells) :] + cells[: i % len(cells)]:
                got = trial(args.launcher, delay, tmp, args.timeout, variants[variant], args.ddp)
                cell = (variant, delay)
                if got["ok"]:
                    samples[cell].append(got["turnaround_ms"])
                    started[cell].append(got["started_ms"])
                    print(
                        f"trial {i} {variant} delay {delay:g} s: {got['turnaround_ms']:.1f} ms "
                        f"(every rank's script started after {got['started_ms']:.1f} ms)",
                        flush=True,
                    )
                else:
                    errors[cell].append(got["error"])
                    print(f"trial {i} {variant} delay {delay:g} s: FAILED {got['error']}")
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    for variant, delay in cells:
        xs, cell = samples[variant, delay], (variant, delay)
        if xs:
            print(
                f"  {variant}, failure {delay:g} s after start: median "
                f"{statistics.median(xs):.1f} ms (min {min(xs):.1f}, max {max(xs):.1f}, "
                f"n={len(xs)}; scripts started: median {statistics.median(started[cell]):.1f} "
                f"ms), {len(errors[cell])} failed"
            )
        else:
            print(f"  {variant}, failure {delay:g} s: no sample, {len(errors[cell])} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {
                        "variant": v,
                        "delay": d,
                        "turnaround_ms": samples[v, d],
                        "started_ms": started[v, d],
                        "errors": errors[v, d],
                    }
                    for v, d in cells
                ],
                f,
                indent=1,
            )
    return 1 if any(errors.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
