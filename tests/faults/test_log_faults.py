"""Fault matrix, part 3: hostile bytes, a log folder that fails, planted symlinks.

Real workers write through real pipes into the real sinks; the autouse leak
check covers processes, fds and handlers. Each test states which bytes must be
kept exactly and which failure must be reported.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aiolaunch
from aiolaunch import Std

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux paths")

WRITE_FILE_IN_PIECES = """
import os, random, sys
data = open(sys.argv[1], "rb").read()
rng = random.Random(int(sys.argv[2]))
i = 0
while i < len(data):
    n = rng.choice([1, 2, 3, 7, 64, 4095, 4096, 65537, 300000])
    os.write(1, data[i : i + n])
    i += n
"""


def _garbage(seed: int, size: int, allow_cr: bool) -> bytes:
    rng = random.Random(seed)
    parts: list[bytes] = []
    while sum(map(len, parts)) < size:
        pick = rng.random()
        if pick < 0.3:
            parts.append(rng.randbytes(rng.randint(1, 5000)))  # anything, NUL included
        elif pick < 0.5:
            parts.append(b"\xff\xfe\x00\xc3" * rng.randint(1, 50))  # invalid UTF-8
        elif pick < 0.7:
            parts.append("é✓𝄞".encode() * rng.randint(1, 50))  # multibyte, split anywhere
        else:
            parts.append(b"\n" * rng.randint(1, 3))
    data = b"".join(parts)[:size]
    return data if allow_cr else data.replace(b"\r", b"?")


async def test_binary_garbage_exact_in_file_and_whole_lines_on_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """1 MB of random bytes (NUL, invalid UTF-8, split multibyte characters), in
    writes of odd sizes: the file is byte-identical; the console shows exactly
    the lines, each prefixed, decoded with ``errors="replace"``.
    """
    data = _garbage(7, 1 << 20, allow_cr=False) + b"tail without newline"
    src = tmp_path / "garbage.bin"
    src.write_bytes(data)
    script = tmp_path / "writer.py"
    script.write_text(WRITE_FILE_IN_PIECES)
    async with aiolaunch.start_processes(
        name="g",
        entrypoint=sys.executable,
        args={0: (str(script), str(src), "3")},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        tee=Std.OUT,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None and not result.is_failed()
    assert Path(result.stdouts[0]).read_bytes() == data
    out = capsys.readouterr().out
    expected_lines = data.decode("utf-8", errors="replace").split("\n")
    pieces: list[str] = []
    for line in expected_lines:
        # over-long lines go out in 64 KiB pieces, each prefixed
        pieces += [line[i : i + 65536] for i in range(0, max(len(line), 1), 65536)] or [""]
    expected = "".join(f"[g0]:{p}\n" for p in pieces)
    assert out == expected


LOOP_WRITER = """
import os, sys, time
i = 0
while True:
    try:
        os.write(1, b"line %06d\\n" % i)
    except BrokenPipeError:
        sys.exit(5)
    i += 1
    if i % 100 == 0:
        time.sleep(0.005)
    if os.path.exists(sys.argv[1]):
        break
