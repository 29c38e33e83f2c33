"""Live observability with real jobs: ``aiolaunch top`` in tmux, ``/metrics``, ``events``, ``attach``.

Every job here is the aiolaunch CLI running real Python ranks, and every
client is the real command in its real terminal (tmux for ``top``, a pty for
``attach``). The pure rules behind them are in tests/test_observe_units.py.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from typing import TYPE_CHECKING

import pytest

from _helpers import driver

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

# Ranks 0 and 1 print a line every 0.2 s; rank 2 prints once and goes quiet
# in a function of its own (its OUTPUT age grows; its stacks name it).
JOB = textwrap.dedent(
    """
    import os, sys, time

    def quiet_rank_two():
        print("rank 2 parked", flush=True)
        while True:
            time.sleep(0.05)

    rank = int(os.environ["LOCAL_RANK"])
    print(f"rank {rank} up", flush=True)
    if rank == 2:
        quiet_rank_two()
    i = 0
    while True:
        i += 1
        print(f"step {i}", flush=True)
        time.sleep(0.2)
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "aiolaunch", *args]


def _until(
    what: str, check: Callable[[], object], timeout: float = 30.0, show: Callable[[], str] = str
) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{show()}")
        time.sleep(0.1)  # allowed: polling another process's output


@contextlib.contextmanager
def _job(
    tmp_path: Path, *flags: str, nproc: int = 3
) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """The CLI running JOB with ``nproc`` ranks; yields (log dir, the CLI's process) once all are up."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    logs = tmp_path / "logs"
    argv = _cli("--nproc-per-node", str(nproc), "--log-dir", str(logs), "--redirects", "3",
                *flags, str(script))  # fmt: skip
    with driver(argv, env=_env(), stdout=subprocess.DEVNULL) as job:

        def up() -> bool:
            outs = list(logs.glob("*/attempt_0/*/stdout.log"))
            return len(outs) == nproc and all(" up" in p.read_text() for p in outs)

        _until("the job's ranks to start", up)
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        yield logs, job
        assert job.poll() is None, "the job died while it was observed"
        job.terminate()
        job.communicate(timeout=60)


# -- top --------------------------------------------------------------------------------


class _Tmux:
    """A private tmux server (its own socket) with one 80x24 window running a plain shell."""

    def __init__(self) -> None:
        self.name = f"aiolaunch-test-{uuid.uuid4().hex[:8]}"
        self.run("-f", "/dev/null", "new-session", "-d", "-x", "80", "-y", "24",
                 "env PS1='$ ' TERM=xterm bash --norc --noprofile")  # fmt: skip

    def run(self, *args: str) -> str:
        r = subprocess.run(["tmux", "-L", self.name, *args], capture_output=True, text=True,
                           timeout=30, check=True)  # fmt: skip
        return r.stdout

    def screen(self) -> list[str]:
        return self.run("capture-pane", "-p").splitlines()

    def text(self) -> str:
        return "\n".join(self.screen())

    def keys(self, *keys: str) -> None:
        self.run("send-keys", *keys)

    def close(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(["tmux", "-L", self.name, "kill-server"], capture_output=True,
                           timeout=30, check=False)  # fmt: skip


@pytest.fixture
def tmux() -> Iterator[_Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    t = _Tmux()
    try:
        yield t
    finally:
        t.close()


def _rows(screen: list[str]) -> dict[int, str]:
    """Top's rank rows by rank (lines below the header that start with a rank number)."""
    rows: dict[int, str] = {}
    header = next((i for i, line in enumerate(screen) if line.startswith("RANK ")), None)
    if header is None:
        return rows
    for line in screen[header + 1 :]:
        parts = line.split()
        if parts and parts[0].isdigit():
            assert int(parts[0]) not in rows, f"rank {parts[0]} twice:\n" + "\n".join(screen)
            rows[int(parts[0])] = line
    return rows


def test_top_in_tmux_one_row_per_rank_live_stacks_and_a_clean_exit(
    tmp_path: Path, tmux: _Tmux
) -> None:
    with _job(tmp_path) as (logs, _):
        env = f"PYTHONPATH={shlex.quote(os.pathsep.join(sys.path))}"
        tmux.keys(f"{env} {shlex.join(_cli('top', str(logs)))}", "Enter")
        first = _until(
            "top's first screen", lambda: len(_rows(tmux.screen())) == 3 and tmux.screen()
        )
        assert isinstance(first, list)
        assert first[0].startswith("aiolaunch top - default: 3 ranks")
        assert all(len(line) <= 80 for line in first) and len(first) <= 24
        rows = _rows(first)
        assert sorted(rows) == [0, 1, 2]
        for rank, line in rows.items():
            pid = int(line.split()[2])
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert f"LOCAL_RANK={rank}\0".encode() in f.read()
        # Redrawn in place: rank 2 is quiet, so its OUTPUT age grows between two captures.
        _until("rank 2's row to change", lambda: _rows(tmux.screen())[2] != rows[2], timeout=15)
        # A key shows one rank's stacks; q goes back to the table.
        tmux.keys("Down", "Down", "s")
        stacks = _until("rank 2's stacks",
                        lambda: "quiet_rank_two" in tmux.text() and tmux.screen(), show=tmux.text)  # fmt: skip
        assert isinstance(stacks, list)
        assert any("stacks of rank 2" in line for line in stacks)
        tmux.keys("q")
        _until("the table again", lambda: len(_rows(tmux.screen())) == 3)
        # q quits and the shell's screen is back as it was (top drew on the alternate screen).
        tmux.keys("q")

        def back() -> list[str] | None:
            screen = [line for line in tmux.screen() if line.strip()]
            return screen if screen[-1] == "$" else None

        screen = _until("the shell's prompt after top", back, show=tmux.text)
        assert isinstance(screen, list)
        assert screen[0].startswith("$ PYTHONPATH=")
        assert not _rows(screen)
        assert not any("aiolaunch top -" in line for line in screen)
