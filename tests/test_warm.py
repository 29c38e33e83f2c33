"""Warm start: a worker forked from the zygote behaves as a spawned one (no torch needed).

Every behaviour test runs twice, ``spawned`` (``preload=None``) and
``forked`` (``preload=["json"]``: a zygote that imported a stdlib module),
with the same assertions: argv, ``__main__``, environment, stdio, signal
dispositions, exit statuses, tracebacks, error files and ``@record``, logs,
process groups. Then what only a zygote has: its death mid-run, a preload
that fails, a zygote that is no longer safe to fork, a load-time variable
that differs, and the supervisor's SIGKILL taking everything along.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from _helpers import alive, driver, wait_dead
from _programs import write_script
from aiolaunch import Std
from aiolaunch._warm._preload import Preload
from aiolaunch._warm._zygote import close_zygotes, zygote_for

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="warm start is Linux-only"
)

MODES = ["spawned", "forked"]
JSON = Preload(("json",))
BOOT = ["-u", "-m", "aiolaunch._child._bootstrap"]

PROBE = r"""
import ctypes, gc, json, os, signal, sys, threading

def disposition(sig):
    h = signal.getsignal(sig)
    return {signal.SIG_DFL: "DFL", signal.SIG_IGN: "IGN",
            signal.default_int_handler: "INT"}.get(h, repr(h))

def stream(s):
    return {k: getattr(s, k, None) for k in
            ("encoding", "errors", "line_buffering", "write_through", "name", "mode")}

libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
report = {
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "name": __name__,
    "file": __file__,
    "main_is_module": sys.modules["__main__"].__dict__ is globals(),
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "env_x": os.environ.get("X"),
    "c_env_x": (libc.getenv(b"X") or b"").decode(),
    "c_env_absent": libc.getenv(b"WARM_TEST_UNSET") is None,
    "error_file_env": "TORCHELASTIC_ERROR_FILE" in os.environ,
    "stdout": stream(sys.stdout),
    "stderr": stream(sys.stderr),
    "stdin_fd": sys.stdin.fileno() if sys.stdin else None,
    "signals": {signal.Signals(s).name: disposition(s) for s in
                (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE,
                 signal.SIGXFSZ, signal.SIGCHLD, signal.SIGUSR1)},
    "threads": threading.active_count(),
    "leader": os.getpgid(0) == os.getpid() and os.getsid(0) == os.getpid(),
    "gc": gc.isenabled(),
    "flags_u": sys.flags.dont_write_bytecode,
}
print(json.dumps(report))
print("to stderr", file=sys.stderr)
"""


def preload(mode: str) -> list[str] | None:
    return ["json"] if mode == "forked" else None


def expected_signals() -> dict[str, str]:
    """What a fresh ``python`` started by Popen(restore_signals=True) from here has."""
    out = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
        ignored = signal.getsignal(sig) is signal.SIG_IGN
        if sig in (signal.SIGPIPE, signal.SIGXFSZ):
            out[sig.name] = "IGN"  # Python ignores them at start-up
        elif ignored:
            out[sig.name] = "IGN"  # exec keeps SIG_IGN (nohup)
        else:
            out[sig.name] = "INT" if sig == signal.SIGINT else "DFL"
    out["SIGCHLD"] = out["SIGUSR1"] = "DFL"
    return out


async def run_python(
    mode: str, tmp_path: Path, args: dict[int, tuple[str, ...]], **kw: Any
) -> tuple[aiolaunch.RunProcsResult, dict[int, int]]:
    ctx = await aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args=args,
        envs=kw.pop("envs", {r: {"X": "1"} for r in args}),
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
        preload=preload(mode),
        **kw,
    )
    async with ctx:
        pids = ctx.pids()
        result = await ctx.wait()
    assert result is not None
    return result, pids


@pytest.mark.parametrize("mode", MODES)
async def test_script_worker_is_what_python_makes(mode: str, tmp_path: Path) -> None:
    script = write_script(tmp_path, "probe.py", PROBE)
    result, _ = await run_python(mode, tmp_path, {0: (*BOOT, str(script), "a", "b c")})
    assert not result.is_failed(), result.failures
    out = (tmp_path / "logs/0/stdout.log").read_text()
    report = json.loads(out)
    assert report["argv"] == [str(script), "a", "b c"]
    assert report["orig_argv"] == [sys.executable, *BOOT, str(script), "a", "b c"]
    assert report["name"] == "__main__" and report["file"] == str(script)
    assert report["main_is_module"]
    assert report["path0"] == str(tmp_path)
    assert report["cwd"] == os.getcwd()
    assert report["env_x"] == report["c_env_x"] == "1" and report["c_env_absent"]
    assert report["error_file_env"]
    fresh = fresh_stdio(tmp_path)
    assert report["stdout"] == fresh["stdout"]
    assert report["stderr"] == fresh["stderr"]
    assert report["stdout"]["write_through"] and not report["stdout"]["line_buffering"]  # -u
    assert report["signals"] == expected_signals()
    assert report["threads"] == 1
    assert report["leader"]  # its own session and group, as start_new_session=True
    assert report["gc"]
    assert (tmp_path / "logs/0/stderr.log").read_text() == "to stderr\n"


def fresh_stdio(tmp_path: Path) -> dict[str, Any]:
    """sys.stdout/stderr of a fresh ``python -u`` writing to files, as the spawned worker's."""
    code = (
        "import json, sys; print(json.dumps({n: {k: getattr(getattr(sys, n), k) for k in "
        "('encoding', 'errors', 'line_buffering', 'write_through', 'name', 'mode')} "
        "for n in ('stdout', 'stderr')}))"
    )
    out, err = tmp_path / "fresh.out", tmp_path / "fresh.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        subprocess.run([sys.executable, "-u", "-c", code], stdout=o, stderr=e, check=True)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


