"""aiolaunch under a real single-node Slurm (tests/engines/_slurm.py).

Every scenario of :data:`_slurm.SCENARIOS` runs once, side by side, in a
module fixture (the time-limit job alone takes a minute and more): sbatch and
srun jobs of ``aiolaunch --nproc-per-node 2``; plain ``scancel``, the time
limit, ``scancel --signal=USR1`` with and without ``--forward-signals
SIGUSR1``, ``--signal=USR2``; each test then checks one: the exit code as
Slurm records it (``scontrol show job``'s ExitCode, the documented table of
aiolaunch._cli._exit), and that none of the job's processes outlived it.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest
from _etcd import free_port
from _slurm import SCENARIOS, Outcome, Scenario, Slurm, missing, run_scenario, slurm

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

HAVE_TORCH = importlib.util.find_spec("torch") is not None
AIOLAUNCH = [sys.executable, "-m", "aiolaunch", "--shutdown-timeout", "3"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: scenario -> (Slurm's JobState, ExitCode "status:signal", ranks that saw SIGUSR1)
EXPECTED: dict[str, tuple[str, str, list[str]]] = {
    "success": ("COMPLETED", "0:0", []),
    "worker fails": ("FAILED", "1:0", []),
    "worker fails, root cause": ("FAILED", "3:0", []),
    "scancel": ("CANCELLED", "143:0", []),
    "time limit": ("TIMEOUT", "143:0", []),
    # a signal aiolaunch does not handle ends it as it ends any program (the
    # workers are stopped all the same: no survivor); srun reports 128 + N
    "scancel --signal=USR1": ("FAILED", "138:0", []),
    "scancel --signal=USR1, forwarded": ("COMPLETED", "0:0", ["0", "1"]),
    "scancel --batch --signal=USR1": ("FAILED", "0:10", []),
    "scancel --signal=USR2": ("FAILED", "140:0", []),
}


#: the recipe's runs: name -> the training script's argv (a missing file: exit 2)
RECIPE_RUNS = {
    "succeeds": ["-c", "pass"],
    "fails": ["-c", "raise SystemExit(3)"],
    "no script": ["/nonexistent/train.py"],
}


def run_recipe(s: Slurm, folder: Path, train: list[str]) -> tuple[dict[str, str], str]:
    """docs/recipes.md's sbatch script on one node: (scontrol's job record, its output)."""
    from test_recipes import sbatch_script

    folder.mkdir(parents=True)
    script = sbatch_script()
    script = script.replace("srun aiolaunch", f"srun {sys.executable} -m aiolaunch")
    script = script.replace("--nproc-per-node 4", "--nproc-per-node 2")
    if train[0] == "-c":  # python -c CODE: through a file, as the recipe runs train.py
        (folder / "train.py").write_text(train[1] + "\n")
        train = [str(folder / "train.py")]
    script = script.replace("train.py --resume", shlex.join(train))
    (folder / "job.sh").write_text(script)
    env = f"ALL,PET_RDZV_ENDPOINT=127.0.0.1:{free_port()}"
    out = folder / "out.txt"
    opts = ["--parsable", "--nodes=1", "-c", "1", "-o", str(out), f"--export={env}"]
    job = s.run("sbatch", *opts, str(folder / "job.sh")).stdout.strip().split(";")[0]
    info = s.wait_done(job, timeout=300)
    return info, out.read_text(errors="replace") if out.exists() else ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Slurm, Path]]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    with slurm(root) as s:
        yield s, root


@pytest.fixture(scope="module")
def runs(
    cluster: tuple[Slurm, Path],
) -> tuple[dict[str, Outcome], dict[str, tuple[dict[str, str], str]]]:
    """Every scenario and every recipe run, side by side (the time limit takes a minute)."""
    s, root = cluster

    def scenario(sc: Scenario) -> Outcome:
        folder = root / "jobs" / sc.name.replace(" ", "_").replace(",", "")
        return run_scenario(s, sc, AIOLAUNCH, folder)

    def recipe(name: str) -> tuple[dict[str, str], str]:
        return run_recipe(s, root / "recipe" / name.replace(" ", "_"), RECIPE_RUNS[name])

    # the recipe's --rdzv-backend c10d needs torch (the scenarios do not)
    recipe_runs = list(RECIPE_RUNS) if HAVE_TORCH else []
    with ThreadPoolExecutor(len(SCENARIOS) + len(RECIPE_RUNS)) as pool:
        recipes = {name: pool.submit(recipe, name) for name in recipe_runs}
        results = dict(
            zip([sc.name for sc in SCENARIOS], pool.map(scenario, SCENARIOS), strict=True)
        )
        return results, {name: f.result() for name, f in recipes.items()}


@pytest.fixture(scope="module")
def outcomes(runs: tuple[dict[str, Outcome], object]) -> dict[str, Outcome]:
    return runs[0]


def test_every_scenario_has_an_expectation() -> None:
    assert sorted(EXPECTED) == sorted(sc.name for sc in SCENARIOS)


@pytest.mark.parametrize("name", [sc.name for sc in SCENARIOS])
def test_slurm_records_the_documented_exit_code(outcomes: dict[str, Outcome], name: str) -> None:
    got = outcomes[name]
    state, exit_code, usr1 = EXPECTED[name]
    assert (got.state, got.exit_code, got.usr1) == (state, exit_code, usr1), got.log
    assert got.survivors == [], got.log  # nothing of the job outlives it


def test_report(outcomes: dict[str, Outcome]) -> None:
    """Not a check: the matrix, printed (pytest -s) for the record."""
    for name, got in outcomes.items():
        print(
            f"{name:40} {got.state:10} {got.exit_code:7} usr1={got.usr1} survivors={got.survivors}"
        )


#: recipe run -> (ExitCode as Slurm records it, how many times srun ran aiolaunch)
RECIPE_EXPECTED = {"succeeds": ("0:0", 1), "fails": ("1:0", 3), "no script": ("2:0", 1)}


@pytest.mark.parametrize("name", list(RECIPE_RUNS))
def test_the_sbatch_recipe_retries_only_what_can_be_fixed(
    runs: tuple[object, dict[str, tuple[dict[str, str], str]]], name: str
) -> None:
    if not HAVE_TORCH:
        pytest.skip("the recipe's --rdzv-backend c10d needs torch")
    info, out = runs[1][name]
    code, attempts = RECIPE_EXPECTED[name]
    assert info["ExitCode"] == code, out
    # one line per srun: what aiolaunch took from Slurm, or why it did not start
    started = out.count("aiolaunch: under Slurm job") + out.count("aiolaunch: error:")
    assert started == attempts, out
    if name == "no script":
        assert "not retried" in out
    if name == "fails":
        assert out.count("again from the last checkpoint") == 3
