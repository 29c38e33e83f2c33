"""The examples of the docs run, and run again (issue #12.9: a fixed log_dir broke the second run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _first_python_block(page: str) -> str:
    match = re.search(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)
    assert match is not None, f"no python example in {page}"
    return match.group(1)


@pytest.mark.parametrize("page", ["index.md"])
def test_docs_example_runs_twice(page: str, tmp_path: Path) -> None:
    code = _first_python_block(page)
    assert '"/tmp/run"' in code, "the example's log folder moved: update this test"
    script = tmp_path / "example.py"
    script.write_text(code.replace('"/tmp/run"', repr(str(tmp_path / "run"))))
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "{0: 0.93, 1: 0.93}\n"
    runs = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert len(runs) == 2, runs  # one sub-folder per run
