"""Temporary log folders (``log_dir=None``) leave nothing behind that holds nothing.

Every kind of run - ``start_processes``, ``launch()``, ``DefaultLogsSpecs``,
the agent and the CLI - removes the empty rank and attempt folders it made,
and the root if it ends empty; a folder that holds a log or an error file is
kept. Each test points ``tempfile`` (or ``TMPDIR``) at a private folder so
that what is left can be listed exactly.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from aiolaunch import DefaultLogsSpecs, Std
from aiolaunch.agent import LocalElasticAgent, WorkerSpec, WorkerState

if TYPE_CHECKING:
    from pathlib import Path


def _tree(root: Path) -> list[str]:
    """Every path under ``root``, relative, sorted (folders end with '/').

    The per-user list of running groups (``aiolaunch-<uid>/``, the control
    socket's registry) is left out while it is empty: it lives as long as the
    process (removed at exit, see test_the_registry_folder_goes_at_exit).
    """
    registry = root / f"aiolaunch-{os.getuid()}"
    if registry.is_dir() and not any(registry.iterdir()):
        return [p for p in _tree_all(root) if not p.startswith(f"{registry.name}/")]
    return _tree_all(root)


def _roots(tmp: Path) -> list[Path]:
    """The folders in ``tmp`` but the (empty) registry of running groups."""
    return [p for p in tmp.iterdir() if f"{p.name}/" in _tree(tmp)]


def _tree_all(root: Path) -> list[str]:
    out = []
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out += [os.path.normpath(os.path.join(rel, d)) + "/" for d in dirs]
        out += [os.path.normpath(os.path.join(rel, f)) for f in files]
    return sorted(out)


def ok(x: int) -> int:
    return x * 2


def fail_on_rank_one(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 cannot go on")
    return rank


def fail_launched(_: Any) -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("launched rank 1 fails")


RECORD = aiolaunch.record(fail_on_rank_one)


async def test_quiet_start_processes_leaves_nothing(private_tmp: Path) -> None:
    async with aiolaunch.start_processes(
        name="quiet", entrypoint="/bin/true", args={0: (), 1: ()}, envs={0: {}, 1: {}}
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    assert _tree(private_tmp) == []


async def test_quiet_function_workers_leave_nothing(private_tmp: Path) -> None:
    async with aiolaunch.start_processes(
        name="fn", entrypoint=ok, args={0: (1,), 1: (2,)}, envs={0: {}, 1: {}}
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and result.return_values == {0: 2, 1: 4}
    assert _tree(private_tmp) == []


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def test_failing_run_keeps_only_the_error_file(private_tmp: Path) -> None:
    # A handler on the "aiolaunch" logger itself: the CLI may have turned its
    # propagation off in this process.
    logger = logging.getLogger("aiolaunch")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        async with aiolaunch.start_processes(
            name="bad", entrypoint=RECORD, args={0: (0,), 1: (1,)}, envs={0: {}, 1: {}}
        ) as ctx:
            result = await ctx.wait()
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert result is not None and set(result.failures) == {1}
    error_file = result.failures[1].error_file
    assert os.path.isfile(error_file), "the kept folder holds the error file"
    (root,) = _roots(private_tmp)
    assert root.name.startswith("aiolaunch_bad_")
    assert f"aiolaunch: logs of bad kept in {root}" in records.messages
    # No rank has a log file: no rank folder at all (#26), the error file of
    # rank 1 beside the failure report; rank 0 wrote nothing.
    assert _tree(root) == ["error-1.json", "report.json", "report.txt"]
    assert error_file == str(root / "error-1.json")


async def test_redirected_logs_are_kept_even_when_empty(private_tmp: Path) -> None:
    """0-byte log files are kept (as torch keeps them): ``result.stdouts`` names them."""
    async with aiolaunch.start_processes(
        name="logs",
        entrypoint="/bin/sh",
        args={0: ("-c", "echo hi"), 1: ("-c", "true")},
        envs={0: {}, 1: {}},
        redirects=Std.ALL,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    with open(result.stdouts[0]) as f:
        assert f.read() == "hi\n"
    assert os.path.getsize(result.stdouts[1]) == 0
    (root,) = _roots(private_tmp)
    assert _tree(root) == [
        "0/",
        "0/stderr.log",
        "0/stdout.log",
        "1/",
        "1/stderr.log",
        "1/stdout.log",
    ]


async def test_spawn_failure_leaves_nothing(tmp_path: Path, private_tmp: Path) -> None:
    """The binary vanishes between the call (validated) and the await (spawn fails)."""
    script = tmp_path / "gone.sh"
    script.write_text("#!/bin/sh\nsleep 30\n")
    script.chmod(0o755)
    starting = aiolaunch.start_processes(
        name="gone", entrypoint=str(script), args={0: (), 1: ()}, envs={0: {}, 1: {}}
    )
    script.unlink()
    with pytest.raises(OSError):  # noqa: PT011 - whatever exec says; the point is what's left
        await starting
    assert _tree(private_tmp) == []


async def test_launch_leaves_nothing_on_success(private_tmp: Path) -> None:
    assert await aiolaunch.launch(ok, 3, 2) == {0: 6, 1: 6}
    assert _tree(private_tmp) == []


async def test_launch_keeps_the_error_file_on_failure(private_tmp: Path) -> None:
    with pytest.raises(aiolaunch.WorkerError):
        await aiolaunch.launch(aiolaunch.record(fail_launched), None, 2)
    (root,) = _roots(private_tmp)
    tree = _tree(root)
    assert "error-1.json" in tree
    assert [p for p in tree if p.endswith("/")] == []


async def test_default_logs_specs_temp_folder_is_removed_and_reusable(
    private_tmp: Path,
) -> None:
    specs = DefaultLogsSpecs()  # log_dir=None: a temporary folder
    assert os.path.isdir(specs.root_log_dir)
    for _ in range(2):  # the same specs for a second run: fresh folders again
        async with aiolaunch.start_processes(
            name="s", entrypoint="/bin/true", args={0: ()}, envs={0: {}}, logs_specs=specs
        ) as ctx:
            result = await ctx.wait()
        assert result is not None and not result.is_failed()
        assert _tree(private_tmp) == []


async def test_default_logs_specs_keeps_what_holds_logs(private_tmp: Path) -> None:
    specs = DefaultLogsSpecs(redirects={1: Std.OUT})
    async with aiolaunch.start_processes(
        name="s",
        entrypoint="/bin/echo",
        args={0: ("a",), 1: ("b",)},
        envs={0: {}, 1: {}},
        logs_specs=specs,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    with open(result.stdouts[1]) as f:
        assert f.read() == "b\n"
    (root,) = _roots(private_tmp)
    (run,) = _tree(root)[:1]
    assert _tree(root) == [
        run,
        f"{run}attempt_0/",
        f"{run}attempt_0/1/",
        f"{run}attempt_0/1/stdout.log",
    ]


async def test_agent_run_with_temp_log_dir_leaves_nothing(private_tmp: Path) -> None:
    spec = WorkerSpec(role="w", local_world_size=2, entrypoint="/bin/true")
    agent = LocalElasticAgent(spec)
    result = await agent.run()
    assert result.state == WorkerState.SUCCEEDED
    assert _tree(private_tmp) == []
    assert agent.run_log_dir is None  # removed, so not reported


def test_cli_run_leaves_nothing(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "quiet.py"
    script.write_text("pass\n")
    for extra in ([], ["--local-ranks-filter", "0"]):
        proc = subprocess.run(
            [sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2", *extra, str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
        assert proc.returncode == 0, proc.stderr
        assert _tree(tmp) == [], extra


def test_prune_removes_every_empty_folder_and_never_follows_a_symlink(tmp_path: Path) -> None:
    from aiolaunch._logs._specs import prune_empty_dirs

    outside = tmp_path / "outside"
    (outside / "empty").mkdir(parents=True)
    top = tmp_path / "run"
    for rel in ("0", "1/deep/deeper", "2/sub", "3/a/b"):
        (top / rel).mkdir(parents=True)
    (top / "2" / "stdout.log").write_bytes(b"")  # a 0-byte log is kept
    (top / "3" / "a" / "error.json").write_text("{}")
    (top / "4").symlink_to(outside, target_is_directory=True)
    kept = prune_empty_dirs([str(top)], "t")
    assert kept == str(top)
    assert _tree(top) == [
        "2/",
        "2/stdout.log",
        "3/",
        "3/a/",
        "3/a/error.json",
        "4/",
    ]  # os.walk lists a symlink with the folders
    assert (outside / "empty").is_dir()  # the symlink's target was left alone
    (top / "4").unlink()
    for p in ("2/stdout.log", "3/a/error.json"):
        (top / p).unlink()
    assert prune_empty_dirs([str(top)], "t") is None
    assert not top.exists()


def test_the_registry_folder_goes_at_exit(tmp_path: Path) -> None:
    """The per-user list of running groups stays while the process lives (an
    rmdir and a mkdir per group cost milliseconds where the filesystem
    discards a freed block synchronously) and goes when it exits."""
    code = (
        "import asyncio, aiolaunch, os, tempfile\n"
        "reg = os.path.join(tempfile.gettempdir(), f'aiolaunch-{os.getuid()}')\n"
        "async def main():\n"
        "    for _ in range(2):\n"
        "        args = {0: ('-c', 'sleep 30')}\n"
        "        async with aiolaunch.start_processes('r', '/bin/sh', args, {0: {}}):\n"
        "            for _ in range(3000):  # the socket is listed once it listens\n"
        "                if os.path.isdir(reg) and os.listdir(reg):\n"
        "                    break\n"
        "                await asyncio.sleep(0.01)\n"
        "        print(sorted(os.listdir(tempfile.gettempdir())), os.listdir(reg))\n"
        "asyncio.run(main())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    registry = f"aiolaunch-{os.getuid()}"
    assert out.stdout.splitlines() == [f"{[registry]} []"] * 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "path",
    [
        "/tmp/aiolaunch_b_0a1b2c3d4e5f",
        "/tmp/with space/é/new\nline/quote'\"/back\\slash",
        "rel/x-y.z",
    ],
)
def test_a_path_reaches_the_guardian_byte_for_byte(path: str) -> None:
    """What ``printf %b`` (the guardian's shell) reads back from a registration
    line is the path itself - on the plain-name fast path and for every
    other byte."""
    from aiolaunch._workers._guardian import _escape

    line = _escape(path)
    assert "\n" not in line and " " not in line
    if all(c.isascii() and (c.isalnum() or c in "/._-") for c in path):
        assert line == path
    out = subprocess.run(
        ["/bin/sh", "-c", 'printf %b "$1"', "sh", line], capture_output=True, check=True
    ).stdout
    assert out == os.fsencode(path)
