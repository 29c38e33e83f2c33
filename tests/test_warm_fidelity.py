"""Forked workers as faithful as ``python script.py``: what ``ps`` and ``/proc`` show,
``__file__``, the data at exit, random state, an early stop signal.

Each test runs its worker ``spawned`` (no zygote) and ``forked`` (from a
zygote) with the same assertions, as tests/test_warm.py does; the torch ones
preload torch, the others a stdlib module.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from _helpers import driver
from _programs import write_script
from aiolaunch import Std
from aiolaunch._warm._registry import close_zygotes

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="warm start is Linux-only"
)

MODES = ["spawned", "forked"]
BOOT = ["-u", "-m", "aiolaunch._child._bootstrap"]
AIOLAUNCH = [sys.executable, "-m", "aiolaunch"]


@pytest.fixture(autouse=True)
def _fresh_zygotes() -> Iterator[None]:
    yield
    close_zygotes()


def preload_flags(mode: str, module: str = "json") -> list[str]:
    return ["--preload", module] if mode == "forked" else ["--no-preload"]


async def run_python(
    mode: str,
    tmp_path: Path,
    args: dict[int, tuple[str, ...]],
    preload: list[str] | None = None,
    **kw: Any,
) -> aiolaunch.RunProcsResult:
    async with aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args=args,
        envs=kw.pop("envs", {r: {"X": str(r)} for r in args}),
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
        preload=(preload or ["json"]) if mode == "forked" else None,
        **kw,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    return result


# -- an early stop signal ---------------------------------------------------------------
EARLY_SIGTERM = """
import os, signal, sys, time

def on_term(sig, frame):
    open(f"handled-{os.environ['LOCAL_RANK']}", "w").close()
    sys.exit(143)

signal.signal(signal.SIGTERM, on_term)
if os.environ["LOCAL_RANK"] == "0":  # at once: the supervisor still starts the others
    while not os.path.exists("supervisor.pid"):
        time.sleep(0.001)
    os.kill(int(open("supervisor.pid").read()), signal.SIGTERM)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_sigterm_as_the_first_rank_runs_stops_the_run(mode: str, tmp_path: Path) -> None:
    script = write_script(tmp_path, "early.py", EARLY_SIGTERM)
    log = tmp_path / "termination-log"
    env = {**os.environ, "AIOLAUNCH_TERMINATION_LOG": str(log)}
    argv = [*AIOLAUNCH, "--nproc-per-node", "8", *preload_flags(mode), str(script)]
    with driver(argv, env=env, cwd=str(tmp_path)) as proc:
        (tmp_path / "supervisor.pid.tmp").write_text(str(proc.pid))
        os.rename(tmp_path / "supervisor.pid.tmp", tmp_path / "supervisor.pid")
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err  # not -15: the default action
    assert log.read_text() == "aiolaunch: stopped by SIGTERM; all workers were stopped"
    assert (tmp_path / "handled-0").exists()  # the rank's own handler ran


async def test_a_signal_caught_as_a_watch_ends_reaches_the_handler_after_it() -> None:
    """The hand-over from start()'s watch to wait()'s: a signal the loop queued
    for a watch that has ended since is re-raised, not dropped."""
    from aiolaunch._signals._watch import watch_signals

    got: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda sig, frame: got.append(sig))
    try:
        with watch_signals(lambda sig: None, stop=(signal.SIGUSR2,)) as watch:
            os.kill(os.getpid(), signal.SIGUSR2)
            # one turn: the loop reads its wake-up fd and queues the dispatch ...
            await asyncio.sleep(0)  # allowed: loop turns, the point of the test
            await asyncio.sleep(0)  # ... which runs on the turn after this one
        assert watch.received is None  # it ended first
        await asyncio.sleep(0)  # allowed: the queued dispatch runs
        await asyncio.sleep(0)  # allowed: the re-raised signal's Python handler runs
        assert got == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


# -- __file__ ---------------------------------------------------------------------------
FILE = """
import json, sys
print(json.dumps({"file": __file__, "argv0": sys.argv[0], "path0": sys.path[0]}))
raise ValueError("where")
"""


@pytest.mark.parametrize("mode", MODES)
async def test_file_is_absolute_as_python_makes_it(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, "rel.py", FILE)
    monkeypatch.chdir(tmp_path)
    result = await run_python(mode, tmp_path, {0: (*BOOT, "rel.py")})
    assert result.failures[0].exitcode == 1
    report = json.loads((tmp_path / "logs/0/stdout.log").read_text())
    python = subprocess.run([sys.executable, "rel.py"], capture_output=True, text=True)
    assert report == json.loads(python.stdout.splitlines()[0])
    assert report["file"] == str(tmp_path / "rel.py") and report["argv0"] == "rel.py"
    err = (tmp_path / "logs/0/stderr.log").read_text()
    assert f'File "{tmp_path / "rel.py"}", line 4, in <module>' in err
    assert err == python.stderr


# -- torch's random state ------------------------------------------------------------------
SEEDS = """
import json, os, torch
print(json.dumps([torch.initial_seed(), torch.rand(4).tolist()]))
"""


