"""The Slurm signal matrix of aiolaunch and torchrun, side by side (not a test).

Runs every scenario of ``_slurm.SCENARIOS`` with both launchers in one private
single-node Slurm and prints a Markdown table: what Slurm recorded (JobState,
ExitCode) and how many of the job's processes outlived it (killed afterwards).
Needs root, slurm-wlm, munge and torch::

    python tests/engines/slurm_matrix.py
"""

from __future__ import annotations

import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _slurm import SCENARIOS, Outcome, Scenario, kill_survivors, missing, run_scenario, slurm

LAUNCHERS = {
    "aiolaunch": [sys.executable, "-m", "aiolaunch", "--shutdown-timeout", "3"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def _cell(o: Outcome | None) -> str:
    if o is None:
        return "n/a (no such flag)"
    usr1 = f", USR1 seen by ranks {','.join(o.usr1)}" if o.usr1 else ""
    return f"{o.state} {o.exit_code}, {len(o.survivors)} survivors{usr1}"


def main() -> int:
    reason = missing()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 1
    root = Path(tempfile.mkdtemp(prefix="aiolaunch-slurm-matrix-"))
    with slurm(root) as s:
        jobs: list[tuple[str, Scenario]] = [
            (name, sc)
            for sc in SCENARIOS
            for name in LAUNCHERS
            if name == "aiolaunch" or not sc.flags  # torchrun has neither flag
        ]

        def one(job: tuple[str, Scenario]) -> Outcome:
            name, sc = job
            folder = root / name / sc.name.replace(" ", "_").replace(",", "")
            return run_scenario(s, sc, LAUNCHERS[name], folder)

        with ThreadPoolExecutor(len(jobs)) as pool:
            results = dict(zip(jobs, pool.map(one, jobs), strict=True))
        for outcome in results.values():
            kill_survivors(outcome)
    by = {(name, sc.name): o for (name, sc), o in results.items()}
    print("| scenario | aiolaunch | torchrun |")
    print("|---|---|---|")
    for sc in SCENARIOS:
        step = "srun step" if sc.step == "srun" else "batch script"
        flags = f" `{' '.join(sc.flags)}`" if sc.flags else ""
        row = [_cell(by.get((n, sc.name))) for n in LAUNCHERS]
        print(f"| {sc.name} ({step}){flags} | {row[0]} | {row[1]} |")
    print(f"\n(folders: {root})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
