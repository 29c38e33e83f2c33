"""aiolaunch awaited from a real Jupyter kernel (ipykernel), driven by jupyter_client.

Regression tests for #8: top-level ``await`` of ``start_processes``/``wait()``
in a cell, tee'd and un-redirected output reaching the cell (not the kernel's
terminal), and a kernel interrupt during ``await ctx.wait()``.

Each test starts its own kernel and shuts it down before it returns, so the
leak checker sees no leftover process. Interrupts go through the kernel
manager (``interrupt_kernel``: SIGINT to the kernel's own process group),
never to the test runner.
"""

from __future__ import annotations

import queue
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

if sys.platform == "win32":  # pragma: no cover
    pytest.skip("aiolaunch does not support Windows", allow_module_level=True)

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"
# Only to catch hangs: a cell here takes well under a second.
CELL_TIMEOUT = 60.0


@dataclass
class CellRun:
    status: str  # "ok" | "error"
    streams: list[tuple[str, str]] = field(default_factory=list)
    result: str | None = None
    ename: str | None = None
    evalue: str | None = None

    def text(self, name: str = "stdout") -> str:
        return "".join(t for n, t in self.streams if n == name)


class Kernel:
    """A real ipykernel, talked to over ZMQ like a notebook front end does."""

    def __init__(self, km: Any, kc: Any) -> None:
        self.km = km
        self.kc = kc

    async def run(self, code: str, *, interrupt_after: list[str] | None = None) -> CellRun:
        """Execute ``code``; interrupt the kernel once every ``interrupt_after`` text was seen."""
        msg_id = self.kc.execute(code)
        run = CellRun(status="?")
        waiting_for = list(interrupt_after or [])
        interrupted = False
        deadline = time.monotonic() + CELL_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"cell did not finish in {CELL_TIMEOUT}s; output so far: {run.streams}")
            try:
                msg = await self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                run.streams.append((content["name"], content["text"]))
                if interrupt_after and not interrupted:
                    seen = run.text("stdout")
                    if all(w in seen for w in waiting_for):
                        interrupted = True
                        await self.km.interrupt_kernel()
            elif kind == "execute_result":
                run.result = content["data"]["text/plain"]
            elif kind == "error":
                run.ename, run.evalue = content["ename"], content["evalue"]
            elif kind == "status" and content["execution_state"] == "idle":
                break
        while True:  # skip replies to earlier requests (kernel_info from wait_for_ready)
            reply = await self.kc.get_shell_msg(timeout=CELL_TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        run.status = reply["content"]["status"]
        if interrupt_after:
            assert interrupted, f"never saw {waiting_for} in {run.streams}"
        return run

    async def ok(self, code: str) -> CellRun:
        run = await self.run(code)
        assert run.status == "ok", f"{run.ename}: {run.evalue}\n{run.streams}"
        return run


@pytest.fixture(autouse=True)
def _restore_sigint() -> Iterator[None]:
    """Give pytest its SIGINT handler back (SIG_IGN in a background job).

    Kernel managers and nbclient may install their own; the leak check would
    report the change and a later Ctrl-C would not reach pytest.
    """
    before = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
async def kernel(tmp_path: Path) -> AsyncIterator[Kernel]:
    km = jupyter_client.AsyncKernelManager(kernel_name="python3")
    await km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=CELL_TIMEOUT)
        yield Kernel(km, kc)
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=False)
        await km.cleanup_resources()


def _cell_outputs(nb: Any, tag: str) -> tuple[str, str | None]:
    """(stdout text, text/plain result) of the code cell tagged ``tag``."""
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}"
    text, result = "", None
    for out in cells[0].outputs:
        if out.output_type == "stream" and out.name == "stdout":
            text += out.text
        elif out.output_type == "execute_result":
            result = out.data["text/plain"]
        elif out.output_type == "error":
            pytest.fail(f"cell {tag!r} raised {out.ename}: {out.evalue}")
    return text, result


async def test_example_notebook_executes(tmp_path: Path) -> None:
    """examples/notebook.ipynb runs top to bottom; every cell shows what its text promises."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=int(CELL_TIMEOUT),
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    await client.async_execute()

    tee, result = _cell_outputs(nb, "tee")
    for rank, tag in ((0, "alpha"), (1, "beta")):
        for step in range(3):
            assert f"[train{rank}]:{tag}: step {step}\n" in tee
    assert result == "{0: {'rank': 0, 'steps': 3}, 1: {'rank': 1, 'steps': 3}}"

    logs, _ = _cell_outputs(nb, "logs")
    assert logs == "beta: step 0\nbeta: step 1\nbeta: step 2\n"

    plain, result = _cell_outputs(nb, "plain")
    assert plain == "gamma: step 0\ngamma: step 1\n"  # unprefixed, in the cell
    assert result == "{0: {'rank': 0, 'steps': 2}}"

    failure, _ = _cell_outputs(nb, "failure")
    assert failure.startswith("failed=True rank=1 exitcode=1\n")
    assert "ValueError: batch 1 is corrupt" in failure


async def test_unredirected_output_reaches_the_cell(kernel: Kernel) -> None:
    """Std.NONE: the kernel's sys.stdout is not fd 1, so worker output is carried to it.

    Covers Python prints, fd-level writes (as C extensions do) and binary workers,
    on both streams, including a last line without a newline.
    """
    await kernel.ok("import sys, aiolaunch")
    run = await kernel.ok(
        """
