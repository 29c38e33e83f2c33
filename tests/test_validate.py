"""Bad input raises before anything starts, naming the argument and the fix."""

from __future__ import annotations

import gc
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from _helpers import proc_state
from aiolaunch import DefaultLogsSpecs, ReadyFile, ReadyLine, ReadyPort, RestartPolicy, Std

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path


def work(x: int) -> int:
    return x


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        found.add(int(entry))
            except OSError:
                pass
    return found


GOOD: dict[str, Any] = {
    "name": "v",
    "entrypoint": work,
    "args": {0: (1,), 1: (2,)},
    "envs": {0: {}, 1: {}},
}

CASES = [
    (ValueError, r"args is empty", {"args": {}, "envs": {}}),
    (
        ValueError,
        r"args must have exactly the local ranks.*missing \[1\]",
        {"args": {0: (1,), 2: (1,)}, "envs": {0: {}, 2: {}}},
    ),
    (ValueError, r"envs must have exactly.*missing \[1\]", {"envs": {0: {}}}),
    (ValueError, r"envs must have exactly.*unexpected \[5\]", {"envs": {0: {}, 1: {}, 5: {}}}),
    (ValueError, r"start_method='thread'.*use 'spawn'", {"start_method": "thread"}),
    (ValueError, r"start_method='bogus'", {"entrypoint": "/bin/true", "start_method": "bogus"}),
    (TypeError, r"entrypoint must be a callable.*or a str.*got int", {"entrypoint": 42}),
    (TypeError, r"envs\[0\] has a non-str key 1", {"envs": {0: {1: "x"}, 1: {}}}),
    (TypeError, r"envs\[1\]\['X'\] is 3.*use str\(3\)", {"envs": {0: {}, 1: {"X": 3}}}),
    (
        TypeError,
        r"args\[1\]\[0\] \(lock\) cannot be pickled",
        {"args": {0: (1,), 1: (threading.Lock(),)}},
    ),
    (
        FileNotFoundError,
        r"'no-such-binary-xyz' was not found on PATH",
        {"entrypoint": "no-such-binary-xyz", "args": {0: ()}, "envs": {0: {}}},
    ),
    (TypeError, r"redirects=.*Std", {"redirects": "all"}),
    (ValueError, r"tee has rank 7", {"tee": {7: Std.ALL}}),
    (ValueError, r"shutdown_timeout=-1", {"shutdown_timeout": -1}),
    (ValueError, r"log_line_prefixes has rank 9", {"log_line_prefixes": {9: "x"}}),
    (ValueError, r"console_dedup=-1 must be a window in seconds", {"console_dedup": -1}),
    (
        ValueError,
        r"either logs_specs or log_dir",
        {"logs_specs": aiolaunch.DefaultLogsSpecs(), "redirects": Std.ALL},
    ),
]


BIN: dict[str, Any] = {"entrypoint": "/bin/echo", "args": {0: ("x",)}, "envs": {0: {}}}

# Inputs that slipped past validation before (issue #12.5): each used to start
# rank 0 (or a function worker that then died) or to crash deep inside.
CASES += [
    (ValueError, r"envs\[1\] has the name 'A=B'.*neither '='", {"envs": {0: {}, 1: {"A=B": "x"}}}),
    (ValueError, r"envs\[0\] has the name ''.*non-empty", {"envs": {0: {"": "x"}, 1: {}}}),
    (
        ValueError,
        r"envs\[0\]\['X'\] contains a NUL byte",
        {"envs": {0: {"X": "a\0b"}, 1: {}}},
    ),
    (
        ValueError,
        r"envs\[0\]\['X'\] contains a NUL byte",
        {**BIN, "envs": {0: {"X": "a\0b"}}},
    ),
    (ValueError, r"args\[0\]\[1\] contains a NUL byte", {**BIN, "args": {0: ("ok", "a\0")}}),
    (ValueError, r"name='a/b' contains '/'.*pass log_dir", {"name": "a/b"}),
    (IsADirectoryError, r"entrypoint='/tmp' is a directory", {**BIN, "entrypoint": "/tmp"}),
    (
        FileNotFoundError,
        r"entrypoint='/nonexistent/prog' does not exist",
        {**BIN, "entrypoint": "/nonexistent/prog"},
    ),
    (FileNotFoundError, r"'/dev/null' does not exist", {**BIN, "entrypoint": "/dev/null"}),
    (PermissionError, r"'/etc/passwd' is not executable", {**BIN, "entrypoint": "/etc/passwd"}),
    (
        FileNotFoundError,
        r"entrypoint='echo hi'.*arguments go in args: entrypoint='echo', args=\{0: \('hi',\)",
        {**BIN, "entrypoint": "echo hi"},
    ),
    (ValueError, r"tee=8 is not a Std", {"tee": Std(8)}),
    (ValueError, r"redirects\[1\]=12 is not a Std", {"redirects": {1: Std(12)}}),
]


