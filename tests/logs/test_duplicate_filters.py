"""torch 2.9+'s duplicate filters: matching tee'd lines of all ranks in one file."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

import aiolaunch
from aiolaunch import DefaultLogsSpecs, Std

if TYPE_CHECKING:
    from pathlib import Path

# Each rank prints a matching and a non-matching line on both streams.
SCRIPT = (
    'echo "apple from $R"; echo "pear from $R"; '
    'echo "orange err $R" >&2; echo "plum err $R" >&2; printf "apple tail $R"'
)


def _envs(n: int) -> dict[int, dict[str, str]]:
    return {r: {"R": str(r)} for r in range(n)}


async def test_matching_lines_of_tee_d_ranks_go_to_one_file(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="fruit",
        entrypoint="/bin/sh",
        args={0: ("-c", SCRIPT), 1: ("-c", SCRIPT)},
        envs=_envs(2),
        log_dir=tmp_path,
        tee=Std.ALL,
        duplicate_stdout_filters=["apple", "grape"],
        duplicate_stderr_filters=["orange"],
    ) as ctx:
        assert ctx.filtered_stdout is not None and ctx.filtered_stderr is not None
        result = await ctx.wait()
        assert result is not None and not result.is_failed()
        assert ctx.filtered_stdout.closed
    out = (tmp_path / "filtered_stdout.log").read_text().splitlines()
    err = (tmp_path / "filtered_stderr.log").read_text().splitlines()
    # order between ranks is free; within a rank it is kept
    assert sorted(out) == sorted(
        [
            "[fruit0]:apple from 0",
            "[fruit0]:apple tail 0",
            "[fruit1]:apple from 1",
            "[fruit1]:apple tail 1",
        ]
    )
    assert sorted(err) == ["[fruit0]:orange err 0", "[fruit1]:orange err 1"]
    # the per-rank logs keep every byte
    assert (tmp_path / "0" / "stdout.log").read_text() == "apple from 0\npear from 0\napple tail 0"


async def test_only_tee_d_ranks_feed_the_file_and_prefixes_apply(tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="fruit",
        entrypoint="/bin/sh",
        args={0: ("-c", SCRIPT), 1: ("-c", SCRIPT)},
        envs=_envs(2),
        log_dir=tmp_path,
        redirects=Std.ALL,
        tee={1: Std.OUT},
        log_line_prefixes={1: "<one> "},
        duplicate_stdout_filters=["apple"],
    ) as ctx:
        assert ctx.filtered_stderr is None
        await ctx.wait()
    assert (tmp_path / "filtered_stdout.log").read_text() == (
        "<one> apple from 1\n<one> apple tail 1\n"
    )
    assert not (tmp_path / "filtered_stderr.log").exists()


async def test_empty_filter_lists_make_no_file_and_empty_string_matches_all(
    tmp_path: Path,
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    async with aiolaunch.start_processes(
        name="f",
        entrypoint="/bin/sh",
        args={0: ("-c", SCRIPT)},
        envs=_envs(1),
        log_dir=a,
        tee=Std.ALL,
        duplicate_stdout_filters=[],
    ) as ctx:
        await ctx.wait()
        assert ctx.filtered_stdout is None
    assert not (a / "filtered_stdout.log").exists()
    async with aiolaunch.start_processes(
        name="f",
        entrypoint="/bin/sh",
        args={0: ("-c", SCRIPT)},
        envs=_envs(1),
        log_dir=b,
        tee=Std.OUT,
        duplicate_stdout_filters=[""],
    ) as ctx:
        await ctx.wait()
    assert (b / "filtered_stdout.log").read_text().count("\n") == 3


async def test_logs_specs_put_the_file_in_the_attempt_folder(tmp_path: Path) -> None:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), tee=Std.OUT)
    envs = {0: {"R": "0", "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "2"}}
    async with aiolaunch.start_processes(
        name="f",
        entrypoint="/bin/sh",
        args={0: ("-c", SCRIPT)},
        envs=envs,
        logs_specs=specs,
        duplicate_stdout_filters=["pear"],
    ) as ctx:
        await ctx.wait()
        assert ctx.filtered_stdout is not None
    found = list(tmp_path.glob("job_*/attempt_2/filtered_stdout.log"))
    assert len(found) == 1
    assert found[0].read_text() == "[f0]:pear from 0\n"


@pytest.mark.parametrize("bad", ["apple", [1], {"a": 1}])
async def test_bad_filters_are_refused_before_start(tmp_path: Path, bad: object) -> None:
    with pytest.raises(TypeError, match="duplicate_stdout_filters"):
        await aiolaunch.start_processes(
            name="f",
            entrypoint="/bin/true",
            args={0: ()},
            envs={0: {}},
            log_dir=tmp_path,
            duplicate_stdout_filters=bad,  # type: ignore[arg-type]
        )
    assert list(tmp_path.iterdir()) == []


async def test_filtered_files_are_named_by_their_path_as_in_torch(tmp_path: Path) -> None:
    """#27.8: torch's ``pc.filtered_stdout.name`` is the file's path (its tests
    read the file back through it); ours was the fd number."""
    async with aiolaunch.start_processes(
        name="fruit",
        entrypoint="/bin/sh",
        args={0: ("-c", SCRIPT)},
        envs=_envs(1),
        log_dir=tmp_path,
        tee=Std.ALL,
        duplicate_stdout_filters=["apple"],
        duplicate_stderr_filters=["orange"],
    ) as ctx:
        assert ctx.filtered_stdout is not None and ctx.filtered_stderr is not None
        assert ctx.filtered_stdout.name == str(tmp_path / "filtered_stdout.log")
        assert ctx.filtered_stderr.name == str(tmp_path / "filtered_stderr.log")
        await ctx.wait()
    with open(ctx.filtered_stdout.name) as f:
        assert f.read().splitlines() == ["[fruit0]:apple from 0", "[fruit0]:apple tail 0"]
    with open(ctx.filtered_stderr.name) as f:
        assert f.read() == "[fruit0]:orange err 0\n"