raise RuntimeError("stopped on request")
"""


async def test_log_dir_removed_mid_run(tmp_path: Path) -> None:
    """``rm -rf log_dir`` while a worker writes: the open files live on as
    unlinked inodes (the writes keep succeeding), the worker's failure is still
    reported with its exit code, and ``wait()`` neither hangs nor raises.
    The worker's error file is written again into a re-created rank folder.
    """
    stop = tmp_path / "stop"
    script = tmp_path / "w.py"
    script.write_text(
        "from aiolaunch import record\n"
        + "@record\ndef main():\n"
        + textwrap.indent(LOOP_WRITER.replace("import os, sys, time\n", ""), "    ")
        + "\nimport os, sys, time\nmain()\n"
    )
    log_dir = tmp_path / "logs"
    async with aiolaunch.start_processes(
        name="r",
        entrypoint=sys.executable,
        args={0: (str(script), str(stop))},
        envs={0: {}},
        log_dir=str(log_dir),
        redirects=Std.ALL,
    ) as ctx:
        while (
            not (log_dir / "0" / "stdout.log").exists()
            or not (log_dir / "0" / "stdout.log").stat().st_size
        ):
            await asyncio.sleep(0.01)
        shutil.rmtree(log_dir)
        await asyncio.sleep(0.2)
        stop.touch()
        result = await asyncio.wait_for(ctx.wait(), 30)
    assert result is not None and set(result.failures) == {0}
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert "stopped on request" in str(failure.message)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return r.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> object:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount)")
    yield disk
    _umount(disk)


FILL = """
import errno, os, sys
for i in range(4000):
    try:
        os.write(1, b"%06d " % i + b"z" * 193 + b"\\n")   # 800 kB in total
    except OSError as exc:
        print(f"write {i}: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.errno)
print("done", file=sys.stderr, flush=True)
"""


async def test_full_disk_gives_the_worker_enospc(tiny_disk: Path, tmp_path: Path) -> None:
    """A 256 KiB tmpfs fills up under an 800 kB log. The worker writes its log
    file itself (as with torch), so its own write fails with ENOSPC - it is
    neither blocked nor killed by the supervisor - and the file holds an exact
    prefix of what was written (no garbage, no reordering).
    """
    async with aiolaunch.start_processes(
        name="d",
        entrypoint=sys.executable,
        args={0: ("-c", FILL)},
        envs={0: {}},
        log_dir=str(tiny_disk / "logs"),
        redirects=Std.OUT,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 30)
    assert result is not None
    expected = b"".join(b"%06d " % i + b"z" * 193 + b"\n" for i in range(4000))
    data = Path(result.stdouts[0]).read_bytes()
    assert 0 < len(data) < len(expected)
    assert expected.startswith(data)


async def test_full_disk_is_reported(tiny_disk: Path) -> None:
    """Loss of log bytes is never silent: the worker sees ENOSPC, and its exit
    (here with that errno) is the group's failure."""
    async with aiolaunch.start_processes(
        name="d",
        entrypoint=sys.executable,
        args={0: ("-c", FILL)},
        envs={0: {}},
        log_dir=str(tiny_disk / "logs"),
        redirects=Std.OUT,
    ) as ctx:
        result = await asyncio.wait_for(ctx.wait(), 30)
    assert result is not None and set(result.failures) == {0}
    assert result.failures[0].exitcode == errno.ENOSPC


# -- security ----------------------------------------------------------------------


async def test_symlink_planted_at_rank_dir_is_refused(tmp_path: Path) -> None:
    """An attacker plants ``{log_dir}/0 -> elsewhere`` between the validation of
    ``start_processes(...)`` (log_dir empty) and the await that creates the
    folders: a clear error, the target untouched, no worker started.
    """
    log_dir = tmp_path / "shared" / "run"
    log_dir.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    starting = aiolaunch.start_processes(
        name="s",
        entrypoint="/bin/echo",
        args={0: ("pwned",)},
        envs={0: {}},
        log_dir=str(log_dir),
        redirects=Std.ALL,
    )
    (log_dir / "0").symlink_to(victim)
    with pytest.raises(FileExistsError, match="refusing to follow"):
        await starting
    assert list(victim.iterdir()) == []


async def test_symlink_planted_at_a_later_rank_dir_is_refused(tmp_path: Path) -> None:
    """Rank folders 1.. are made by a background ``mkdir`` while earlier
    ranks spawn: a symlink planted at ``{log_dir}/5`` still fails the await
    with the same error, the target stays untouched, the ranks already
    started are stopped (the autouse leak check: no process left) and no
    folder appears after the call failed.
    """
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    marker = tmp_path / "ran"
    marker.mkdir()
    n = 8
    starting = aiolaunch.start_processes(
        name="s",
        entrypoint="/bin/sh",
        args={r: ("-c", f"touch {marker}/$0; exec sleep 30", str(r)) for r in range(n)},
        envs={r: {} for r in range(n)},
        log_dir=str(log_dir),
        redirects=Std.ALL,
    )
    (log_dir / "5").symlink_to(victim)
    with pytest.raises(FileExistsError, match="refusing to follow"):
        await starting
    assert list(victim.iterdir()) == []
    made = sorted(p.name for p in log_dir.iterdir())
    assert {"0", "1", "2", "3", "4", "5"} <= set(made) <= {str(r) for r in range(n)}, made
    assert (log_dir / "5").is_symlink()
    await asyncio.sleep(0.2)
    assert sorted(p.name for p in log_dir.iterdir()) == made  # none made after the call


async def test_every_rank_dir_exists_before_its_worker_runs(tmp_path: Path) -> None:
    """Each worker finds its own rank folder (where ``TORCHELASTIC_ERROR_FILE``
    points) from its first instruction, though folders 1.. are made in the
    background; every folder exists once the await returned.
    """
    n = 16
    script = 'test -d "$(dirname "$TORCHELASTIC_ERROR_FILE")" || exit 7'
    ctx = await aiolaunch.start_processes(
        name="d",
        entrypoint="/bin/sh",
        args={r: ("-c", script) for r in range(n)},
        envs={r: {} for r in range(n)},
        log_dir=str(tmp_path / "logs"),
    )
    assert all((tmp_path / "logs" / str(r)).is_dir() for r in range(n))
    result = await ctx.wait()
    assert result is not None
    assert not result.is_failed(), result.failures


async def test_symlink_planted_at_stdout_log_is_refused(tmp_path: Path) -> None:
    """``{log_dir}/0/stdout.log -> /victim``: ``O_NOFOLLOW`` makes the open fail
    (ELOOP); the victim file keeps its bytes; no worker started; fds closed.
    """
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    starting = aiolaunch.start_processes(
        name="s",
        entrypoint="/bin/echo",
        args={0: ("pwned",)},
        envs={0: {}},
        log_dir=str(log_dir),
        redirects=Std.ALL,
    )
    (log_dir / "0").mkdir()
    (log_dir / "0" / "stdout.log").symlink_to(victim)
    with pytest.raises(OSError, match=r"stdout\.log") as info:
        await starting
    assert info.value.errno in (40, 31)  # ELOOP (Linux), EMLINK (FreeBSD)
    assert victim.read_bytes() == b"precious\n"


UMASK = """
import asyncio, os, stat, sys, json
import aiolaunch
from aiolaunch import Std
os.umask(int(sys.argv[2], 8))
async def main():
    async with aiolaunch.start_processes(
        name="u", entrypoint=sys.executable,
        args={0: ("-c", "import sys; print('x'); sys.exit(1)"), 1: ("-c", "raise SystemExit(2)")},
        envs={0: {}, 1: {}}, log_dir=sys.argv[1], redirects=Std.ALL) as ctx:
        await ctx.wait()
    modes = {}
    for root, dirs, files in os.walk(sys.argv[1]):
        for n in dirs + files:
            p = os.path.join(root, n)
            modes[os.path.relpath(p, sys.argv[1])] = oct(stat.S_IMODE(os.lstat(p).st_mode))
    print(json.dumps(modes))
asyncio.run(main())
"""


@pytest.mark.parametrize(
    ("umask", "dmode", "fmode"), [("022", "0o755", "0o644"), ("077", "0o700", "0o600")]
)
def test_log_files_respect_the_umask(tmp_path: Path, umask: str, dmode: str, fmode: str) -> None:
    """Folders and files are created with 0o777/0o666 filtered by the user's
    umask (in a subprocess: the umask is process-wide)."""
    import json

    script = tmp_path / "u.py"
    script.write_text(UMASK)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "logs"), umask],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    modes = json.loads(out.stdout.strip().splitlines()[-1])
    assert modes["0"] == dmode and modes["1"] == dmode
    assert modes["0/stdout.log"] == fmode and modes["1/stderr.log"] == fmode


ANSI = "\x1b[31mred\x1b[0m \x1b]0;title\x07plain \x1b[2K\x1b[1Gbar"


async def test_strip_ansi_on_the_console_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = f"import sys; sys.stdout.write({ANSI!r} + '\\n')"
    async with aiolaunch.start_processes(
        name="a",
        entrypoint=sys.executable,
        args={0: ("-c", code)},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        tee=Std.OUT,
        console_strip_ansi=True,
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    assert Path(result.stdouts[0]).read_text() == ANSI + "\n"
    console = capsys.readouterr().out
    assert console == "[a0]:red plain bar\n"
    assert not re.search("\x1b", console)