@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
async def test_torch_random_state_differs_across_ranks_and_attempts(
    mode: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    script = write_script(tmp_path, "seeds.py", SEEDS)
    seen: list[tuple[int, list[float]]] = []
    for attempt in range(2):
        folder = tmp_path / str(attempt)
        result = await run_python(
            mode, folder, {0: (*BOOT, str(script)), 1: (*BOOT, str(script))}, preload=["torch"]
        )
        assert not result.is_failed()
        for r in range(2):
            seed, draws = json.loads((folder / f"logs/{r}/stdout.log").read_text())
            seen.append((seed, draws))
    assert len({seed for seed, _ in seen}) == 4  # every rank of every attempt its own
    assert len({tuple(draws) for _, draws in seen}) == 4


# -- what ps and /proc show --------------------------------------------------------------
SHOWN = """
import json, os, sys, time
with open(sys.argv[1], "w") as f:
    json.dump({"pid": os.getpid(), "environ": dict(os.environ)}, f)
print("up", flush=True)
time.sleep(60)
"""


def proc_entry(pid: int, name: str) -> list[str]:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return [os.fsdecode(item) for item in f.read().split(b"\0")[:-1]]


@pytest.mark.parametrize("mode", MODES)
async def test_ps_and_proc_show_the_workers_command_line_and_environment(
    mode: str, tmp_path: Path
) -> None:
    script = write_script(tmp_path, "shown_by_ps_7c1f.py", SHOWN)
    argv = {r: (*BOOT, str(script), str(tmp_path / f"{r}.json"), "--lr", "0.1") for r in (0, 1)}
    async with aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args=argv,
        envs={r: {"X": str(r)} for r in argv},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
        preload=["json"] if mode == "forked" else None,
        ready=aiolaunch.ReadyLine("up"),
    ) as ctx:
        await ctx.wait_ready(timeout=60)
        for r, args in argv.items():
            seen = json.loads((tmp_path / f"{r}.json").read_text())
            pid = seen["pid"]
            assert proc_entry(pid, "cmdline") == [sys.executable, *args]  # as exec'd
            environ = dict(item.split("=", 1) for item in proc_entry(pid, "environ"))
            assert environ == seen["environ"] and environ["X"] == str(r)
        found = subprocess.run(["pgrep", "-f", "shown_by_ps_7c1f"], capture_output=True, text=True)
        assert sorted(int(p) for p in found.stdout.split()) == sorted(ctx.pids().values())
        await ctx.close()


@pytest.mark.parametrize("mode", MODES)
def test_cli_workers_show_rank_in_their_environ(mode: str, tmp_path: Path) -> None:
    script = write_script(tmp_path, "s.py", SHOWN)
    argv = [*AIOLAUNCH, "--nproc-per-node", "1", "--tee", "3", *preload_flags(mode)]
    with driver([*argv, str(script), str(tmp_path / "seen.json")], cwd=str(tmp_path)) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if ":up" in line:
                break
        seen = json.loads((tmp_path / "seen.json").read_text())
        environ = dict(item.split("=", 1) for item in proc_entry(seen["pid"], "environ"))
        assert environ == seen["environ"]
        assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"} <= set(environ)
        proc.terminate()
        proc.communicate(timeout=60)


# -- the data at exit -------------------------------------------------------------------
HELPER = """
import sys
log = open(sys.argv[1] + ".helper", "w")  # a helper module's global
"""
HOLDS = """
import os, sys
import warm_helper_c2

GLOO = sys.argv[2] == "gloo"
if GLOO:  # gloo's threads run until the process ends (any DDP job)
    import torch.distributed as dist
    dist.init_process_group(
        "gloo", init_method=f"file://{sys.argv[1]}.rdzv", rank=0, world_size=1
    )


class Log:
    def __init__(self, path):
        self.f = open(path, "w")


held = Log(sys.argv[1] + ".object")  # an object in __main__
files = {"f": open(sys.argv[1] + ".dict", "w")}  # a dict in __main__
bare = open(sys.argv[1] + ".bare", "w")  # __main__'s own name
for i in range(1000):
    for f in (warm_helper_c2.log, held.f, files["f"], bare):
        f.write(f"line {i}\\n")
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gloo", [False, True], ids=["plain", "gloo"])
async def test_every_line_written_reaches_its_file(
    mode: str, gloo: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if gloo:
        pytest.importorskip("torch")
    write_script(tmp_path, "warm_helper_c2.py", HELPER)
    script = write_script(tmp_path, "holds.py", HOLDS)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    result = await run_python(
        mode,
        tmp_path,
        {0: (*BOOT, str(script), str(out), "gloo" if gloo else "plain")},
        preload=["torch"] if gloo else None,
    )
    assert not result.is_failed(), (tmp_path / "logs/0/stderr.log").read_text()
    ways = ("helper", "object", "dict", "bare")
    last = {way: (tmp_path / f"out.{way}").read_text().splitlines()[-1:] for way in ways}
    assert last == {way: ["line 999"] for way in ways}
