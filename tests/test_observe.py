"""Live observability with real jobs: ``aiolaunch top`` in tmux, ``/metrics``, ``events``, ``attach``.

Every job here is the aiolaunch CLI running real Python ranks, and every
client is the real command in its real terminal (tmux for ``top``, a pty for
``attach``). The pure rules behind them are in tests/test_observe_units.py.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import select
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from _helpers import cli_argv as _cli
from _helpers import cli_env as _env
from _helpers import driver, popen, wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

# Ranks 0 and 1 print a line every 0.2 s; rank 2 prints once and goes quiet
# in a function of its own (its OUTPUT age grows; its stacks name it).
JOB = textwrap.dedent(
    """
    import os, sys, time

    def quiet_rank_two():
        print("rank 2 parked", flush=True)
        while True:
            time.sleep(0.05)

    rank = int(os.environ["LOCAL_RANK"])
    print(f"rank {rank} up", flush=True)
    if rank == 2:
        quiet_rank_two()
    i = 0
    while True:
        i += 1
        print(f"step {i}", flush=True)
        time.sleep(0.2)
    """
)


_until = wait_until


@contextlib.contextmanager
def _job(
    tmp_path: Path, *flags: str, nproc: int = 3
) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """The CLI running JOB with ``nproc`` ranks; yields (log dir, the CLI's process) once all are up."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    logs = tmp_path / "logs"
    argv = _cli(
        "--nproc-per-node",
        str(nproc),
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        *flags,
        str(script),
    )
    with driver(argv, env=_env(), stdout=subprocess.DEVNULL) as job:

        def up() -> bool:
            outs = list(logs.glob("*/attempt_0/*/stdout.log"))
            return len(outs) == nproc and all(" up" in p.read_text() for p in outs)

        _until("the job's ranks to start", up)
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        yield logs, job
        assert job.poll() is None, "the job died while it was observed"
        job.terminate()
        job.communicate(timeout=60)


# -- top --------------------------------------------------------------------------------


class _Tmux:
    """A private tmux server (its own socket) with one 80x24 window running a plain shell."""

    def __init__(self) -> None:
        self.name = f"aiolaunch-test-{uuid.uuid4().hex[:8]}"
        self.run(
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-x",
            "80",
            "-y",
            "24",
            "env PS1='$ ' TERM=xterm bash --norc --noprofile",
        )

    def run(self, *args: str) -> str:
        r = subprocess.run(
            ["tmux", "-L", self.name, *args], capture_output=True, text=True, timeout=30, check=True
        )
        return r.stdout

    def screen(self) -> list[str]:
        return self.run("capture-pane", "-p").splitlines()

    def text(self) -> str:
        return "\n".join(self.screen())

    def keys(self, *keys: str) -> None:
        self.run("send-keys", *keys)

    def close(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(
                ["tmux", "-L", self.name, "kill-server"],
                capture_output=True,
                timeout=30,
                check=False,
            )


@pytest.fixture
def tmux() -> Iterator[_Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    t = _Tmux()
    try:
        yield t
    finally:
        t.close()


def _rows(screen: list[str]) -> dict[int, str]:
    """Top's rank rows by rank (lines below the header that start with a rank number)."""
    rows: dict[int, str] = {}
    header = next((i for i, line in enumerate(screen) if line.startswith("RANK ")), None)
    if header is None:
        return rows
    for line in screen[header + 1 :]:
        parts = line.split()
        if parts and parts[0].isdigit():
            assert int(parts[0]) not in rows, f"rank {parts[0]} twice:\n" + "\n".join(screen)
            rows[int(parts[0])] = line
    return rows


def test_top_in_tmux_one_row_per_rank_live_stacks_and_a_clean_exit(
    tmp_path: Path, tmux: _Tmux
) -> None:
    with _job(tmp_path) as (logs, _):
        env = f"PYTHONPATH={shlex.quote(os.pathsep.join(sys.path))}"
        tmux.keys(f"{env} {shlex.join(_cli('top', str(logs)))}", "Enter")
        first = _until(
            "top's first screen", lambda: len(_rows(tmux.screen())) == 3 and tmux.screen()
        )
        assert isinstance(first, list)
        assert first[0].startswith("aiolaunch top - default: 3 ranks")
        assert all(len(line) <= 80 for line in first) and len(first) <= 24
        rows = _rows(first)
        assert sorted(rows) == [0, 1, 2]
        for rank, line in rows.items():
            pid = int(line.split()[2])
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert f"LOCAL_RANK={rank}\0".encode() in f.read()
        # Redrawn in place: rank 2 is quiet, so its OUTPUT age grows between two captures.
        _until("rank 2's row to change", lambda: _rows(tmux.screen())[2] != rows[2], timeout=15)
        # A key shows one rank's stacks; q goes back to the table.
        tmux.keys("Down", "Down", "s")
        stacks = _until(
            "rank 2's stacks",
            lambda: "quiet_rank_two" in tmux.text() and tmux.screen(),
            show=tmux.text,
        )
        assert isinstance(stacks, list)
        assert any("stacks of rank 2" in line for line in stacks)
        tmux.keys("q")
        _until("the table again", lambda: len(_rows(tmux.screen())) == 3)
        # q quits and the shell's screen is back as it was (top drew on the alternate screen).
        tmux.keys("q")

        def back() -> list[str] | None:
            screen = [line for line in tmux.screen() if line.strip()]
            return screen if screen[-1] == "$" else None

        screen = _until("the shell's prompt after top", back, show=tmux.text)
        assert isinstance(screen, list)
        assert screen[0].startswith("$ PYTHONPATH=")
        assert not _rows(screen)
        assert not any("aiolaunch top -" in line for line in screen)


# -- /metrics ---------------------------------------------------------------------------


def test_metrics_a_sample_per_rank_parsed_by_prometheus_client(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from aiolaunch import free_port

    port = free_port("127.0.0.1")
    flags = ("--metrics-port", str(port), "--stall-timeout", "600", "--progress-regex", "^step")
    with _job(tmp_path, *flags) as (logs, _):
        url = f"http://127.0.0.1:{port}/metrics"

        def scrape() -> dict[str, Any]:
            with urllib.request.urlopen(url, timeout=30) as r:
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = r.read().decode()
            return {f.name: f for f in text_string_to_metric_families(text)}

        # ranks 0 and 1 print a step line every 0.2 s: their counter and rate move
        fams = _until(
            "steps counted",
            lambda: (
                (f := scrape())
                and all(
                    s.value >= 3
                    for s in f["aiolaunch_worker_progress_lines"].samples
                    if s.labels["rank"] != "2"
                )
                and f
            ),
        )
        assert isinstance(fams, dict)
        for name in (
            "aiolaunch_worker_up",
            "aiolaunch_worker_pid",
            "aiolaunch_worker_restarts",
            "aiolaunch_worker_cpu_seconds",
            "aiolaunch_worker_resident_memory_bytes",
            "aiolaunch_worker_stalls",
            "aiolaunch_worker_last_output_age_seconds",
            "aiolaunch_worker_progress_lines",
            "aiolaunch_worker_steps_per_second",
        ):
            ranks = sorted(s.labels["rank"] for s in fams[name].samples)
            assert ranks == ["0", "1", "2"], name
        pids = {s.labels["rank"]: int(s.value) for s in fams["aiolaunch_worker_pid"].samples}
        status = subprocess.run(
            _cli("status", str(logs), "--json"),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        answer = json.loads(status.stdout)
        assert {str(w["rank"]): w["pid"] for w in answer["workers"]} == pids
        assert answer["metrics"] == url and answer["v"] == 1
        rates = {
            s.labels["rank"]: s.value for s in fams["aiolaunch_worker_steps_per_second"].samples
        }
        assert rates["0"] > 0.5 and rates["1"] > 0.5 and rates["2"] == 0
        assert fams["aiolaunch_group_workers"].samples[0].value == 3
        assert all(s.value == 1 for s in fams["aiolaunch_worker_up"].samples)
    # the port lives as long as the group
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_a_metrics_port_in_use_fails_before_any_worker_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = tmp_path / "job.py"
        script.write_text("print('ran')\n")
        r = subprocess.run(
            _cli(
                "--nproc-per-node",
                "2",
                "--log-dir",
                str(tmp_path / "logs"),
                "--metrics-port",
                str(port),
                str(script),
            ),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert r.returncode != 0
    assert f"127.0.0.1:{port}" in r.stderr and "--metrics-port" in r.stderr, r.stderr
    assert "ran" not in r.stdout
    assert not list((tmp_path / "logs").glob("**/stdout.log"))


# -- events --json ------------------------------------------------------------------------

EXITS = textwrap.dedent(
    """
    import os, sys, time
    rank = int(os.environ["LOCAL_RANK"])
    print(f"rank {rank} up", flush=True)
    go = os.path.join(os.path.dirname(os.path.abspath(__file__)), "go")
    while not os.path.exists(go):
        time.sleep(0.05)
    if rank == 1:
        sys.exit(3)
    while True:
        time.sleep(0.05)
    """
)


def test_events_json_shows_an_exit_as_one_line(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(EXITS)
    logs = tmp_path / "logs"
    argv = _cli("--nproc-per-node", "3", "--log-dir", str(logs), "--redirects", "3", str(script))
    with driver(argv, env=_env(), stdout=subprocess.DEVNULL) as job:
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        with driver(_cli("events", str(logs), "--json"), env=_env(), stderr=None) as events:
            assert events.stdout is not None
            lines: list[str] = []
            while sum('"started"' in line for line in lines) < 3:
                lines.append(events.stdout.readline())
                assert lines[-1], f"events ended early: {lines}"
            (tmp_path / "go").write_text("")
            while True:
                line = events.stdout.readline()
                if not line:
                    break
                lines.append(line)
            assert events.wait(timeout=60) == 0
        job.communicate(timeout=60)
    msgs = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all(m["v"] == 1 and m["group"] == "default" for m in msgs)
    exits = [m for m in msgs if m["event"] == "exited" and not m["stopped"]]
    assert [(m["rank"], m["exitcode"], m["signal"]) for m in exits] == [(1, 3, None)]
    assert [m["event"] for m in msgs].count("started") == 3
    assert msgs[-1]["event"] == "group_stopped" and msgs[-1]["failed"] is True
    stopped = sorted(m["rank"] for m in msgs if m["event"] == "exited" and m["stopped"])
    assert stopped == [0, 2]


# -- attach -------------------------------------------------------------------------------

HELD = textwrap.dedent(
    """
    import os, time
    release = os.path.join(os.path.dirname(os.path.abspath(__file__)), "release")

    def rank_two_function():
        print("rank 2 waiting", flush=True)
        while not os.path.exists(release):
            time.sleep(0.05)
        print("rank 2 released", flush=True)

    rank = int(os.environ["LOCAL_RANK"])
    print(f"rank {rank} up", flush=True)
    if rank == 2:
        rank_two_function()
    else:
        while not os.path.exists(release):
            time.sleep(0.05)
        print(f"rank {rank} released", flush=True)
    """
)


class _Pty:
    """A command on a pseudo-terminal of its own, driven like a user would."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = os.openpty()
        try:
            self.proc = popen(argv, stdin=slave, stdout=slave, stderr=slave, env=_env())
        finally:
            os.close(slave)
        self.fd = master
        self.out = ""

    def expect(self, text: str, timeout: float = 60.0) -> str:
        """Read until ``text`` arrives; return what came since the last expect."""
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
        head, _, self.out = self.out.partition(text)
        return head

    def send(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\r")

    def finish(self, timeout: float = 60.0) -> int:
        """Read to the end; the exit status."""
        deadline = time.monotonic() + timeout
        while select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            self.out += chunk.decode(errors="replace")
        return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.fd)


def _status(logs: str | os.PathLike[str]) -> dict[str, Any]:
    r = subprocess.run(
        _cli("status", str(logs), "--json"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer: dict[str, Any] = json.loads(r.stdout)
    return answer


def test_attach_2_through_a_pty_where_continue_and_the_group_succeeds(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(HELD)
    logs = tmp_path / "logs"
    argv = _cli("--nproc-per-node", "3", "--log-dir", str(logs), "--redirects", "3", str(script))
    with driver(argv, env=_env(), stdout=subprocess.DEVNULL) as job:

        def log(rank: int) -> str:
            found = list(logs.glob(f"*/attempt_0/{rank}/stdout.log"))
            return found[0].read_text() if found else ""

        _until("rank 2 waiting", lambda: "rank 2 waiting" in log(2) and " up" in log(0) + log(1))
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        term = _Pty(_cli("attach", "2", str(logs)))
        try:
            term.expect("(Pdb) ")
            term.send("where")
            where = term.expect("(Pdb) ")
            assert "rank_two_function()" in where and "job.py" in where, where
            term.send("p rank")
            assert term.expect("(Pdb) ").strip().endswith("2")
            status = {w["rank"]: w for w in _status(logs)["workers"]}
            assert status[2]["attached"] and not status[0]["attached"]
            # The other ranks keep running: released, they finish; rank 2 is held.
            (tmp_path / "release").write_text("")
            _until("ranks 0 and 1 to finish", lambda: "released" in log(0) and "released" in log(1))
            assert "released" not in log(2)
            term.send("continue")
            assert term.finish() == 0, term.out
            assert "detached" in term.out
        finally:
            term.close()
        _, stderr = job.communicate(timeout=60)
        assert job.returncode == 0, stderr
    assert "rank 2 released" in log(2)


def _held_function(rank: int, release: str) -> int:
    import os
    import time

    def function_rank_waits() -> None:
        with open(release + ".waiting", "w"):
            pass
        while not os.path.exists(release):
            time.sleep(0.05)

    if rank == 1:
        function_rank_waits()
    return rank


async def test_attach_to_a_function_worker(tmp_path: Path) -> None:
    import asyncio

    import aiolaunch

    release = str(tmp_path / "release")
    logs = tmp_path / "logs"
    async with aiolaunch.start_processes(
        name="fn",
        entrypoint=_held_function,
        args={r: (r, release) for r in range(2)},
        envs={r: {} for r in range(2)},
        log_dir=str(logs),
    ) as ctx:

        def session() -> tuple[int, str]:
            term = _Pty(_cli("attach", "1", str(logs)))
            try:
                term.expect("(Pdb) ")
                term.send("where")
                where = term.expect("(Pdb) ")
                (tmp_path / "release").write_text("")
                term.send("continue")
                return term.finish(), where
            finally:
                term.close()

        for _ in range(1200):  # the socket is made by the loop: yield to it
            if (logs / "control.sock").exists() and os.path.exists(release + ".waiting"):
                break
            await asyncio.sleep(0.05)
        code, where = await asyncio.to_thread(session)
        assert code == 0
        assert "function_rank_waits()" in where and "_held_function()" in where, where
        result = await asyncio.wait_for(ctx.wait(), 60)
    assert result is not None and result.return_values == {0: 0, 1: 1}


def test_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to add a user and run as it")
    if shutil.which("useradd") is None:
        pytest.skip("no useradd here")
    user = f"aiolt{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/bin/false", user],
        check=True,
        capture_output=True,
        timeout=60,
    )
    import pwd
    import tempfile

    # A log dir the other user may look into: the control socket's own mode
    # (0600) is what must refuse them.
    base = tempfile.mkdtemp(prefix="aiolaunch-attach-test-")
    try:
        os.chmod(base, 0o755)
        uid, gid = pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid
        script = tmp_path / "job.py"
        script.write_text(HELD)
        logs = os.path.join(base, "logs")
        argv = _cli("--nproc-per-node", "3", "--log-dir", logs, "--redirects", "3", str(script))
        with driver(argv, env=_env(), stdout=subprocess.DEVNULL) as job:
            _until("the control socket", lambda: glob.glob(f"{logs}/*/attempt_0/control.sock"))
            # The folders down to the socket searchable by anyone: only the
            # socket's own mode refuses (the dumps' folder stays 0700).
            sock = glob.glob(f"{logs}/*/attempt_0/control.sock")[0]
            for folder in (logs, os.path.dirname(os.path.dirname(sock)), os.path.dirname(sock)):
                os.chmod(folder, 0o755)
            code = textwrap.dedent(f"""
                import os, sys
                # what the client imports on its way, while the stdlib is
                # still readable (it lives under /root here)
                import argparse, gettext, json, locale, shutil, socket
                import aiolaunch._live._control, aiolaunch._workers._proc
                argparse.ArgumentParser(prog="warm-up").parse_args([])
                from aiolaunch._cli._attach import attach_main
                os.setgroups([]); os.setgid({gid}); os.setuid({uid})
                sys.exit(attach_main(["2", {logs!r}]))
            """)
            r = subprocess.run(
                [sys.executable, "-c", code],
                env=_env(),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert r.returncode == 1, r
            assert "permission denied" in r.stderr.lower(), r.stderr
            assert "only the user who started the job" in r.stderr, r.stderr
            # the rank was not touched
            assert not _status(logs)["workers"][2]["attached"]
            assert job.poll() is None
            (tmp_path / "release").write_text("")
            job.communicate(timeout=60)
            assert job.returncode == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
        subprocess.run(["userdel", user], check=False, capture_output=True, timeout=60)


async def test_at_the_end_an_idle_connection_closes_and_a_stream_gets_group_stopped(
    tmp_path: Path,
) -> None:
    import asyncio

    import aiolaunch

    async with aiolaunch.start_processes(
        name="end",
        entrypoint=sys.executable,
        args={0: ("-c", "import time; time.sleep(3600)")},
        envs={0: {}},
        log_dir=str(tmp_path),
    ) as ctx:
        for _ in range(600):  # the socket is made by the loop: yield to it
            if (tmp_path / "control.sock").exists():
                break
            await asyncio.sleep(0.05)
        path = str(tmp_path / "control.sock")
        idle_r, idle_w = await asyncio.open_unix_connection(path)
        idle_w.write(b'{"cmd": "status"}\n')
        assert json.loads(await idle_r.readline())["ok"] is True  # kept open, like top's
        ev_r, ev_w = await asyncio.open_unix_connection(path)
        ev_w.write(b'{"cmd": "events"}\n')
        assert json.loads(await ev_r.readline())["stream"] == "events"
        assert json.loads(await ev_r.readline())["event"] == "started"
        await ctx.close()
        # the idle connection ends: a client sees the group is gone
        assert await asyncio.wait_for(idle_r.read(), 10) == b""
        # the stream still gets the last events, then ends
        rest = [json.loads(line) for line in (await asyncio.wait_for(ev_r.read(), 10)).splitlines()]
        assert [m["event"] for m in rest][-1] == "group_stopped"
        assert any(m["event"] == "exited" and m["rank"] == 0 for m in rest)
        for w in (idle_w, ev_w):
            w.close()
            await w.wait_closed()


TALKERS = textwrap.dedent(
    """
    import os, time
    release = os.path.join(os.path.dirname(os.path.abspath(__file__)), "release")

    def talking_rank():
        while not os.path.exists(release):
            print("tick", flush=True)
            time.sleep(0.2)

    rank = int(os.environ["LOCAL_RANK"])
    print(f"rank {rank} up", flush=True)
    talking_rank()
    """
)


def test_the_watchdog_leaves_an_attached_rank_alone(tmp_path: Path) -> None:
    # Held at the prompt for twice --stall-timeout, rank 1 has no output and
    # no CPU: a stall, but for the debugger. The job must not fail for it.
    script = tmp_path / "job.py"
    script.write_text(TALKERS)
    logs = tmp_path / "logs"
    argv = _cli(
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        "--stall-timeout",
        "3",
        "--on-stall",
        "fail",
        str(script),
    )
    with driver(argv, env=_env(), stdout=subprocess.DEVNULL) as job:
        _until("the control socket", lambda: list(logs.glob("*/attempt_0/control.sock")))
        term = _Pty(_cli("attach", "1", str(logs)))
        try:
            term.expect("(Pdb) ")
            held = time.monotonic()
            while time.monotonic() - held < 2 * 3 + 1:
                status = {w["rank"]: w for w in _status(logs)["workers"]}
                assert status[1]["attached"] and status[1]["state"] != "stalled"
                assert job.poll() is None, "the job failed while rank 1 was attached"
                time.sleep(0.5)  # allowed: holding the prompt on purpose
            term.send("continue")
            assert term.finish() == 0, term.out
        finally:
            term.close()
        (tmp_path / "release").write_text("")
        _, stderr = job.communicate(timeout=60)
        assert job.returncode == 0, stderr
        assert "stalled" not in stderr


async def test_metrics_from_python_on_any_free_port(tmp_path: Path) -> None:
    import asyncio

    import aiolaunch

    async with aiolaunch.start_processes(
        name="py",
        entrypoint=sys.executable,
        args={r: ("-c", "import time; time.sleep(3600)") for r in range(2)},
        envs={r: {} for r in range(2)},
        log_dir=str(tmp_path),
        metrics_port=0,
    ) as ctx:
        url = ctx.metrics_url
        assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        host, port = url[len("http://") :].split("/")[0].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
        response = (await asyncio.wait_for(reader.read(), 30)).decode()
        writer.close()
        await writer.wait_closed()
        assert response.startswith("HTTP/1.1 200 OK")
        assert 'aiolaunch_worker_up{rank="0"} 1' in response
        assert 'aiolaunch_worker_up{rank="1"} 1' in response
        await ctx.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(host, int(port))
