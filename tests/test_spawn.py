"""``_workers._spawn.spawn``: Popen's fork and exec without Popen (#26).

Every case runs on both paths - CPython's ``fork_exec`` called directly (the
one used on 3.10-3.13) and the ``os.posix_spawn`` fallback (an interpreter
whose ``fork_exec`` convention is unknown) - with real processes.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import pytest

from aiolaunch._workers import _spawn
from aiolaunch._workers._spawn import spawn

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture(params=["fork_exec", "posix_spawn"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    arity = _spawn._arity()
    if request.param == "posix_spawn":
        monkeypatch.setattr(_spawn, "_fork_exec_arity", None)
    elif arity is None:  # pragma: no cover - an interpreter we do not know
        pytest.skip(f"fork_exec's convention is unknown on {sys.version}")
    return str(request.param)


def test_fork_exec_is_used_on_every_supported_python() -> None:
    # Else every start silently pays the slower fallback.
    assert _spawn._read_arity() == (21 if sys.version_info < (3, 11) else 23)


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _children() -> set[int]:
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found |= {int(p) for p in f.read().split()}
        except FileNotFoundError:
            # That thread ended after the listing (an executor's, pytest's):
            # it has no children to report.
            continue
    return found


def test_the_child_gets_what_popen_gives(path: str, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    probe = bindir / "probe"
    # The fd listing goes to a file first: in `ls ... | grep`, the shell may
    # still hold the pipeline's own pipe while ls lists its fds.
    probe.write_text(
        "#!/bin/sh\n"
        "echo \"sid=$(ps -o sid= -p $$ | tr -d ' ') pid=$$ env=$ONLY uni=$UNI\"\n"
        "grep -E '^SigIgn' /proc/$$/status\n"
        "env | grep -c .\n"
        f"ls -l /proc/$$/fd > {tmp_path}/fds\n"
        f"grep -c pipe: {tmp_path}/fds\n"
        "echo to-stderr >&2\n"
    )
    probe.chmod(0o755)
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC)
    err = os.open(tmp_path / "err", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC)
    r, w = os.pipe()
    os.set_inheritable(w, True)  # close_fds must close it
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "ONLY": "this", "UNI": "é-\udcff"}
    try:
        pid = spawn(["probe"], env, stdout=out, stderr=err, new_session=True)
        assert _wait(pid) == 0
    finally:
        for fd in (out, err, r, w):
            os.close(fd)
    first, sigign, nenv, pipes = (tmp_path / "out").read_bytes().splitlines()
    assert first == f"sid={pid} pid={pid} env=this uni=é-".encode() + b"\xff", first
    assert not int(sigign.split()[1], 16) & (1 << (signal.SIGPIPE - 1)), "SIGPIPE at default"
    assert int(nenv) <= 6, "no variable of ours leaked in (sh adds PWD, SHLVL, _)"
    assert pipes == b"0", "an inheritable fd of ours (a pipe) reached the child"
    assert (tmp_path / "err").read_text() == "to-stderr\n"


def test_without_a_session_or_redirects_the_child_shares_ours(path: str, tmp_path: Path) -> None:
    pid = spawn(["/bin/sh", "-c", f"ps -o sid= -p $$ > {tmp_path}/sid"], {"PATH": "/usr/bin:/bin"})
    assert _wait(pid) == 0
    assert int((tmp_path / "sid").read_text()) == os.getsid(0)


@pytest.mark.parametrize(
    ("what", "error"),
    [
        ("missing", FileNotFoundError),
        ("bad interpreter", FileNotFoundError),
        ("not executable", PermissionError),
        ("not on PATH", FileNotFoundError),
    ],
)
def test_a_program_that_cannot_start_raises_and_leaves_nothing(
    path: str, tmp_path: Path, what: str, error: type[OSError]
) -> None:
    script = tmp_path / "prog"
    if what == "bad interpreter":
        script.write_text("#!/nonexistent/interpreter\n")
        script.chmod(0o755)
    elif what == "not executable":
        script.write_text("#!/bin/sh\n")
        script.chmod(0o644)
    program = "no-such-program-26" if what == "not on PATH" else str(script)
    before = _children()
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(error) as caught:
        spawn([program], {"PATH": str(tmp_path)})
    assert caught.value.filename == program, caught.value
    assert program in str(caught.value)
    time.sleep(0.05)
    assert _children() == before, "the failed child was reaped"
    assert len(os.listdir("/proc/self/fd")) == fds, "the error pipe was closed"


@pytest.mark.parametrize(
    ("argv", "env", "match"),
    [
        (["/bin/true"], {"A=B": "1"}, "environment variable name"),
        (["/bin/true"], {"A": "x\0y"}, "null"),
        (["/bin/true", "x\0y"], {}, "null"),
    ],
)
def test_bad_input_is_refused_before_any_process(
    path: str, argv: list[str], env: dict[str, str], match: str
) -> None:
    before = _children()
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match=match):
        spawn(argv, env)
    assert _children() == before
    assert len(os.listdir("/proc/self/fd")) == fds, "the error pipe was closed"
