"""The live view tells the truth (issue #46): output age with an inherited console.

A rank whose streams the supervisor does not read (torchrun's default: the
worker writes the console itself) still has an output age in ``/metrics``,
``aiolaunch status`` and ``top``'s OUTPUT column, from its first look on:
the kernel's count of its written bytes, read by the group's output clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from typing import TYPE_CHECKING, Any

import pytest

from _helpers import driver
from aiolaunch._hangs._writes import FRESH_S, WriteCount

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

# Rank 0 prints one line and goes quiet, rank 1 prints every 0.2 s, rank 2
# never writes anything.
BANNER_THEN_QUIET = textwrap.dedent(
    """
    import os, sys, time
    rank = int(os.environ["LOCAL_RANK"])
    if rank == 0:
        print("rank 0 up", flush=True)
    while True:
        if rank == 1:
            print("rank 1 step", flush=True)
        time.sleep(0.2)
    """
)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "aiolaunch", *args]


def _until(what: str, check: Callable[[], object], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)  # allowed: polling another process's output
    return got


def _ages(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == "aiolaunch_worker_last_output_age_seconds":
            return {s.labels["rank"]: s.value for s in family.samples}
    return {}


def test_output_age_of_an_inherited_console_from_the_first_scrape(tmp_path: Path) -> None:
    from aiolaunch import free_port

    script = tmp_path / "job.py"
    script.write_text(BANNER_THEN_QUIET)
    console = tmp_path / "console.txt"  # not a terminal: the workers write it themselves
    logs = tmp_path / "logs"
    port = free_port("127.0.0.1")
    argv = _cli("--nproc-per-node", "3", "--log-dir", str(logs), "--metrics-port", str(port),
                str(script))  # fmt: skip
    with console.open("w") as out, driver(argv, stdout=out.fileno()) as job:
        _until("rank 0's banner", lambda: "rank 0 up" in console.read_text())
        banner = time.monotonic()
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        # Looked at first past the time a fresh process's writes count at
        # once: only a clock that kept reading since the start knows the age.
        time.sleep(FRESH_S + 1 - (time.monotonic() - banner))  # allowed: the age to measure
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            ages = _ages(r.read().decode())
        seen = time.monotonic() - banner
        assert set(ages) == {"0", "1"}, ages  # rank 2 never wrote: no sample
        assert 2.0 <= ages["0"] <= seen + 0.5, (ages, seen)  # quiet since its banner
        assert ages["1"] < 2.0, ages  # prints every 0.2 s
        status = subprocess.run(_cli("status", str(logs), "--json"), capture_output=True,
                                text=True, timeout=60, check=True)  # fmt: skip
        rows = {w["rank"]: w["last_output_s"] for w in json.loads(status.stdout)["workers"]}
        assert rows[2] is None and rows[0] is not None and rows[0] >= ages["0"], rows
        assert job.poll() is None
        job.terminate()
        job.communicate(timeout=60)


# A supervisor of function workers whose fd 1 is a file (not a terminal, and
# not pytest's capture): their streams are inherited, as from a script.
FUNCTIONS = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import aiolaunch

    def banner_then_quiet(rank):
        if rank == 0:
            print("function rank 0 up", flush=True)
        time.sleep(3600)

    async def main():
        async with aiolaunch.start_processes(
            name="fn", entrypoint=banner_then_quiet, args={0: (0,), 1: (1,)},
            envs={0: {}, 1: {}}, start_method=sys.argv[2],
        ) as ctx:
            await asyncio.sleep(float(sys.argv[1]))
            ages = {s.rank: s.last_output_s for s in ctx.status()}
            print("AGES", json.dumps(ages), flush=True)
            await ctx.close()

    if __name__ == "__main__":
        asyncio.run(main())
    """
)


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_output_age_of_function_workers_with_inherited_streams(
    tmp_path: Path, start_method: str
) -> None:
    script = tmp_path / "sup.py"
    script.write_text(FUNCTIONS)
    console = tmp_path / "console.txt"
    with (
        console.open("w") as out,
        driver(
            [sys.executable, str(script), str(FRESH_S + 1), start_method], stdout=out.fileno()
        ) as sup,
    ):
        _, err = sup.communicate(timeout=120)
    assert sup.returncode == 0, err
    text = console.read_text()
    assert "function rank 0 up" in text
    ages = json.loads(text.split("AGES ", 1)[1].splitlines()[0])
    assert ages["1"] is None, ages  # never wrote
    assert ages["0"] is not None and ages["0"] >= 2.0, ages