@pytest.mark.parametrize("mode", MODES)
async def test_who_is_the_parent(mode: str, tmp_path: Path) -> None:
    code = "import os; print(os.getppid())"
    result, _ = await run_python(mode, tmp_path, {0: ("-u", "-c", code), 1: ("-u", "-m", "this")})
    assert not result.is_failed()
    # -c is not forked (its argv is not a script or module): always spawned
    assert int((tmp_path / "logs/0/stdout.log").read_text()) == os.getpid()
    assert "Zen of Python" in (tmp_path / "logs/1/stdout.log").read_text()


JOINER = """
import ctypes, os, sys, time

libc = ctypes.CDLL(None)  # its calls release the GIL
held = ctypes.PyDLL(None)  # its calls keep it, as a C++ destructor run by a dealloc does
r, w = os.pipe()
ns = {"libc": libc, "ctypes": ctypes, "r": r}  # not __main__'s: the GC can free that one
exec("def body(_):\\n    libc.read(r, ctypes.create_string_buffer(1), 1)\\n", ns)
ns["body"] = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(ns["body"])
tid = ctypes.c_ulong()
libc.pthread_create(ctypes.byref(tid), None, ns["body"], None)
time.sleep(0.2)  # the thread waits in read(), without the GIL


class Joiner:
    def __init__(self):  # what __del__ uses: __main__'s names may be gone by then
        self.held, self.w, self.tid, self.write = held, w, tid, os.write

    def __del__(self):
        self.held.write(self.w, b"x", 1)  # the thread wakes and needs the GIL to return
        self.held.pthread_join(self.tid, None)
        self.write(1, b"joined\\n")


joiner = Joiner()
f = open(sys.argv[1], "w")
f.write("unflushed")
"""

