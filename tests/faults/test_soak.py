"""CI's short soak: ``benchmarks/soak.py -n 60`` must report flat fds, threads, RSS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_short_soak_is_flat(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SOAK), "-n", "60", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["problems"] == []
    assert len(report["samples"]) >= 20
    assert report["leftovers"] == []