def speak(rank):
    import os, sys
    print(f"py-out {rank}", flush=True)
    print(f"py-err {rank}", file=sys.stderr, flush=True)
    os.write(1, f"fd-out {rank}\\n".encode())
    os.write(2, f"fd-err {rank}".encode())  # no newline
    return rank

ctx = await aiolaunch.start_processes(
    name="speak", entrypoint=speak, args={0: (0,), 1: (1,)}, envs={0: {}, 1: {}}
)
print((await ctx.wait()).return_values)
"""
    )
    out, err = run.text("stdout"), run.text("stderr")
    # Not redirected means not framed: like two processes sharing a terminal,
    # the lines of two workers may interleave (see the report of #8).
    for rank in (0, 1):
        for text in (f"py-out {rank}", f"fd-out {rank}"):
            assert text in out
            assert text not in err
        for text in (f"py-err {rank}", f"fd-err {rank}"):
            assert text in err
            assert text not in out
    assert "{0: 0, 1: 1}" in out

    run = await kernel.ok(
        """
ctx = await aiolaunch.start_processes(
    name="bin", entrypoint=sys.executable,
    args={0: ("-c", "import sys; print('bin-out'); print('bin-err', file=sys.stderr)")},
    envs={0: {}},
)
print((await ctx.wait()).return_values)
"""
    )
    assert run.text("stdout") == "bin-out\n{0: None}\n"
    assert run.text("stderr") == "bin-err\n"


# Workers that need an interrupt to stop: they say when they are ready, and say
# goodbye from a `finally` - which only a graceful stop (not SIGKILL) runs.
_PATIENT = """
import asyncio, os, signal, time
import aiolaunch

def patient(rank):
    try:
        print(f"ready {rank}", flush=True)
        time.sleep(60)
    finally:
        print(f"cleanup {rank}", flush=True)

def handlers():
    loop = asyncio.get_running_loop()
    return signal.getsignal(signal.SIGINT), sorted(getattr(loop, "_signal_handlers", {}))

def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
"""

_INTERRUPTED_CELL = """
before = handlers()
ctx = await aiolaunch.start_processes(
    name="p", entrypoint=patient, args={0: (0,), 1: (1,)}, envs={0: {}, 1: {}},
    tee=aiolaunch.Std.OUT, shutdown_timeout=20,
)
t0 = time.monotonic()
try:
    await ctx.wait()
except BaseException as exc:
    caught = exc
else:
    caught = None
took = time.monotonic() - t0
after = handlers()
print("caught", [c.__name__ for c in type(caught).__mro__], caught.sigval.name)
raise caught
"""


async def test_interrupt_stops_workers_and_kernel_stays_usable(kernel: Kernel) -> None:
    await kernel.ok(_PATIENT)
    run = await kernel.run(_INTERRUPTED_CELL, interrupt_after=["[p0]:ready 0", "[p1]:ready 1"])

    # The cell ends with SignalException(sigval=SIGINT), an Exception - not a
    # KeyboardInterrupt: asyncio lets a KeyboardInterrupt raised in a task escape
    # the event loop, which would break wait() running in a background task of
    # an orchestrator. (ipykernel itself ends an interrupted async cell with
    # CancelledError, not KeyboardInterrupt.)
    assert run.status == "error"
    assert run.ename == "SignalException", run.ename
    out = run.text("stdout")
    assert "caught ['SignalException', 'Exception', 'BaseException', 'object'] SIGINT\n" in out
    # Graceful: each worker got the forwarded SIGINT and ran its `finally`.
    assert "[p0]:cleanup 0\n" in out
    assert "[p1]:cleanup 1\n" in out

    check = await kernel.ok(
        """
print(after == before, after[1], took < 10)
print(all(gone(pid) for pid in ctx.pids().values()), ctx)
"""
    )
    lines = check.text().splitlines()
    # The kernel's own SIGINT handler is back; no handler left on its loop.
    assert lines[0] == "True [] True", lines
    assert lines[1].startswith("True <MultiprocessContext name='p'"), lines

    # A second run in the same kernel works, interrupts included.
    again = await kernel.ok(
        """
def double(x):
    return 2 * x
ctx = await aiolaunch.start_processes(
    name="d", entrypoint=double, args={0: (1,), 1: (2,)}, envs={0: {}, 1: {}},
    tee=aiolaunch.Std.ALL,
)
(await ctx.wait()).return_values
"""
    )
    assert again.result == "{0: 2, 1: 4}"
    run = await kernel.run(_INTERRUPTED_CELL, interrupt_after=["[p0]:ready 0", "[p1]:ready 1"])
    assert run.status == "error"
    assert "[p0]:cleanup 0\n" in run.text()
    assert "[p1]:cleanup 1\n" in run.text()
    # And plain Python keeps running after it.
    assert (await kernel.ok("6 * 7")).result == "42"


def test_example_notebook_is_clean() -> None:
    """The notebook is valid nbformat and every test-tagged cell exists exactly once."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    tags = [t for c in nb.cells for t in c.get("metadata", {}).get("tags", [])]
    assert sorted(tags) == sorted(set(tags))
    assert {"tee", "logs", "plain", "failure"} <= set(tags)
    # Shipped without outputs: the test (and CI) are the only place it runs.
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