EXITS = {
    "sys.exit(3)": ("import sys; sys.exit(3)", 3, ""),
    "sys.exit(msg)": ("import sys; sys.exit('bye now')", 1, "bye now\n"),
    "exception": ("def f():\n    raise ValueError('boom')\nf()", 1, "ValueError: boom\n"),
    "SIGTERM": ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15, ""),
    "os._exit": ("import os; print('x', flush=True); os._exit(7)", 7, ""),
    "SIGINT caught": (
        "import os, signal, sys\ntry:\n    os.kill(os.getpid(), signal.SIGINT)\n"
        "    import time; time.sleep(2)\nexcept KeyboardInterrupt:\n    sys.exit(5)",
        5,
        "",
    ),
    "SIGINT": (
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(2)",
        -2,
        "KeyboardInterrupt\n",
    ),
    "atexit": (
        "import atexit, sys\natexit.register(lambda: print('atexit ran', flush=True))\n"
        "f = open(sys.argv[1], 'w')\nf.write('unflushed')",
        0,
        "",
    ),
    # torch's DDP at exit: the Reducer's dealloc destroys a ProcessGroupGloo, whose
    # destructor joins its threads with the GIL held while one of them needs the GIL
    # to drop a finished work's tensors (pytorch#56297). python ends such a thread
    # once its exit has begun (for torch's: an abort, now and then); a forked
    # worker destroys nothing while a thread Python did not start runs, and
    # flushes __main__'s files.
    "a destructor joins a thread that needs the GIL": (JOINER, 0, ""),
    "__del__ at exit": (
        "import os\nclass C:\n    def __del__(self, write=os.write):\n        write(1, b'finalized')\nc = C()",
        0,
        "",
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(EXITS))
async def test_exit_status_and_traceback(mode: str, case: str, tmp_path: Path) -> None:
    code, status, err_tail = EXITS[case]
    if case.startswith("SIGINT") and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # The suite runs as a background job (or under nohup -i): SIGINT is
        # ignored here, so a fresh python - and a warm worker, which must be
        # what python makes - keeps ignoring it and runs to the end.
        status, err_tail = 0, ""
    script = write_script(tmp_path, "exit.py", code)
    out_file = tmp_path / "left_open.txt"
    result, _ = await run_python(mode, tmp_path, {0: (*BOOT, str(script), str(out_file))})
    rc = result.failures[0].exitcode if result.is_failed() else 0
    assert rc == status
    err = (tmp_path / "logs/0/stderr.log").read_text()
    assert err.endswith(err_tail)
    if case == "exception":
        assert err.startswith("Traceback (most recent call last):\n")
        assert "_bootstrap" not in err and "_forked" not in err and "_zygote" not in err
        assert f'File "{script}", line 3, in <module>' in err
    if case == "atexit":
        assert (tmp_path / "logs/0/stdout.log").read_text() == "atexit ran\n"
        assert out_file.read_text() == "unflushed"  # __main__'s objects are finalized
    if case == "__del__ at exit":  # no thread Python did not start: __main__ is cleared
        assert (tmp_path / "logs/0/stdout.log").read_text() == "finalized"
    if case.startswith("a destructor joins"):
        joined = (tmp_path / "logs/0/stdout.log").read_text()
        assert joined == ("joined\n" if mode == "spawned" else "")
        assert out_file.read_text() == "unflushed"


RECORD = """
import aiolaunch

@aiolaunch.record
def main():
    raise KeyError("no such key")

main()
"""


@pytest.mark.parametrize("mode", MODES)
async def test_record_writes_the_error_file(mode: str, tmp_path: Path) -> None:
    script = write_script(tmp_path, "rec.py", RECORD)
    result, _ = await run_python(mode, tmp_path, {0: (*BOOT, str(script))})
    failure = result.failures[0]
    assert failure.exitcode == 1
    message = failure.error_file_data["message"]
    assert message["message"] == "KeyError: 'no such key'"
    assert "rec.py" in message["extraInfo"]["py_callstack"]


def fn_report(tag: str) -> dict[str, Any]:
    import multiprocessing

    return {
        "tag": tag,
        "x": os.environ.get("X"),
        "leader": os.getpgid(0) == os.getpid(),
        "name": multiprocessing.current_process().name,
        "argv": sys.argv,
    }