@pytest.mark.parametrize(("exc", "match", "override"), CASES)
def test_bad_input_raises_before_start(
    exc: type[Exception], match: str, override: dict[str, Any], private_tmp: Path
) -> None:
    before = _children()
    with pytest.raises(exc, match=match):
        aiolaunch.start_processes(**{**GOOD, **override})
    assert _children() == before
    assert list(private_tmp.iterdir()) == []


def _any(value: object) -> Any:
    """A wrongly typed argument, on purpose."""
    return value


CONSTRUCTORS: list[tuple[type[Exception], str, Callable[[], object]]] = [
    (
        TypeError,
        r"RestartPolicy\(max_restarts='3'\) must be an int",
        lambda: RestartPolicy(max_restarts=_any("3")),
    ),
    (TypeError, r"RestartPolicy\(backoff='1'\)", lambda: RestartPolicy(backoff=_any("1"))),
    (
        TypeError,
        r"ReadyPort\(port\) must be an int TCP port.*got 'x'",
        lambda: ReadyPort(_any("x")),
    ),
    (
        ValueError,
        r"ReadyPort\(port\)=70000 is not a TCP port; use 1..65535",
        lambda: ReadyPort(70000),
    ),
    (ValueError, r"ReadyPort\(port\)=0 is not a TCP port", lambda: ReadyPort(0)),
    (ValueError, r"ReadyPort\(interval=0\)", lambda: ReadyPort(80, interval=0)),
    (TypeError, r"ReadyFile\(path=None\) must be a file path", lambda: ReadyFile(_any(None))),
    (TypeError, r"ReadyLine\(pattern=5\) must be a str", lambda: ReadyLine(_any(5))),
    (
        TypeError,
        r"DefaultLogsSpecs\(tee\)='x' is neither a Std",
        lambda: DefaultLogsSpecs(tee=_any("x")),
    ),
    (ValueError, r"DefaultLogsSpecs\(tee\)=8 is not a Std", lambda: DefaultLogsSpecs(tee=Std(8))),
    (
        ValueError,
        r"DefaultLogsSpecs\(redirects\) has rank -1",
        lambda: DefaultLogsSpecs(redirects={-1: Std.ALL}),
    ),
    (
        TypeError,
        r"DefaultLogsSpecs\(local_ranks_filter=0\) must be a set",
        lambda: DefaultLogsSpecs(local_ranks_filter=_any(0)),
    ),
]


@pytest.mark.parametrize(("exc", "match", "make"), CONSTRUCTORS)
def test_public_constructors_validate(
    exc: type[Exception], match: str, make: Callable[[], object], private_tmp: Path
) -> None:
    with pytest.raises(exc, match=match):
        make()
    # DefaultLogsSpecs(log_dir=None) makes its folder only once the arguments are good
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize(
    ("exc", "match", "kwargs"),
    [
        (TypeError, r"master_port must be an int TCP port.*got 'abc'", {"master_port": "abc"}),
        (ValueError, r"master_port=70000 is not a TCP port", {"master_port": 70000}),
        (TypeError, r"master_addr=None must be a non-empty str", {"master_addr": None}),
    ],
)
async def test_launch_validates_before_start(
    exc: type[Exception], match: str, kwargs: dict[str, Any], private_tmp: Path
) -> None:
    before = _children()
    with pytest.raises(exc, match=match):
        await aiolaunch.launch(work, 1, 2, **kwargs)
    assert _children() == before
    assert list(private_tmp.iterdir()) == []


