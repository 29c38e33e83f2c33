"""Warm start: the zygote while it is busy, and across calls (no torch needed).

A zygote imports its LATER modules (torch's ``torch._dynamo``) once its
first workers run: a second or more that no request may wait for. Here the
LATER module is one of the test's own that blocks its import until the test
releases it, so "during the import" is a fact, not a race: exits are seen
with their statuses, and requests are served by the spares, while it blocks.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from _programs import write_script
from aiolaunch import Std
from aiolaunch._warm._preload import Preload
from aiolaunch._warm._registry import close_zygotes, zygote_for

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="warm start is Linux-only"
)

BOOT = ["-u", "-m", "aiolaunch._child._bootstrap"]
#: a LATER module that says it is importing, then blocks until released
SLOW = Preload(("json",), ("warm_slow_later",))
SLOW_MODULE = """
import os, time
open("importing", "w").close()
deadline = time.monotonic() + 90
while not os.path.exists("release") and time.monotonic() < deadline:
    time.sleep(0.01)
"""
#: waits for the zygote's import to begin, then ends as argv[1] says
EXITS = """
import os, signal, sys, time
while not os.path.exists("importing"):
    time.sleep(0.01)
how = sys.argv[1]
if how == "exit3":
    sys.exit(3)
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
"""
WHO = "import os, sys; print(os.getppid(), 'warm_slow_later' in sys.modules)"


@pytest.fixture(autouse=True)
def _fresh_zygotes() -> Iterator[None]:
    yield
    close_zygotes()


async def run(tmp_path: Path, name: str, args: dict[int, tuple[str, ...]], **kw: Any) -> Any:
    async with aiolaunch.start_processes(
        name=name,
        entrypoint=sys.executable,
        args=args,
        envs={r: {} for r in args},
        log_dir=str(tmp_path / name),
        redirects=Std.ALL,
        preload=SLOW,  # type: ignore[arg-type]  # LATER modules of the test's own
        **kw,
    ) as ctx:
        # Bounded well below the module's own 90 s: a zygote that serves
        # nothing while it imports fails here, not by the suite's timeout.
        return await asyncio.wait_for(ctx.wait(), timeout=45)


async def test_exits_and_requests_are_served_while_the_zygote_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, "warm_slow_later.py", SLOW_MODULE)
    monkeypatch.chdir(tmp_path)  # the zygote finds the module (and the markers) here
    exits = write_script(tmp_path, "exits.py", EXITS)
    who = write_script(tmp_path, "who.py", WHO)
    z = zygote_for(SLOW, spares=4)
    assert z is not None
    try:
        # Four workers that end once the zygote's import began: their exits are
        # seen while it blocks; then it has four spares, forked before the import.
        first = await run(tmp_path, "a", {r: (*BOOT, str(exits), "ok") for r in range(4)})
        assert not first.is_failed()
        assert (tmp_path / "importing").exists() and not (tmp_path / "release").exists()
        # Each in a group of its own (a failed rank stops the others): a
        # spare each, and each exit seen with its own status.
        for how, status in (("exit3", 3), ("sigkill", -9), ("sigterm", -15)):
            result = await run(tmp_path, how, {0: (*BOOT, str(exits), how)})
            assert result.failures[0].exitcode == status, how
        # The last spare: made before the import, so without its module.
        second = await run(tmp_path, "b", {0: (*BOOT, str(who))})
        assert not second.is_failed()
        assert (tmp_path / "b/0/stdout.log").read_text() == f"{z.pid} False\n"
        assert not (tmp_path / "release").exists()
        # No spare left: forked once the import is done, with the module.
        third = asyncio.ensure_future(
            run(tmp_path, "c", {0: (*BOOT, str(who)), 1: (*BOOT, str(who))})
        )
        await asyncio.sleep(0.5)  # allowed: the requests reach the importing zygote
        assert not third.done()
    finally:
        (tmp_path / "release").touch()
    assert not (await third).is_failed()
    for r in range(2):
        assert (tmp_path / f"c/{r}/stdout.log").read_text() == f"{z.pid} True\n"


# -- fresh code across calls -------------------------------------------------------------
CFGMOD = """
import os
VERSION = {version}
MODE = os.environ.get("WARM_CFG_MODE", "a")
"""
SHOW_CFG = (
    "import os, warm_cfgmod_e5; print(warm_cfgmod_e5.VERSION, warm_cfgmod_e5.MODE, os.getppid())"
)


def write_cfgmod(tmp_path: Path, version: int) -> None:
    path = write_script(tmp_path, "warm_cfgmod_e5.py", CFGMOD.format(version=version))
    stamp = 1_700_000_000 + version  # a new mtime even within the file system's granularity
    os.utime(path, (stamp, stamp))


async def run_cfg(tmp_path: Path, name: str, envs: dict[int, dict[str, str]]) -> list[list[str]]:
    script = tmp_path / "show_cfg.py"
    async with aiolaunch.start_processes(
        name=name,
        entrypoint=sys.executable,
        args={r: (*BOOT, str(script)) for r in envs},
        envs=envs,
        log_dir=str(tmp_path / name),
        redirects=Std.ALL,
        preload=["warm_cfgmod_e5"],
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    return [(tmp_path / f"{name}/{r}/stdout.log").read_text().split() for r in envs]


async def test_a_changed_preload_module_never_runs_old_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, "show_cfg.py", SHOW_CFG)
    write_cfgmod(tmp_path, 1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WARM_CFG_MODE", raising=False)
    first = await run_cfg(tmp_path, "a", {0: {}, 1: {}})
    assert [v[:2] for v in first] == [["1", "a"]] * 2
    assert int(first[0][2]) != os.getpid()  # forked
    # The module changed: the next group runs the new code, every rank of it -
    # rank 1 starts the ordinary way (a load-time variable of its own).
    write_cfgmod(tmp_path, 2)
    second = await run_cfg(tmp_path, "b", {0: {}, 1: {"OMP_NUM_THREADS": "3"}})
    assert [v[:2] for v in second] == [["2", "a"]] * 2
    assert int(second[0][2]) != os.getpid() and int(second[1][2]) == os.getpid()
    # A variable it read at import changed: the new value, in every rank.
    monkeypatch.setenv("WARM_CFG_MODE", "b")
    third = await run_cfg(tmp_path, "c", {0: {}, 1: {}})
    assert [v[:2] for v in third] == [["2", "b"]] * 2
    # ... and in a rank that sets it alone.
    fourth = await run_cfg(tmp_path, "d", {0: {}, 1: {"WARM_CFG_MODE": "c"}})
    assert [v[:2] for v in fourth] == [["2", "b"], ["2", "c"]]


HOLD_THEN_EXIT = """
import os, sys, time, warm_cfgmod_e5
print(warm_cfgmod_e5.VERSION, os.getppid(), flush=True)
while not os.path.exists("go"):
    time.sleep(0.01)
