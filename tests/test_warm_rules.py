"""Warm start's pure rules, without processes: what is forked, what the zygote gets, the wire."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from argparse import Namespace
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiolaunch._child._forked import _exit_code
from aiolaunch._child._provenance import EnvReads, Provenance, module_files
from aiolaunch._child._safety import load_time_items
from aiolaunch._child._wire import (
    Decoder,
    Exited,
    Fork,
    Forked,
    FunctionJob,
    Later,
    Loaded,
    Message,
    Refused,
    Spare,
    encode,
    receive,
    send,
)
from aiolaunch._cli._config import _IMPORTS_TORCH, _imports_torch
from aiolaunch._warm._forks import script_form
from aiolaunch._warm._preload import Preload, resolve_preload, shared_load_env

if TYPE_CHECKING:
    from pathlib import Path

PY = sys.executable


def test_load_time_items_are_what_libraries_read_as_they_load() -> None:
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
        "LD_PRELOAD": "x.so",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "MKL_NUM_THREADS": "2",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHINDUCTOR_CACHE_DIR": "/c",
        # read when used, per rank and per attempt: never a reason to spawn
        "RANK": "3",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "CUDA_VISIBLE_DEVICES": "3",
        "NCCL_DEBUG": "INFO",
        "PATH": "/bin",
    }
    names = {k for k, _ in load_time_items(env)}
    assert names == {
        "OMP_NUM_THREADS",
        "PYTHONHASHSEED",
        "LD_PRELOAD",
        "LANG",
        "LC_ALL",
        "MKL_NUM_THREADS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCHINDUCTOR_CACHE_DIR",
    }


values = st.sampled_from([None, "1", "2", "4"])


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a loaded host
@given(st.lists(st.tuples(values, values), min_size=1, max_size=8))
def test_the_zygote_takes_each_load_time_variable_as_most_ranks_set_it(
    ranks: list[tuple[str | None, str | None]],
) -> None:
    envs = {
        r: {k: v for k, v in (("OMP_NUM_THREADS", a), ("MKL_NUM_THREADS", b)) if v is not None}
        | {"RANK": str(r)}
        for r, (a, b) in enumerate(ranks)
    }
    shared = shared_load_env(envs)
    assert "RANK" not in shared
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        counts: dict[str | None, int] = {}
        for env in envs.values():
            counts[env.get(name)] = counts.get(env.get(name), 0) + 1
        best = max(counts.values())
        assert counts[shared.get(name)] == best  # a most common value (unset included)


def test_shared_load_env_of_identical_ranks_is_theirs() -> None:
    envs = {r: {"OMP_NUM_THREADS": "1", "RANK": str(r)} for r in range(4)}
    assert shared_load_env(envs) == {"OMP_NUM_THREADS": "1"}


def test_resolve_preload() -> None:
    assert resolve_preload(None) is None and resolve_preload(False) is None
    assert resolve_preload(["json", "json", "os.path"]) == Preload(("json", "os.path"))
    assert resolve_preload([]) is None
    p = Preload(("json",))
    assert resolve_preload(p) is p
    for bad, exc in (("json", TypeError), (3, TypeError), (["1x"], ValueError), ([""], ValueError)):
        with pytest.raises(exc, match="preload"):
            resolve_preload(bad)
    with pytest.raises(ValueError, match=r"--preload: no module named 'nope_xyz'"):
        resolve_preload(["nope_xyz.sub"], "--preload")


def test_resolve_preload_with_torch_imports_dynamo_later() -> None:
    pytest.importorskip("torch")
    assert resolve_preload(True) == Preload(("torch",), ("torch._dynamo",))
    assert resolve_preload(["torch._dynamo", "torch"]) == Preload(("torch._dynamo", "torch"))


@pytest.mark.parametrize(
    ("argv", "form"),
    [
        (
            [PY, "-u", "-m", "aiolaunch._child._bootstrap", "t.py", "a"],
            {"argv": ["t.py", "a"], "unbuffered": True, "bootstrap": True},
        ),
        (
            [PY, "-u", "-m", "aiolaunch._child._bootstrap", "-m", "pkg.m"],
            {"argv": ["-m", "pkg.m"], "unbuffered": True, "bootstrap": True},
        ),
        ([PY, "t.py"], {"argv": ["t.py"], "unbuffered": False, "bootstrap": False}),
        (
            [PY, "-m", "pkg", "x"],
            {"argv": ["-m", "pkg", "x"], "unbuffered": False, "bootstrap": False},
        ),
        ([PY, "-c", "pass"], None),  # not a script: spawned
        ([PY, "-O", "t.py"], None),  # another interpreter option: spawned
        ([PY, "-u"], None),
        ([PY, "-m"], None),
        ([PY, "-u", "-m", "aiolaunch._child._bootstrap"], None),
        (["/bin/echo", "t.py"], None),  # another program
        (["python9.9", "t.py"], None),
    ],
)
def test_script_form(argv: list[str], form: dict[str, object] | None) -> None:
    got = script_form(argv, {})
    if form is None:
        assert got is None
    else:
        assert got is not None and dataclasses.asdict(got) == {**form, "orig_argv": argv}


def test_pythonunbuffered_is_minus_u() -> None:
    form = script_form([PY, "t.py"], {"PYTHONUNBUFFERED": "1"})
    assert form is not None and form.unbuffered


@pytest.mark.parametrize(
    ("source", "imports"),
    [
        (b"import torch\n", True),
        (b"import os, torch.distributed as dist\n", True),
        (b"    from torch import nn\n", True),
        (b"import os\nimport torch.nn\n", True),
        (b"import numpy as np, torch\n", True),
        (b"import numpy as np, torch as t\n", True),
        (b"import os; import torch\n", True),
        (b"x = 1; from torch import nn\n", True),
        (b"import numpy as np, torchvision\n", False),
        (b"import torch_xla\n", False),
        (b"import torchvision\n", False),
        (b"from torchvision import models\n", False),
        (b"# import torch\n", False),
        (b"x = 'import torch'\n", False),
    ],
)
def test_the_cli_default_looks_for_an_import_of_torch(source: bytes, imports: bool) -> None:
    assert (_IMPORTS_TORCH.search(source) is not None) == imports


def test_imports_torch_of_a_script_and_a_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "t.py").write_text("import torch\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/__init__.py").write_text("raise RuntimeError('never imported')\n")
    (tmp_path / "pkg/train.py").write_text("from torch import nn\n")
    (tmp_path / "pkg/__main__.py").write_text("print(1)\n")
    monkeypatch.chdir(tmp_path)
    assert _imports_torch(Namespace(training_script="t.py", module=False))
    assert _imports_torch(Namespace(training_script="pkg.train", module=True))
    assert not _imports_torch(Namespace(training_script="pkg", module=True))  # its __main__
    assert not _imports_torch(Namespace(training_script="nope.py", module=False))
    assert not _imports_torch(Namespace(training_script="nope_mod", module=True))


@pytest.mark.parametrize(
    ("code", "status"), [(None, 0), (0, 0), (3, 3), (256, 0), (-1, 255), ("bye", 1), (True, 1)]
)
def test_exit_code_is_the_interpreters(
    code: object, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(SystemExit(code)) == status
    if isinstance(code, str):
        assert capsys.readouterr().err == "bye\n"


def test_frames_carry_objects_and_fds() -> None:
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        job = FunctionJob(
            rank=0,
            fn=b"x" * (1 << 20),
            args=b"",
            error_file="",
            sys_argv=[],
            sys_path=[],
            orig_argv=[],
            supervisor_pid=1,
            process_name="w0",
        )
        big = Fork(job, ("result",), {"X": "1"}, "/", ())  # larger than the socket buffer
        import threading

        sender = threading.Thread(target=send, args=(a, big, [w]))
        sender.start()
        got = receive(b)
        sender.join()
        assert got is not None
        obj, fds = got
        assert obj == big and len(fds) == 1
        os.write(fds[0], b"!")
        assert os.read(r, 1) == b"!"
        os.close(fds[0])
        send(a, Later())
        assert receive(b) == (Later(), [])
        a.close()
        assert receive(b) is None  # EOF
    finally:
        b.close()
        os.close(r)
        os.close(w)


def test_the_decoder_takes_frames_in_any_pieces() -> None:
    msgs: list[Message] = [
        Spare(7),
        Forked(8),
        Exited(7, 256),
        Loaded("m", None, Provenance({"/m.py": (1, 2)}, {"X": None})),
        Refused("x"),
    ]
    stream = b"".join(bytes(encode(m)) for m in msgs)
    for step in (1, 3, 7, len(stream)):
        decoder = Decoder()
        got: list[Message] = []
        for i in range(0, len(stream), step):
            got += decoder.feed(stream[i : i + step])
        assert got == msgs


def test_env_reads_records_reads_by_name_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARM_R1", "one")
    monkeypatch.setenv("WARM_R2", "two")
    monkeypatch.delenv("WARM_ABSENT", raising=False)
    cls = type(os.environ)
    before = (cls.__getitem__, cls.__iter__)
    with EnvReads() as reads:
        assert os.environ["WARM_R1"] == "one"
        assert os.getenv("WARM_ABSENT") is None
        assert "WARM_R2" in os.environ
        everything = dict(os.environ.items())  # a module that looks at the whole environment
    assert everything["WARM_R1"] == "one"
    assert reads.seen == {"WARM_R1": "one", "WARM_ABSENT": None, "WARM_R2": "two"}
    assert (cls.__getitem__, cls.__iter__) == before  # restored
    assert os.environ["WARM_R1"] == "one"


def test_provenance_sees_a_changed_file_and_a_changed_variable(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("x = 1\n")
    st = os.stat(path)
    p = Provenance({str(path): (st.st_mtime_ns, st.st_size)}, {"A": "1", "B": None})
    assert p.changed_file() is None
    assert p.changed_variable({"A": "1"}) is None
    assert p.changed_variable({"A": "2"}) == "A"
    assert p.changed_variable({"A": "1", "B": "x"}) == "B"
    assert p.changed_variable({"A": "2"}, ignore=frozenset({"A"})) is None
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert p.changed_file() == str(path)
    path.unlink()
    assert p.changed_file() == str(path)
    both = p | Provenance({"/other.py": (1, 1)}, {"C": "3"})
    assert set(both.files) == {str(path), "/other.py"} and both.env["C"] == "3"


def test_module_files_are_outside_the_installation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "warm_prov_mod_91.py").write_text("y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    importlib.import_module("warm_prov_mod_91")
    try:
        files = module_files()
    finally:
        sys.modules.pop("warm_prov_mod_91", None)
    assert str(tmp_path / "warm_prov_mod_91.py") in files
    assert os.__file__ not in files and pytest.__file__ not in files  # stdlib, site-packages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@pytest.mark.parametrize("remap", [True, False], ids=["prctl", "in-place"])
def test_show_sets_what_proc_shows(remap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a forked child: with PR_SET_MM_MAP both; refused, the command line in place, cut."""
    from aiolaunch._child import _cmdline

    if not remap:
        monkeypatch.setattr(_cmdline, "_remap", lambda *a: False)
    with open(f"/proc/{os.getpid()}/environ", "rb") as f:
        before = f.read()
    said_r, said_w = os.pipe()  # child -> parent: show()'s answer
    done_r, done_w = os.pipe()  # parent -> child: /proc was read
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            ok = _cmdline.show(["python", "-u", "t.py", "x" * 100_000], {"RANK": "3"})
            os.write(said_w, b"1" if ok else b"0")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(said_r, 1) == (b"1" if remap else b"0")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
        for fd in (said_r, said_w, done_r, done_w):
            os.close(fd)
    assert cmdline.split(b"\0")[:3] == [b"python", b"-u", b"t.py"]
    if remap:
        assert cmdline == b"python\0-u\0t.py\0" + b"x" * 100_000 + b"\0"
        assert environ == b"RANK=3\0"
    else:
        assert environ == before  # the limit: where prctl is refused, the environment stays


WRITING = """
import os, subprocess, sys
from aiolaunch._child._forked import _writing_elsewhere

said = [_writing_elsewhere()]
r, w = os.pipe()  # a wake-up pipe: both ends ours
said.append(_writing_elsewhere())
os.makedirs(sys.argv[1] + "/stacks", exist_ok=True)
dump = open(sys.argv[1] + "/stacks/1.txt", "ab", buffering=0)  # the stack-dump file
said.append(_writing_elsewhere())
os.close(r)  # now only the write end: a reader elsewhere may wait for what it buffers
said.append(_writing_elsewhere())
os.close(w)
log = open(sys.argv[1] + "/log.txt", "w")
said.append(_writing_elsewhere())
print(said)
"""


def test_writing_elsewhere_is_what_a_file_object_may_buffer_for(tmp_path: Path) -> None:
    env = {**os.environ, "AIOLAUNCH_STACKS_DIR": str(tmp_path / "stacks")}
    out = subprocess.run(
        [sys.executable, "-c", WRITING, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
    ).stdout
    assert out == "[False, False, False, True, True]\n"