def test_the_stack_marker_is_no_output(tmp_path: Path) -> None:
    # The dump handler's registration leaves no written byte in the worker's
    # count: a rank that printed nothing has no output age.
    script = tmp_path / "silent.py"
    script.write_text("import time\ntime.sleep(3600)\n")
    logs = tmp_path / "logs"
    with driver(_cli("--nproc-per-node", "1", "--log-dir", str(logs), str(script))) as job:
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        (marker,) = _until(
            "the marker", lambda: list(logs.glob("*/attempt_0/.aiolaunch-stacks/*.ok"))
        )
        pid = int(os.path.basename(marker).split(".")[0])
        with open(f"/proc/{pid}/io") as f:
            wchar = next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
        assert wchar == 0
        job.terminate()
        job.communicate(timeout=60)


# -- the rule: a count of written bytes read as output (pure) ----------------------


def _io(wchar: int) -> bytes:
    return f"rchar: 10\nwchar: {wchar}\nsyscr: 1\n".encode()


def _now_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def test_a_new_process_counts_its_writes_from_zero() -> None:
    count = WriteCount()
    assert count.update(_io(12), _now_ticks)  # printed a banner before the first look
    assert not count.update(_io(12), _now_ticks)
    assert count.update(_io(13), _now_ticks)


def test_an_old_process_only_sets_the_baseline_at_first() -> None:
    asked: list[int] = []

    def booted() -> int:
        asked.append(1)
        return 0  # started with the machine

    count = WriteCount()
    assert not count.update(_io(12), booted)
    assert not count.update(_io(12), booted)
    assert count.update(_io(20), booted)
    assert asked == [1]  # the start time is asked once, at the first reading


def test_a_stack_dump_is_no_output() -> None:
    count = WriteCount()
    count.update(_io(0), _now_ticks)
    count.discount(500)
    assert not count.update(_io(500), _now_ticks)  # the dump alone
    count.discount(500)
    assert count.update(_io(1001), _now_ticks)  # the dump and one byte more
    count.rebase(_io(3000))
    assert not count.update(_io(3000), _now_ticks)
    assert not count.update(None, _now_ticks)  # unreadable: nothing changes
    assert count.update(_io(3001), _now_ticks)


# -- aiolaunch events | head -1 ------------------------------------------------------


@pytest.mark.parametrize("as_json", [False, True])
def test_events_ends_when_its_reader_goes_away(tmp_path: Path, as_json: bool) -> None:
    # `aiolaunch events | head -1` on a quiet job: head exits after a line,
    # and so does the client - at once, quietly - not at the job's next event.
    script = tmp_path / "quiet.py"
    script.write_text("import time\ntime.sleep(3600)\n")
    logs = tmp_path / "logs"
    with driver(_cli("--nproc-per-node", "1", "--log-dir", str(logs), str(script))) as job:
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        flags = ["--json"] if as_json else []
        with driver(_cli("events", str(logs), *flags)) as events:
            assert events.stdout is not None and events.stderr is not None
            first = events.stdout.readline()
            assert "started" in first, first
            events.stdout.close()  # what head does after its line
            try:
                status = events.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pytest.fail("aiolaunch events still runs after its reader went away")
            assert status == 0
            assert events.stderr.read() == ""
        assert job.poll() is None
        job.terminate()
        job.communicate(timeout=60)


# -- a scrape open when an attempt ends ----------------------------------------------------

RESTART_ONCE = textwrap.dedent(
    """
    import os, sys, time
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
        if os.environ["LOCAL_RANK"] == "1":
            sys.exit(1)
        time.sleep(3600)
    """
)


def test_scrapes_open_when_an_attempt_ends_print_no_traceback(tmp_path: Path) -> None:
    import http.client

    from aiolaunch import free_port

    script = tmp_path / "job.py"
    script.write_text(RESTART_ONCE)
    go = tmp_path / "go"
    logs = tmp_path / "logs"
    port = free_port("127.0.0.1")
    argv = _cli("--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs),
                "--metrics-port", str(port), str(script), str(go))  # fmt: skip
    with driver(argv) as job:
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        scrapers = []
        for _ in range(20):  # keep-alive connections, as Prometheus keeps one
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            c.request("GET", "/metrics")
            assert c.getresponse().read()
            scrapers.append(c)
        go.touch()  # attempt 0 fails; attempt 1 succeeds
        _, err = job.communicate(timeout=120)
        for c in scrapers:
            c.close()
    assert job.returncode == 0, err
    assert "Traceback" not in err and "Exception in callback" not in err, err


# -- attach: no live-looking prompt for a rank that is gone ------------------------------

PARKED = textwrap.dedent(
    """
    import os, time

    def parked():
        print("rank", os.environ["LOCAL_RANK"], "parked", flush=True)
        while True:
            time.sleep(0.05)

    parked()
    """
)