def fn_fail() -> None:
    raise RuntimeError("function failed")


@pytest.mark.parametrize("mode", MODES)
async def test_function_worker(mode: str, tmp_path: Path) -> None:
    async with aiolaunch.start_processes(
        name="fn",
        entrypoint=fn_report,
        args={0: ("a",), 1: ("b",)},
        envs={0: {"X": "0"}, 1: {"X": "1"}},
        log_dir=str(tmp_path / "a"),
        preload=preload(mode),
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    for r, tag in ((0, "a"), (1, "b")):
        value = result.return_values[r]
        assert value["tag"] == tag and value["x"] == str(r) and value["leader"]
        assert value["name"] == f"fn{r}" and value["argv"] == sys.argv
    async with aiolaunch.start_processes(
        name="fn",
        entrypoint=fn_fail,
        args={0: ()},
        envs={0: {}},
        log_dir=str(tmp_path / "b"),
        redirects=Std.ALL,
        preload=preload(mode),
    ) as ctx:
        result = await ctx.wait()
    assert result is not None
    assert result.failures[0].error_file_data["message"]["message"] == (
        "RuntimeError: function failed"
    )
    assert "function failed" in (tmp_path / "b/0/stderr.log").read_text()


POOL = """
import multiprocessing, os, sys

def square(x):
    return x * x

if __name__ == "__main__":
    with multiprocessing.get_context("fork").Pool(2) as pool:
        print(sum(pool.map(square, range(10))))
    pid = os.fork()
    if pid == 0:
        print("grandchild", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


@pytest.mark.parametrize("mode", MODES)
async def test_a_worker_that_forks_its_own_children(mode: str, tmp_path: Path) -> None:
    script = write_script(tmp_path, "pool.py", POOL)
    result, _ = await run_python(mode, tmp_path, {0: (*BOOT, str(script))})
    assert not result.is_failed(), (tmp_path / "logs/0/stderr.log").read_text()
    assert (tmp_path / "logs/0/stdout.log").read_text() == "285\ngrandchild\n"


@pytest.mark.parametrize("mode", MODES)
async def test_sigterm_from_close_stops_it(mode: str, tmp_path: Path) -> None:
    script = write_script(
        tmp_path, "wait.py", "import time\nprint('up', flush=True)\ntime.sleep(60)"
    )
    ctx = await aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args={0: (*BOOT, str(script))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
        preload=preload(mode),
        ready=aiolaunch.ReadyLine("up"),
    )
    async with ctx:
        await ctx.wait_ready(timeout=60)
        pid = ctx.pids()[0]
        await ctx.close(timeout=10)
    assert not alive(pid)


STUCK = """
import time

def stuck_in_here():
    print("up", flush=True)
    time.sleep(60)

stuck_in_here()
"""


@pytest.mark.parametrize("mode", MODES)
async def test_stacks_of_a_worker(mode: str, tmp_path: Path) -> None:
    script = write_script(tmp_path, "stuck.py", STUCK)
    ctx = await aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args={0: (*BOOT, str(script))},
        envs={0: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
        preload=preload(mode),
        ready=aiolaunch.ReadyLine("up"),
    )
    async with ctx:
        await ctx.wait_ready(timeout=60)
        stacks = await ctx.dump_stacks(timeout=30)
    assert "stuck_in_here" in stacks[0], stacks[0]


# -- what only a zygote has ------------------------------------------------------
HOLD = """
import os, sys, time
print("up", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
sys.exit(int(sys.argv[2]))
"""


async def test_zygote_killed_mid_run_takes_nothing_along(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiolaunch")
    script = write_script(tmp_path, "hold.py", HOLD)
    go = tmp_path / "go"
    ctx = await aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args={0: (*BOOT, str(script), str(go), "0"), 1: (*BOOT, str(script), str(go), "4")},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path / "a"),
        redirects=Std.ALL,
        preload=["json"],
        ready=aiolaunch.ReadyLine("up"),
    )
    async with ctx:
        await ctx.wait_ready(timeout=60)
        pids = ctx.pids()
        z = zygote_for(JSON)
        assert z is not None and z.state == "ready"
        zpid = z.pid
        os.kill(zpid, signal.SIGKILL)
        wait_dead(zpid)
        assert all(alive(p) for p in pids.values())  # the workers run on
        go.touch()
        result = await ctx.wait()
    assert result is not None
    assert list(result.failures) == [1] and result.failures[1].exitcode == 4  # self-reported
    assert "died" in caplog.text
    # The next call finds it dead: its workers start the ordinary way (children
    # of this process), while a new zygote starts for later calls.
    code = "import os; print(os.getppid())"
    pp = write_script(tmp_path, "pp.py", code)
    await run_python("forked", tmp_path / "b", {0: (*BOOT, str(pp))})
    assert int((tmp_path / "b/logs/0/stdout.log").read_text()) == os.getpid()
    z2 = zygote_for(JSON)
    assert z2 is not None and z2.pid != zpid
    assert await z2.ready(wait=True)  # the replacement serves the calls after that


async def test_a_preload_that_fails_to_import_names_it_before_any_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, "warm_broken_mod.py", "import no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)  # the zygote finds the module in its current folder
    marker = tmp_path / "ran"
    with pytest.raises(ImportError, match=r"(?s)'warm_broken_mod'.*no_such_dependency_xyz") as info:
        await aiolaunch.start_processes(
            name="w",
            entrypoint=sys.executable,
            args={0: (*BOOT, str(write_script(tmp_path, "t.py", f"open({str(marker)!r}, 'w')")))},
            envs={0: {}},
            log_dir=str(tmp_path / "logs"),
            preload=["warm_broken_mod"],
        )
    assert info.value.name == "warm_broken_mod"
    assert "--no-preload" in str(info.value)
    assert not marker.exists()  # no worker ran


def test_bad_preload_arguments_raise_before_anything() -> None:
    for bad, exc, words in (
        ("torch", TypeError, "list of module names"),
        ([3], ValueError, "not a module name"),
        (["no_such_module_xyz"], ValueError, "no module named 'no_such_module_xyz'"),
        (["a..b"], ValueError, "not a module name"),
    ):
        with pytest.raises(exc, match=words):
            aiolaunch.start_processes(
                name="w",
                entrypoint=sys.executable,
                args={0: ()},
                envs={0: {}},
                preload=bad,  # type: ignore[arg-type]
            )


THREAD_AT_IMPORT = """
import threading, time
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
"""


async def test_a_zygote_no_longer_safe_to_fork_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiolaunch")
    write_script(tmp_path, "warm_threaded_mod.py", THREAD_AT_IMPORT)
    monkeypatch.chdir(tmp_path)
    code = "import os, sys; print(os.getppid(), 'warm_threaded_mod' in sys.modules)"
    script = write_script(tmp_path, "pp.py", code)
    ctx = await aiolaunch.start_processes(
        name="w",
        entrypoint=sys.executable,
        args={0: (*BOOT, str(script)), 1: (*BOOT, str(script))},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path / "logs"),
        redirects=Std.ALL,
        preload=["warm_threaded_mod"],
    )
    async with ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    for r in (0, 1):  # started the ordinary way: children of this process
        assert (tmp_path / f"logs/{r}/stdout.log").read_text() == f"{os.getpid()} False\n"
    warnings = [
        r.getMessage() for r in caplog.records if "threads run in the zygote" in r.getMessage()
    ]
    assert len(warnings) == 1 and "ordinary way" in warnings[0]


async def test_a_load_time_variable_that_differs_falls_back_for_that_rank(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiolaunch")
    script = write_script(
        tmp_path, "pp.py", "import os; print(os.getppid(), os.environ.get('OMP_NUM_THREADS'))"
    )
    envs = {0: {"OMP_NUM_THREADS": "1"}, 1: {"OMP_NUM_THREADS": "1"}, 2: {"OMP_NUM_THREADS": "3"}}
    result, _ = await run_python(
        "forked", tmp_path, {r: (*BOOT, str(script)) for r in range(3)}, envs=envs
    )
    assert not result.is_failed()
    lines = [(tmp_path / f"logs/{r}/stdout.log").read_text().split() for r in range(3)]
    assert [v for _, v in lines] == ["1", "1", "3"]
    assert int(lines[0][0]) != os.getpid() and lines[0][0] == lines[1][0]  # forked
    assert int(lines[2][0]) == os.getpid()  # rank 2's OMP_NUM_THREADS differs: spawned
    assert "OMP_NUM_THREADS='3'" in caplog.text and "rank 2" in caplog.text


SUPERVISOR = """
import asyncio, os, sys
import aiolaunch

async def main():
    ctx = await aiolaunch.start_processes(
        name="w", entrypoint=sys.executable,
        args={r: ("-u", "-m", "aiolaunch._child._bootstrap", sys.argv[1]) for r in range(2)},
        envs={0: {}, 1: {}}, preload=["json"], ready=aiolaunch.ReadyLine("up"),
    )
    fn = await aiolaunch.start_processes(
        name="f", entrypoint=sorted, args={0: ((2, 1),)}, envs={0: {}}, preload=["json"],
    )
    await ctx.wait_ready(timeout=60)
    z = next(iter(aiolaunch._warm._zygote._ZYGOTES.get().values()))
    for _ in range(500):  # the zygote forks spares once idle
        if z.spares:
            break
        await asyncio.sleep(0.01)
    line = " ".join(map(str, ["pids", z.pid, *ctx.pids().values(), *z.spares]))
    os.write(1, (line + chr(10)).encode())  # one write: nothing else can get in between
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_sigkilled_supervisor_takes_its_zygote_and_workers_along(tmp_path: Path) -> None:
    worker = write_script(
        tmp_path, "w.py", "import time\nprint('up', flush=True)\ntime.sleep(3600)"
    )
    sup = write_script(tmp_path, "sup.py", SUPERVISOR)
    with driver([sys.executable, str(sup), str(worker)]) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("pids"):
                break
        else:
            pytest.fail(f"the supervisor ended early: {proc.communicate(timeout=30)[1]}")
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) >= 4 and all(alive(p) for p in pids), line  # zygote, 2 workers, spares
        proc.kill()
        proc.wait()
        assert not wait_dead(pids)


def test_cli_preload_flags(tmp_path: Path) -> None:
    script = write_script(
        tmp_path, "s.py", "import os, sys; print('json' in sys.modules, os.getppid())"
    )
    base = [sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2", "--tee", "3"]
    with driver([*base, "--preload", "json", str(script)]) as proc:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    ppids = {line.split()[-1] for line in out.splitlines()}
    assert len(ppids) == 1 and str(proc.pid) not in ppids  # both forked, from the zygote
    with driver([*base, "--no-preload", str(script)]) as proc:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert {line.split()[-1] for line in out.splitlines()} == {str(proc.pid)}
    for flags, words in (
        (["--preload", "json", "--no-preload"], "contradict"),
        (["--preload", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
        (["--preload", "json", "--no-python"], "needs a Python script"),
    ):
        with driver([*base, *flags, str(script)]) as proc:
            _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and words in err, err


def test_cli_preload_of_a_module_beside_the_script(tmp_path: Path) -> None:
    # `python proj/train.py` imports proj/cfgmod.py (the script's folder is
    # sys.path[0]): --preload cfgmod finds it there too, from another folder.
    proj = tmp_path / "proj"
    proj.mkdir()
    imports = tmp_path / "imports"
    write_script(
        proj, "cfgmod.py", f"import os\nopen({str(imports)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
    )
    write_script(
        proj,
        "train.py",
        "import os, sys\nprint('cfgmod' in sys.modules, os.getppid(), flush=True)\n",
    )
    argv = [sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2", "--tee", "3"]
    with driver([*argv, "--preload", "cfgmod", "proj/train.py"], cwd=tmp_path) as proc:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "install it" not in err
    rows = [line.split(":", 1)[1].split() for line in out.splitlines() if ":" in line]
    assert len(rows) == 2 and all(preloaded == "True" for preloaded, _ in rows), out
    assert len({ppid for _, ppid in rows}) == 1 and rows[0][1] != str(proc.pid)  # one zygote
    assert len(imports.read_text().split()) == 1  # imported once, by that zygote


def test_cli_preload_of_a_module_nowhere_names_both_places(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    write_script(proj, "train.py", "pass\n")
    argv = [sys.executable, "-m", "aiolaunch", "--preload", "cfgmod_nowhere", "proj/train.py"]
    with driver(argv, cwd=tmp_path) as proc:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert f"no module named 'cfgmod_nowhere' is installed, nor in {proj}" in err


AGENT_RESTART = """
import os, sys, time
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
print("up", attempt, rank, os.getpid(), os.getppid(), flush=True)
if attempt == "0":
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    if rank == "1":
        sys.exit(1)
    time.sleep(60)
"""


def test_cli_zygote_killed_mid_run_the_next_attempt_still_starts(tmp_path: Path) -> None:
    script = write_script(tmp_path, "s.py", AGENT_RESTART)
    go = tmp_path / "go"
    argv = [sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2", "--max-restarts", "1"]
    with driver([*argv, "--tee", "3", "--preload", "json", str(script), str(go)]) as proc:
        assert proc.stdout is not None
        first: list[list[str]] = []
        for line in proc.stdout:
            if ":up 0 " in line:
                first.append(line.split(":", 1)[1].split())
                if len(first) == 2:
                    break
        zygote = {int(f[4]) for f in first}
        assert len(zygote) == 1 and proc.pid not in zygote  # both forked, from one zygote
        (zpid,) = zygote
        os.kill(zpid, signal.SIGKILL)
        assert not wait_dead(zpid)
        assert all(alive(int(f[3])) for f in first)  # its workers run on
        go.touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    again = [line.split(":", 1)[1].split() for line in out.splitlines() if ":up 1 " in line]
    assert len(again) == 2
    # the ordinary way (children of the agent) or from a new zygote, never the dead one
    assert all(int(f[4]) != zpid for f in again)
    assert not wait_dead([int(f[3]) for f in first])


def test_cli_run_path_function_workers_fork_too(tmp_path: Path) -> None:
    script = write_script(
        tmp_path, "s.py", "import os, sys; print('json' in sys.modules, os.getppid(), flush=True)"
    )
    argv = [sys.executable, "-m", "aiolaunch", "--nproc-per-node", "2", "--tee", "3"]
    with driver([*argv, "--run-path", "--preload", "json", str(script)]) as proc:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    lines = [line.split(":", 1)[1].split() for line in out.splitlines() if ":" in line]
    assert len(lines) == 2 and all(w == "True" and int(p) != proc.pid for w, p in lines)


def test_cli_preload_that_fails_exits_2_before_any_worker(tmp_path: Path) -> None:
    write_script(tmp_path, "warm_broken_cli.py", "raise RuntimeError('broken at import')\n")
    marker = tmp_path / "ran"
    script = write_script(tmp_path, "s.py", f"open({str(marker)!r}, 'w')")
    argv = [sys.executable, "-m", "aiolaunch", "--preload", "warm_broken_cli", str(script)]
    with driver(argv, cwd=str(tmp_path)) as proc:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "warm_broken_cli" in err and "broken at import" in err
    assert not marker.exists()


@pytest.fixture(autouse=True)
def _fresh_zygotes() -> Any:
    """Each test gets its own zygotes (a test may kill or poison one)."""
    yield
    close_zygotes()