sys.exit(3)
"""


async def test_a_replaced_zygote_stays_for_the_workers_it_forked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, "show_cfg.py", SHOW_CFG)
    hold = write_script(tmp_path, "hold.py", HOLD_THEN_EXIT)
    write_cfgmod(tmp_path, 1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WARM_CFG_MODE", raising=False)
    ctx = await aiolaunch.start_processes(
        name="old",
        entrypoint=sys.executable,
        args={0: (*BOOT, str(hold))},
        envs={0: {}},
        log_dir=str(tmp_path / "old"),
        redirects=Std.ALL,
        preload=["warm_cfgmod_e5"],
        ready=aiolaunch.ReadyLine("1 "),
    )
    async with ctx:
        await ctx.wait_ready(timeout=60)
        old_zygote = int((tmp_path / "old/0/stdout.log").read_text().split()[1])
        write_cfgmod(tmp_path, 2)
        new = await run_cfg(tmp_path, "new", {0: {}})  # a new zygote: the old one is retired
        assert new[0][0] == "2" and int(new[0][2]) != old_zygote
        assert os.path.exists(f"/proc/{old_zygote}")  # kept for the running worker
        (tmp_path / "go").touch()
        result = await ctx.wait()
    assert result is not None and result.failures[0].exitcode == 3  # its status, from it
    await run_cfg(tmp_path, "later", {0: {}})  # the next call closes the retired one
    assert not os.path.exists(f"/proc/{old_zygote}")
