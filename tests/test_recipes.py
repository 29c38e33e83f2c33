"""docs/schedulers.md's recipes say what the command really does: the
exit-code table, the Kubernetes podFailurePolicy and the sbatch script's
retry rule are parsed from the page and checked against the real CLI.
(tests/engines/test_slurm.py also runs the sbatch script in a real Slurm.)"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from _helpers import driver
from aiolaunch._cli._exit import (
    EXIT_DO_NOT_RETRY,
    EXIT_FAILED,
    EXIT_HOST_EXCLUDED,
    signal_exit_status,
)

RECIPES = Path(__file__).resolve().parent.parent / "docs" / "schedulers.md"
AIOLAUNCH = [sys.executable, "-m", "aiolaunch"]


def _block(marker: str, lang: str) -> str:
    text = RECIPES.read_text()
    start = text.index(f"<!-- {marker}:")
    match = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no {lang} block after the {marker} marker"
    return match.group(1)


def exit_code_table() -> dict[int, str]:
    """``{code: meaning}`` of the table after ``<!-- exit-codes``."""
    text = RECIPES.read_text()
    start = text.index("<!-- exit-codes:")
    rows: dict[int, str] = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].isdigit():
            rows[int(cells[0])] = cells[1]
    return rows


def sbatch_script() -> str:
    return _block("sbatch", "bash")


def k8s_rules() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load(_block("k8s", "yaml"))
    job = spec["spec"]["replicatedJobs"][0]["template"]["spec"]
    rules: list[dict[str, Any]] = job["podFailurePolicy"]["rules"]
    return rules


def _cli(argv: list[str]) -> int:
    return subprocess.run([*AIOLAUNCH, *argv], capture_output=True, timeout=120).returncode


def _cli_sigterm(tmp_path: Path) -> int:
    script = tmp_path / "serve.py"
    script.write_text(
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], os.environ['LOCAL_RANK']), 'w').close()\n"
        "time.sleep(120)\n"
    )
    out = tmp_path / "ready"
    out.mkdir()
    with driver([*AIOLAUNCH, "--nproc-per-node", "2", str(script), str(out)]) as proc:
        deadline = time.monotonic() + 60
        while len(list(out.iterdir())) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    return proc.returncode


def test_the_table_is_the_code() -> None:
    table = exit_code_table()
    assert set(table) == {0, 1, 2, 3, 129, 130, 131, 143}
    assert "failed" in table[EXIT_FAILED]
    assert "bad arguments" in table[EXIT_DO_NOT_RETRY]
    assert "crash loop" in table[EXIT_DO_NOT_RETRY]
    assert "quarantined" in table[EXIT_HOST_EXCLUDED]
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
        code = signal_exit_status(sig)
        assert sig.name in table[code], (code, table[code])
        assert f"128 + {int(sig)}" in table[code]


def test_the_table_is_what_the_cli_returns(tmp_path: Path) -> None:
    table = exit_code_table()
    assert _cli(["--no-python", "true"]) == 0 and 0 in table
    assert _cli(["--nproc-per-node", "2", "--no-python", "false"]) == 1 and 1 in table
    assert _cli(["/nonexistent/train.py"]) == 2 and 2 in table
    assert _cli_sigterm(tmp_path) == 143 and 143 in table


def test_k8s_pod_failure_policy_keys_on_the_real_codes(tmp_path: Path) -> None:
    rules = k8s_rules()
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert len(fail) == 1 and fail[0]["onExitCodes"]["operator"] == "In"
    assert fail[0]["onExitCodes"]["values"] == [EXIT_DO_NOT_RETRY]
    count = next(r for r in rules if r["action"] == "Count")["onExitCodes"]
    assert count["operator"] == "NotIn"
    # what aiolaunch returns for each case lands on the rule the comment says
    assert _cli(["--no-such-flag", "x.py"]) in fail[0]["onExitCodes"]["values"]
    assert _cli(["-m", "no_such_module_anywhere"]) in fail[0]["onExitCodes"]["values"]
    worker_failed = _cli(["--nproc-per-node", "2", "--no-python", "false"])
    stopped = _cli_sigterm(tmp_path)
    for code in (worker_failed, stopped):
        assert code not in count["values"] and code not in fail[0]["onExitCodes"]["values"]
    assert any(r["action"] == "Ignore" for r in rules)


def test_sbatch_script_retries_only_what_a_retry_can_fix() -> None:
    script = sbatch_script()
    arms = dict(re.findall(r"^\s*(\d+|\*)\)\s*(.*?);;", script, re.M))
    assert "exit 2" in arms[str(EXIT_DO_NOT_RETRY)] and "not retried" in arms["2"]
    assert "exit" not in arms[str(EXIT_FAILED)]  # the loop goes on: retried
    assert arms["0"].strip() == "exit 0"
    assert "srun aiolaunch" in script and "--forward-signals SIGUSR1" in script