class _Terminal:
    """A command on a pseudo-terminal of its own (readline's prompt, as a user sees it)."""

    def __init__(self, argv: list[str]) -> None:
        import pty

        master, slave = pty.openpty()
        try:
            self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave)
        finally:
            os.close(slave)
        self.fd = master
        self.out = ""

    def expect(self, text: str, timeout: float = 60.0) -> None:
        import select

        deadline = time.monotonic() + timeout
        while text not in self.out:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                pytest.fail(f"no {text!r} on the terminal; it shows:\n{self.out}")
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError:  # EIO: the other side closed
                chunk = b""
            if not chunk:
                pytest.fail(f"the terminal closed before {text!r}; it showed:\n{self.out}")
            self.out += chunk.decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.fd)


@pytest.mark.parametrize("how", ["killed", "ctrl-d"])
def test_attach_ends_when_its_rank_is_gone(tmp_path: Path, how: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(PARKED)
    logs = tmp_path / "logs"
    argv = _cli("--nproc-per-node", "2", "--log-dir", str(logs), str(script))
    with driver(argv) as job:
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        status = subprocess.run(_cli("status", str(logs), "--json"), capture_output=True,
                                text=True, timeout=60, check=True)  # fmt: skip
        pid = {w["rank"]: w["pid"] for w in json.loads(status.stdout)["workers"]}[1]
        term = _Terminal(_cli("attach", "1", str(logs)))
        try:
            term.expect("(Pdb) ")
            if how == "killed":
                os.kill(pid, 9)  # the rank dies while its prompt is shown
                term.expect("is gone")
                assert term.proc.wait(timeout=10) == 1
            else:
                os.write(term.fd, b"\x04")  # Ctrl-D: detach, the rank goes on
                term.expect("detached from rank 1")
                assert term.proc.wait(timeout=10) == 0
                assert "is gone" not in term.out
        finally:
            term.close()
        if how == "ctrl-d":
            assert job.poll() is None
            job.terminate()
        job.communicate(timeout=60)


# -- top after the job ended ---------------------------------------------------------------

ENDS_ON_GO = textwrap.dedent(
    """
    import os, sys, time
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    """
)


def _tmux(name: str, *args: str) -> str:
    r = subprocess.run(["tmux", "-L", name, *args], capture_output=True, text=True, timeout=30,
                       check=True)  # fmt: skip
    return r.stdout


def test_top_counts_no_rank_as_sleeping_after_the_job_ended(tmp_path: Path) -> None:
    import shlex
    import shutil
    import uuid

    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    script = tmp_path / "job.py"
    script.write_text(ENDS_ON_GO)
    go = tmp_path / "go"
    logs = tmp_path / "logs"
    argv = _cli("--nproc-per-node", "2", "--log-dir", str(logs), str(script), str(go))
    name = f"aiolaunch-test-{uuid.uuid4().hex[:8]}"
    _tmux(name, "-f", "/dev/null", "new-session", "-d", "-x", "80", "-y", "24",
          "env PS1='$ ' TERM=xterm bash --norc --noprofile")  # fmt: skip
    try:
        with driver(argv) as job:
            _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
            env = f"PYTHONPATH={shlex.quote(os.pathsep.join(sys.path))}"
            _tmux(name, "send-keys", f"{env} {shlex.join(_cli('top', str(logs)))}", "Enter")
            _until(
                "both ranks sleeping",
                lambda: "2 ranks (2 sleeping)" in _tmux(name, "capture-pane", "-p"),
            )
            go.touch()  # the job ends
            _, err = job.communicate(timeout=60)
            assert job.returncode == 0, err

        def seen_the_end() -> str | None:
            text = _tmux(name, "capture-pane", "-p")
            return text if "job not running" in text else None

        screen = _until("top to see the end", seen_the_end)
        assert "sleeping" not in screen, screen
        assert "2 ranks (2 gone)" in screen, screen
        rows = [line.split() for line in screen.splitlines() if line.split()[:1] in (["0"], ["1"])]
        assert [r[:2] for r in rows] == [["0", "gone"], ["1", "gone"]], screen
        _tmux(name, "send-keys", "q")
    finally:
        subprocess.run(["tmux", "-L", name, "kill-server"], capture_output=True, timeout=30,
                       check=False)  # fmt: skip


def test_an_ended_snapshot_shows_no_live_state() -> None:
    from aiolaunch._cli._top_view import GONE, TopState, ended, screen

    live = {"name": "job", "log_dir": "/l", "workers": [
        {"rank": 0, "state": "sleeping", "pid": 10, "cpu_percent": 12.5, "last_output_s": 3.0},
        {"rank": 1, "state": "exited", "pid": 11, "exitcode": 3, "cpu_percent": 0.0},
    ]}  # fmt: skip
    after = ended(live)
    assert [w["state"] for w in after["workers"]] == [GONE, "exited"]
    assert after["workers"][0]["cpu_percent"] is None and after["workers"][1]["exitcode"] == 3
    lines = [text for text, _ in screen(after, TopState(), 80, 24)]
    assert lines[0].startswith("aiolaunch top - job: 2 ranks (1 gone, 1 exited)")
    assert "sleeping" not in "\n".join(lines)