async def test_bad_method_arguments_raise_before_any_signal(private_tmp: Path) -> None:
    """wait/close/wait_ready/events check their arguments before acting: the
    worker is still running after each bad call, and a good close() stops it.
    """
    async with aiolaunch.start_processes(
        name="m", entrypoint="/bin/sleep", args={0: ("30",)}, envs={0: {}}
    ) as ctx:
        pid = ctx.pids()[0]
        bad: list[tuple[type[Exception], str, Callable[[], Awaitable[object]]]] = [
            (
                TypeError,
                r"wait\(timeout\)='1' must be a number",
                lambda: ctx.wait(timeout=_any("1")),
            ),
            (TypeError, r"wait_ready\(timeout\)='1'", lambda: ctx.wait_ready(timeout=_any("1"))),
            (ValueError, r"wait_ready\(timeout\)=-1 must be", lambda: ctx.wait_ready(timeout=-1)),
            (TypeError, r"close\(timeout\)='1'", lambda: ctx.close(timeout=_any("1"))),
            (ValueError, r"close\(timeout\)=-1 must be .* >= 0", lambda: ctx.close(timeout=-1)),
            (ValueError, r"close\(death_sig\)=0 is not a signal", lambda: ctx.close(death_sig=0)),
            (
                ValueError,
                r"close\(death_sig\)=999 is not a signal",
                lambda: ctx.close(death_sig=999),
            ),
        ]
        for exc, match, call in bad:
            with pytest.raises(exc, match=match):
                await call()
            assert proc_state(pid) not in ("Z", "X", None), f"worker signalled by {match}"
        for maxsize, exc in ((0, ValueError), (-1, ValueError), ("5", TypeError)):
            with pytest.raises(exc, match=rf"events\(maxsize={maxsize!r}\) must be"):
                ctx.events(maxsize=_any(maxsize))
        assert await ctx.wait(timeout=0) is None  # still running
        await ctx.close(timeout=5)
        assert proc_state(pid) is None


async def test_unwritable_log_dir_names_the_argument(private_tmp: Path) -> None:
    # /sys refuses mkdir even to root (os.access cannot tell); a non-root user
    # gets the same message from the check before the call returns.
    before = _children()
    with pytest.raises(PermissionError, match=r"log_dir='/sys/aiolaunch_x'.*writ"):
        await aiolaunch.start_processes(**GOOD, log_dir="/sys/aiolaunch_x")
    with pytest.raises(PermissionError, match=r"DefaultLogsSpecs\(log_dir\)='/sys/aiolaunch_x'"):
        DefaultLogsSpecs(log_dir="/sys/aiolaunch_x")
    assert _children() == before
    assert list(private_tmp.iterdir()) == []


def test_log_dir_under_a_file_names_the_argument(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"log_dir=.*f/sub'.*is not a directory"):
        aiolaunch.start_processes(**GOOD, log_dir=str(tmp_path / "f" / "sub"))


async def test_forgotten_await_says_to_await(private_tmp: Path) -> None:
    starting = aiolaunch.start_processes(**GOOD)
    with pytest.raises(
        AttributeError, match=r"returned an awaitable.*Await it before using \.wait"
    ):
        starting.wait()
    with pytest.raises(AttributeError, match=r"no attribute 'nprocs'.*Await it before using"):
        starting.nprocs  # noqa: B018
    assert not hasattr(starting, "__fspath__")  # probes get the plain error
    with pytest.warns(
        RuntimeWarning, match=r"start_processes\(name='v', \.\.\.\) was never awaited"
    ):
        del starting  # the last reference: __del__ runs here
    assert list(private_tmp.iterdir()) == []


async def test_awaited_or_entered_start_does_not_warn() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = await aiolaunch.start_processes(**GOOD)
        await ctx.close(timeout=5)
        async with aiolaunch.start_processes(**GOOD) as ctx2:
            await ctx2.wait()
        del ctx, ctx2
        gc.collect()
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []


def test_unpicklable_entrypoint_has_cause() -> None:
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"entrypoint .* cannot be pickled") as info:
        aiolaunch.start_processes(**{**GOOD, "entrypoint": lambda x: (lock, x)})
    assert info.value.__cause__ is not None


def test_log_dir_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        aiolaunch.start_processes(**GOOD, log_dir=str(f))


def test_log_dir_not_empty(tmp_path: Path) -> None:
    (tmp_path / "old.log").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        aiolaunch.start_processes(**GOOD, log_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.log"]


async def test_missing_log_dir_is_created(tmp_path: Path) -> None:
    log_dir = tmp_path / "a" / "b"
    starting = aiolaunch.start_processes(**GOOD, log_dir=str(log_dir), redirects=Std.ALL)
    assert not log_dir.exists(), "nothing is created before the call is awaited"
    async with starting as ctx:
        result = await ctx.wait()
    assert result is not None and result.return_values == {0: 1, 1: 2}
    assert (log_dir / "0" / "stdout.log").exists()


async def test_agent_with_unwritable_log_dir_names_the_argument() -> None:
    from aiolaunch.agent import LocalElasticAgent, WorkerSpec

    before = _children()
    agent = LocalElasticAgent(
        WorkerSpec(role="w", local_world_size=1, entrypoint="/bin/true"),
        log_dir="/sys/aiolaunch_x",
    )
    with pytest.raises(PermissionError, match=r"log_dir='/sys/aiolaunch_x' could not be created"):
        await agent.run()
    assert _children() == before
