"""A second SIGTERM while the workers clean up: how long until the launcher exits.

Each worker handles SIGTERM by cleaning up for ``--cleanup`` seconds (20 by
default) before it exits. The launcher gets SIGTERM, then a second SIGTERM
one second later. torchrun waits out the cleanup (its handler is not
re-entered); aiolaunch ends the grace period at the second signal and
SIGKILLs the workers. Prints one line per launcher and trial: seconds from
the second signal to the launcher's exit, its exit status, and whether a
worker survived.

    .venv/bin/python benchmarks/second_signal.py [--trials 3] [--cleanup 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = """
import os, signal, sys, time
def on_term(*_):
    print("cleaning up", flush=True)
    time.sleep(float(sys.argv[2]))  # a checkpoint that takes this long
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
while True:
    time.sleep(1)
"""

LAUNCHERS = {
    "aiolaunch": [sys.executable, "-m", "aiolaunch"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def trial(launcher: list[str], cleanup: float, nproc: int) -> tuple[float, int, bool]:
    with tempfile.TemporaryDirectory() as d:
        script, marks = Path(d, "w.py"), Path(d, "pids")
        script.write_text(WORKER)
        marks.mkdir()
        proc = subprocess.Popen(
            [*launcher, "--nproc-per-node", str(nproc), str(script), str(marks), str(cleanup)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while len(os.listdir(marks)) < nproc:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("workers did not start")
            time.sleep(0.05)  # allowed: a benchmark polling its own marker files
        pids = [int(p) for p in os.listdir(marks)]
        time.sleep(0.5)  # allowed: let the launcher settle into its wait
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # allowed: the second signal comes one second later
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=cleanup + 60)
        took = time.monotonic() - t0
        survived = any(_alive(p) for p in pids)
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        return took, rc, survived


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--cleanup", type=float, default=20.0)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f}; workers clean up for {args.cleanup:g} s")
    for n in range(args.trials):
        for name, launcher in LAUNCHERS.items():  # interleaved
            took, rc, survived = trial(launcher, args.cleanup, args.nproc)
            print(
                f"trial {n} {name:9s} exit after the 2nd SIGTERM: {took:5.1f} s  "
                f"status {rc}  worker left: {survived}"
            )


if __name__ == "__main__":
    main()
