"""aiolaunch under trio (``anyio.run(..., backend="trio")``).

aiolaunch is built on asyncio: subprocess transports, ``loop.add_reader`` on
pidfds and pipes, ``loop.add_signal_handler``. Under trio there is no asyncio
loop, so it cannot work; what matters is *how* it fails. Each case runs in a
fresh interpreter (``-W error``), so a half-started run cannot disturb the
test runner's own loop, signal handlers or fds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("trio")

_SCRIPT = """
import json, os, sys, warnings
import anyio
import aiolaunch

log_dir, marker, backend = sys.argv[1], sys.argv[2], sys.argv[3]

async def main():
    try:
        ctx = await aiolaunch.start_processes(
            name="t", entrypoint="touch", args={0: (marker,)}, envs={0: {}}, log_dir=log_dir,
            redirects=aiolaunch.Std.ALL,
        )
    except BaseException as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    result = await ctx.wait()
    return {"raised": None, "failed": result.is_failed()}

def children():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if ppid == str(os.getpid()):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"aiolaunch-guardian" in f.read():
                    continue  # the supervisor's guardian lives as long as it does
            found.append(int(pid))
    return found

out = anyio.run(main, backend=backend)
out["children"] = children()
print(json.dumps(out))
"""


def _run(tmp_path: Path, backend: str) -> tuple[dict[str, object], Path, Path]:
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    log_dir, marker = tmp_path / "logs", tmp_path / "marker"
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(script), str(log_dir), str(marker), backend],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # no warning, no "Exception ignored in"
    return json.loads(proc.stdout.splitlines()[-1]), log_dir, marker


def test_asyncio_backend_works(tmp_path: Path) -> None:
    """The control: the same script under anyio's asyncio backend starts the worker."""
    out, log_dir, marker = _run(tmp_path, "asyncio")
    assert out == {"raised": None, "failed": False, "children": []}
    assert marker.exists()
    assert (log_dir / "0" / "stdout.log").exists()


def test_trio_never_starts_a_worker(tmp_path: Path) -> None:
    """Today and after the #8 core patch: under trio, no worker process is started."""
    out, _, marker = _run(tmp_path, "trio")
    assert out["raised"] is not None
    assert not marker.exists()  # `touch` never ran
    assert out["children"] == []


def test_trio_gets_a_clear_error_before_any_side_effect(tmp_path: Path) -> None:
    out, log_dir, marker = _run(tmp_path, "trio")
    assert out["raised"] == "RuntimeError"
    message = str(out["message"])
    assert "asyncio event loop" in message
    assert "trio" in message  # names what it found instead
    assert not log_dir.exists()  # validation only: no folder, no file, no process
    assert not marker.exists()
