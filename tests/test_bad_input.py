"""Bad input, every flag and public argument: one clear error before anything starts.

Each case asserts that the message names the argument (the flag, or the
environment variable it came from) and the fix, that the command line exits
2 with ``aiolaunch: error: ...`` and no traceback, and that nothing was
started or left: no worker ran (the script would write a marker), no
temporary folder is left (``private_tmp``), no process (the autouse leak
check). Regression tests for issue #27 item 6.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

import aiolaunch
from aiolaunch._cli import main
from aiolaunch.agent import LocalElasticAgent, WorkerSpec

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

AIOLAUNCH = [sys.executable, "-m", "aiolaunch"]
NOT_A_HOOK: Any = 5
SCRIPT = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('ran')\n"

# (id, argv before the script, extra environment, words the message must hold)
CLI_CASES: list[tuple[str, list[str], dict[str, str], tuple[str, ...]]] = [
    (
        "forward-bogus",
        ["--forward-signals", "BOGUS"],
        {},
        ("--forward-signals", "'BOGUS'", "pass names like"),
    ),
    (
        "forward-sigkill",
        ["--forward-signals", "SIGKILL"],
        {},
        ("--forward-signals", "SIGKILL", "pass names like"),
    ),
    (
        "forward-sigchld",
        ["--forward-signals", "SIGCHLD"],
        {},
        ("--forward-signals", "SIGCHLD", "pass names like"),
    ),
    (
        "forward-empty",
        ["--forward-signals", ""],
        {},
        ("--forward-signals", "names no signal", "SIGUSR1"),
    ),
    ("forward-commas", ["--forward-signals", ",,"], {}, ("--forward-signals", "names no signal")),
    (
        "forward-pet",
        [],
        {"PET_FORWARD_SIGNALS": "SIGUSR3"},
        ("$PET_FORWARD_SIGNALS", "'SIGUSR3'", "pass names like"),
    ),
    (
        "forward-env",
        [],
        {"AIOLAUNCH_FORWARD_SIGNALS": "USR1,BOGUS"},
        ("$AIOLAUNCH_FORWARD_SIGNALS", "'BOGUS'", "pass names like"),
    ),
    (
        "handle-bogus",
        ["--signals-to-handle", "SIGTERM,SIGBOGUS"],
        {},
        ("--signals-to-handle", "'SIGBOGUS'", "pass names like"),
    ),
    (
        "handle-sigstop",
        ["--signals-to-handle", "SIGSTOP"],
        {},
        ("--signals-to-handle", "SIGSTOP", "pass names like"),
    ),
    (
        "handle-empty",
        ["--signals-to-handle", ""],
        {},
        ("--signals-to-handle", "names no signal", "SIGTERM"),
    ),
    (
        "handle-pet",
        [],
        {"PET_SIGNALS_TO_HANDLE": "TERM,KILL"},
        ("$PET_SIGNALS_TO_HANDLE", "SIGKILL", "pass names like"),
    ),
    (
        "shutdown-negative",
        ["--shutdown-timeout", "-1"],
        {},
        ("--shutdown-timeout=-1", ">= 0", "--shutdown-timeout 30"),
    ),
    ("shutdown-pet", [], {"PET_SHUTDOWN_TIMEOUT": "-5"}, ("$PET_SHUTDOWN_TIMEOUT=-5", ">= 0")),
    (
        "shutdown-env-text",
        [],
        {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"},
        ("$TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'", "fix or unset"),
    ),
    (
        "shutdown-env-nan",
        [],
        {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "nan"},
        ("$TORCH_ELASTIC_SHUTDOWN_TIMEOUT='nan'", "fix or unset"),
    ),
    (
        "shutdown-env-negative",
        [],
        {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "-1"},
        ("$TORCH_ELASTIC_SHUTDOWN_TIMEOUT='-1'", "fix or unset"),
    ),
    (
        "progress-empty",
        ["--stall-timeout", "5", "--progress-regex", ""],
        {},
        ("--progress-regex=''", "matches every line", "e.g. --progress-regex"),
    ),
    (
        "progress-dot-star",
        ["--stall-timeout", "5", "--progress-regex", ".*"],
        {},
        ("--progress-regex='.*'", "matches every line"),
    ),
    (
        "progress-invalid",
        ["--stall-timeout", "5", "--progress-regex", "("],
        {},
        ("--progress-regex='('", "not a valid regular expression"),
    ),
    (
        "stall-zero",
        ["--stall-timeout", "0"],
        {},
        ("--stall-timeout=0", "> 0", "--stall-timeout 600"),
    ),
    ("stall-inf", ["--stall-timeout", "inf"], {}, ("--stall-timeout=inf", "> 0")),
    (
        "stall-tiny",
        ["--stall-timeout", "1e-9"],
        {},
        ("--stall-timeout=1e-09", "sampling period (1 s)", "--stall-timeout 600"),
    ),
    (
        "stall-huge",
        ["--stall-timeout", "1e300"],
        {},
        ("--stall-timeout=1e+300", "longer than 30 days", "--stall-timeout 600"),
    ),
    (
        "straggler-small",
        ["--stall-timeout", "5", "--straggler-sample", "0.01"],
        {},
        ("--straggler-sample=0.01", ">= 0.1", "--straggler-sample 1"),
    ),
    (
        "straggler-nan",
        ["--stall-timeout", "5", "--straggler-sample", "nan"],
        {},
        ("--straggler-sample=nan", ">= 0.1"),
    ),
    (
        "straggler-alone",
        ["--straggler-sample", "1"],
        {},
        ("--straggler-sample needs --stall-timeout",),
    ),
    ("stall-nan", ["--stall-timeout", "nan"], {}, ("--stall-timeout=nan", "> 0")),
    (
        "on-stall-pet",
        ["--stall-timeout", "5"],
        {"PET_ON_STALL": "panic"},
        ("--on-stall", "'panic'", "$PET_ON_STALL", "observe, fail, restart"),
    ),
    (
        "start-method-pet",
        [],
        {"PET_START_METHOD": "vfork"},
        ("--start-method", "'vfork'", "$PET_START_METHOD", "spawn"),
    ),
    (
        "standalone-pet",
        [],
        {"PET_STANDALONE": "yes"},
        ("$PET_STANDALONE='yes'", "--standalone", "fix or unset"),
    ),
    ("monitor-nan", ["--monitor-interval", "nan"], {}, ("--monitor-interval=nan", "> 0")),
    ("monitor-inf", ["--monitor-interval", "inf"], {}, ("--monitor-interval=inf", "> 0")),
    ("role-empty", ["--role", ""], {}, ("--role=''", "--role trainer")),
    (
        "node-rank-negative",
        ["--nnodes", "2", "--node-rank", "-1"],
        {},
        ("--node-rank=-1", "use 0..1"),
    ),
    ("node-rank-too-big", ["--nnodes", "2", "--node-rank", "2"], {}, ("--node-rank=2", "use 0..1")),
    ("master-port", ["--master-port", "70000"], {}, ("--master-port=70000", "1..65535")),
    ("master-port-pet", [], {"PET_MASTER_PORT": "0"}, ("$PET_MASTER_PORT=0", "1..65535")),
    (
        "master-addr",
        ["--master-addr", "", "--master-port", "29555"],
        {},
        ("--master-addr=''", "--master-addr 10.0.0.1"),
    ),
    (
        "local-ranks-none",
        ["--nproc-per-node", "2", "--local-ranks-filter", "2,3"],
        {},
        ("--local-ranks-filter='2,3'", "0..1", "-r 3"),
    ),
    (
        "local-ranks-negative",
        ["--local-ranks-filter", "0,-1"],
        {},
        ("--local-ranks-filter='0,-1'", "negative"),
    ),
    (
        "dup-filter-empty",
        ["--duplicate-stdout-filters", "loss,"],
        {},
        ("--duplicate-stdout-filters='loss,'", "empty filter", "',,' escapes"),
    ),
    (
        "dup-stderr-filter-empty",
        ["--duplicate-stderr-filters", ",ERROR"],
        {},
        ("--duplicate-stderr-filters=',ERROR'", "empty filter"),
    ),
    ("run-path-module", ["--run-path", "-m"], {}, ("--run-path and --module", "drop one")),
    ("log-dir-file", ["--log-dir", "{file}"], {}, ("--log-dir=", "not a directory", "drop it")),
    (
        "log-dir-uncreatable",
        ["--log-dir", "/proc/aiolaunch-test/logs"],
        {},
        ("--log-dir='/proc/aiolaunch-test/logs'", "cannot be", "drop it"),
    ),
    ("log-dir-pet", [], {"PET_LOG_DIR": "{file}"}, ("$PET_LOG_DIR=", "not a directory")),
    # the rest of torchrun's flags (checked before this issue; the table keeps them so)
    ("nnodes", ["--nnodes", "3:1"], {}, ("--nnodes='3:1'", "e.g. --nnodes 2")),
    (
        "nproc-per-node",
        ["--nproc-per-node", "0"],
        {},
        ("--nproc-per-node='0'", "--nproc-per-node 4"),
    ),
    (
        "nproc-per-node-word",
        ["--nproc-per-node", "many"],
        {},
        ("--nproc-per-node='many'", "cpu, gpu"),
    ),
    (
        "rdzv-backend",
        ["--rdzv-backend", "etcd-typo", "--nnodes", "2"],
        {},
        ("--rdzv-backend='etcd-typo'", "c10d"),
    ),
    ("rdzv-endpoint", ["--rdzv-endpoint", "h:99999"], {}, ("--rdzv-endpoint", "0..65535")),
    (
        "rdzv-endpoint-no-port",
        ["--nnodes", "2", "--rdzv-endpoint", "h"],
        {},
        ("--rdzv-endpoint='h'", "add :PORT"),
    ),
    ("rdzv-conf", ["--rdzv-conf", "timeout"], {}, ("--rdzv-conf", "key=value")),
    ("max-restarts", ["--max-restarts", "-1"], {}, ("--max-restarts=-1", "--max-restarts 3")),
    ("redirects", ["-r", "9"], {}, ("--redirects='9'", "0:3,1:1")),
    ("tee", ["-t", "0:7"], {}, ("--tee='0:7'", "0:3,1:1")),
    (
        "event-log-handler",
        ["--event-log-handler", "bogus"],
        {},
        ("--event-log-handler='bogus'", "use one of"),
    ),
    ("logs-specs", ["--logs-specs", "bogus"], {}, ("--logs-specs='bogus'", "torchrun.logs_specs")),
    ("numa-binding", ["--numa-binding", "bogus"], {}, ("--numa-binding", "choose from")),
    ("start-method", ["--start-method", "vfork"], {}, ("--start-method", "choose from spawn")),
    (
        "on-stall",
        ["--stall-timeout", "5", "--on-stall", "panic"],
        {},
        ("--on-stall", "choose from observe"),
    ),
    ("on-stall-alone", ["--on-stall", "fail"], {}, ("--on-stall needs --stall-timeout",)),
    ("stall-timeout-word", ["--stall-timeout", "soon"], {}, ("--stall-timeout", "'soon'")),
    (
        "standalone-nnodes",
        ["--standalone", "--nnodes", "2"],
        {},
        ("--standalone", "--rdzv-backend c10d"),
    ),
    ("no-python-module", ["--no-python", "-m"], {}, ("--no-python and --module", "drop one")),
    (
        "virtual-local-rank",
        ["--virtual-local-rank", "--nproc-per-node", "2"],
        {"CUDA_VISIBLE_DEVICES": "0"},
        ("--virtual-local-rank", "start fewer workers"),
    ),
    ("exit-code", ["--exit-code", "retry"], {}, ("--exit-code", "choose from torchrun")),
    (
        "metrics-port",
        ["--metrics-port", "70000"],
        {},
        ("--metrics-port=70000", "--metrics-port 9400"),
    ),
    (
        "metrics-port-pet",
        [],
        {"PET_METRICS_PORT": "-1"},
        ("$PET_METRICS_PORT=-1", "0 for any free port"),
    ),
    (
        "metrics-host",
        ["--metrics-port", "0", "--metrics-host", ""],
        {},
        ("--metrics-host=''", "0.0.0.0"),
    ),
    (
        "metrics-host-alone",
        ["--metrics-host", "0.0.0.0"],
        {},
        ("--metrics-host needs --metrics-port",),
    ),
    ("preload-empty", ["--preload", ","], {}, ("--preload=','", "names no module", "--no-preload")),
    ("preload-missing", ["--preload", "no_such_module_x"], {}, ("--preload", "'no_such_module_x'")),
    ("no-preload-pet", [], {"PET_NO_PRELOAD": "yes"}, ("$PET_NO_PRELOAD='yes'", "--no-preload on")),
    (
        "exit-code-pet",
        [],
        {"PET_EXIT_CODE": "root_cause"},
        ("--exit-code", "'root_cause' (from $PET_EXIT_CODE)", "root-cause"),
    ),
    # resilience across hosts (#45)
    (
        "quarantine-after-zero",
        ["--quarantine-after", "0"],
        {},
        ("--quarantine-after=0", ">= 1", "--quarantine-after 2"),
    ),
    (
        "quarantine-one-machine",
        ["--quarantine-after", "2"],
        {},
        ("--quarantine-after", "--rdzv-backend c10d or etcd-v3"),
    ),
    (
        "quarantine-window-alone",
        ["--quarantine-window", "5"],
        {},
        ("--quarantine-window needs --quarantine-after N",),
    ),
    (
        "quarantine-ttl-alone",
        ["--quarantine-ttl", "60"],
        {},
        ("--quarantine-ttl needs --quarantine-after N",),
    ),
    ("health-check-empty", ["--health-check", ""], {}, ("--health-check=''", "pass a command")),
    (
        "health-check-timeout-alone",
        ["--health-check-timeout", "5"],
        {},
        ("--health-check-timeout needs --health-check CMD",),
    ),
    (
        "no-progress-zero",
        ["--max-no-progress-restarts", "0"],
        {},
        ("--max-no-progress-restarts=0", ">= 1"),
    ),
    (
        "no-progress-without-regex",
        ["--max-no-progress-restarts", "3"],
        {},
        ("--max-no-progress-restarts needs --progress-regex",),
    ),
    (
        "restart-resources-relative",
        ["--restart-resources", "dev/x"],
        {},
        ("--restart-resources", "'dev/x'", "absolute path"),
    ),
    (
        "restart-resources-port",
        ["--restart-resources", "port:x"],
        {},
        ("--restart-resources", "'port:x'", "port:29500"),
    ),
]


#: options where any value is valid (a user-defined id, an address to advertise)
ANY_VALUE = {"--help", "--rdzv-id", "--local-addr"}


def test_every_flag_of_the_parser_has_a_bad_value_case() -> None:
    # A new flag needs its row in CLI_CASES (or a reason in ANY_VALUE).
    import re

    from aiolaunch._cli import get_args_parser

    found = re.findall(r"(--[a-z][a-z_-]+)", get_args_parser().format_help())
    # the underscore spellings are aliases; "--no-" is "--no-python" cut by the wrapping
    flags = {f for f in found if "_" not in f and not f.endswith("-")}
    covered = {f for _, argv, _, _ in CLI_CASES for f in argv if f.startswith("--")}
    covered |= {
        "--" + k[len("PET_") :].lower().replace("_", "-")
        for _, _, env, _ in CLI_CASES
        for k in env
        if k.startswith("PET_")
    }
    covered |= {"--module", "--no-python", "--tee", "--redirects"}  # as -m, -r, -t above
    assert flags - covered - ANY_VALUE == set()


def _case_ids() -> list[str]:
    return [c[0] for c in CLI_CASES]


@pytest.fixture
def cli_env(
    tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[dict[str, str]], None]]:
    """A clean environment for in-process ``main()``: no PET_* or signal
    variables of the runner, the current folder ``tmp_path``; main()'s log
    handler is removed afterwards."""
    for key in list(os.environ):
        if key.startswith("PET_") or key in (
            "AIOLAUNCH_FORWARD_SIGNALS",
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            "PYTHON_EXEC",
            "CUDA_VISIBLE_DEVICES",
        ):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    logger = logging.getLogger("aiolaunch")
    handlers = list(logger.handlers)

    def setenv(env: dict[str, str]) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    yield setenv
    for h in logger.handlers[:]:
        if h not in handlers:
            logger.removeHandler(h)


def _run_main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


@pytest.mark.parametrize(("case", "flags", "env", "needles"), CLI_CASES, ids=_case_ids())
def test_bad_flag_exits_2_naming_the_flag_and_the_fix(
    case: str,
    flags: list[str],
    env: dict[str, str],
    needles: tuple[str, ...],
    tmp_path: Path,
    private_tmp: Path,
    cli_env: Callable[[dict[str, str]], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    if case == "rdzv-backend":
        pytest.importorskip("torch")  # without it: "needs torch" (tested elsewhere)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cli_env({k: v.replace("{file}", str(a_file)) for k, v in env.items()})
    (tmp_path / "train.py").write_text(SCRIPT)
    marker = tmp_path / "ran"
    argv = [f.replace("{file}", str(a_file)) for f in flags] + ["train.py", str(marker)]
    if case == "run-path-module":
        argv = [*flags, "train", str(marker)]
    assert _run_main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert not marker.exists()
    assert os.listdir(private_tmp) == []
    assert not os.path.exists("/proc/aiolaunch-test")


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--forward-signals", "SIGUSR3"], ("--forward-signals", "'SIGUSR3'", "pass names like")),
        (["--shutdown-timeout", "-1"], ("--shutdown-timeout=-1", "--shutdown-timeout 30")),
        (
            ["--no-python", "no-such-binary-aiolaunch"],
            ("--no-python", "not found on PATH", "full path"),
        ),
        (["--no-python", "./missing-binary"], ("--no-python", "'./missing-binary' does not exist")),
        (["--no-python", "./train.py"], ("--no-python", "not executable", "chmod +x")),
        ([], ("the script 'missing.py' does not exist", "give its path", "-m")),
    ],
    ids=[
        "forward-signals",
        "shutdown-timeout",
        "no-python-path",
        "no-python-file",
        "no-python-mode",
        "missing-script",
    ],
)
def test_the_real_command_line_fails_before_anything_starts(
    flags: list[str], needles: tuple[str, ...], tmp_path: Path
) -> None:
    # End to end: `aiolaunch` as a user runs it. Exit 2 (argparse's status
    # for bad options; python's for a missing script), one line, no traceback.
    flags = list(flags)
    (tmp_path / "train.py").write_text(SCRIPT)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = tmp_path / "ran"
    script = "missing.py" if not flags else "train.py"
    if flags[:1] == ["--no-python"]:
        script = flags.pop()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        [*AIOLAUNCH, *flags, script, str(marker)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("aiolaunch: error: ") and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, f"{needle!r} not in {r.stderr!r}"
    assert not marker.exists()
    assert os.listdir(tmp) == []


@pytest.mark.parametrize(
    ("timeout", "why"),
    [("-1", "'-1'"), ("0", "'0'"), ("inf", "'inf'"), ("nan", "'nan'"), ("x", "'x'")],
)
def test_stacks_timeout_is_checked_by_the_command_line(
    timeout: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["stacks", "--timeout", timeout])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --timeout" in err and why in err and "e.g. --timeout 5" in err


# -- the Python API ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "needles"),
    [
        (
            lambda: aiolaunch.Watchdog(stall_after=5, progress=""),
            ValueError,
            ("progress=''", "matches every line", "progress=r'^step"),
        ),
        (
            lambda: aiolaunch.Watchdog(stall_after=5, progress="x?"),
            ValueError,
            ("progress='x?'", "matches every line"),
        ),
        (
            lambda: aiolaunch.Watchdog(stall_after=1e-9),
            ValueError,
            ("stall_after=1e-09", "sampling period (1 s)", "stall_after=600"),
        ),
        (
            lambda: aiolaunch.Watchdog(stall_after=1e300),
            ValueError,
            ("stall_after=1e+300", "longer than 30 days", "watchdog=None"),
        ),
        (
            lambda: aiolaunch.set_console_hook(NOT_A_HOOK),
            TypeError,
            ("set_console_hook(5)", "callable", "None"),
        ),
        (
            lambda: WorkerSpec(
                role="r", local_world_size=1, entrypoint="/bin/true", monitor_interval=math.nan
            ),
            ValueError,
            ("monitor_interval=nan", "> 0"),
        ),
        (
            lambda: WorkerSpec(
                role="r", local_world_size=1, entrypoint="/bin/true", monitor_interval=math.inf
            ),
            ValueError,
            ("monitor_interval=inf", "> 0"),
        ),
        (
            lambda: WorkerSpec(
                role="r", local_world_size=1, entrypoint="/bin/true", master_port=True
            ),
            ValueError,
            ("master_port=True", "1..65535"),
        ),
        (
            lambda: LocalElasticAgent(
                WorkerSpec(role="r", local_world_size=1, entrypoint="/bin/true"),
                shutdown_timeout=math.nan,
            ),
            ValueError,
            ("shutdown_timeout=nan", ">= 0"),
        ),
        (
            lambda: aiolaunch.start_processes("n" * 240, "/bin/true", {0: ()}, {0: {}}),
            ValueError,
            ("240 bytes long", "shorter name", "log_dir"),
        ),
    ],
    ids=[
        "progress-empty",
        "progress-optional",
        "stall-after-tiny",
        "stall-after-huge",
        "console-hook",
        "monitor-nan",
        "monitor-inf",
        "master-port-bool",
        "agent-shutdown-nan",
        "long-name",
    ],
)
def test_bad_public_argument_raises_naming_it(
    make: Callable[[], Any], error: type[Exception], needles: tuple[str, ...], private_tmp: Path
) -> None:
    with pytest.raises(error) as exc:
        make()
    for needle in needles:
        assert needle in str(exc.value), f"{needle!r} not in {exc.value}"
    assert os.listdir(private_tmp) == []


def test_bad_forward_signals_environment_raises_before_anything_starts(
    tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # $AIOLAUNCH_FORWARD_SIGNALS is aiolaunch's own: a typo raises like the
    # keyword (it would let the preemption signal kill the supervisor);
    # torch's $TORCHELASTIC_SIGNALS_TO_HANDLE still only warns, as in torch.
    monkeypatch.setenv("AIOLAUNCH_FORWARD_SIGNALS", "SIGUSR1,SIGUSR9")
    with pytest.raises(ValueError, match=r"\$AIOLAUNCH_FORWARD_SIGNALS: 'SIGUSR9'.*pass names"):
        aiolaunch.start_processes("f", "/bin/true", {0: ()}, {0: {}}, log_dir=tmp_path / "l")
    assert not (tmp_path / "l").exists() and os.listdir(private_tmp) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "needles"),
    [
        ({"timeout": True}, ValueError, ("dump_stacks(timeout)=True", "finite number", "e.g. 5")),
        ({"timeout": math.inf}, ValueError, ("dump_stacks(timeout)=inf", "finite number")),
        ({"timeout": math.nan}, ValueError, ("dump_stacks(timeout)=nan",)),
        ({"timeout": 0}, ValueError, ("dump_stacks(timeout)=0",)),
        ({"ranks": 0}, TypeError, ("ranks=0", "a list of local ranks")),
        ({"ranks": [True]}, ValueError, ("ranks=[True]", "0..0")),
    ],
    ids=["bool", "inf", "nan", "zero", "int-ranks", "bool-rank"],
)
async def test_dump_stacks_arguments_are_checked(
    kwargs: dict[str, Any], error: type[Exception], needles: tuple[str, ...], tmp_path: Path
) -> None:
    ctx = await aiolaunch.start_processes(
        "d", "/bin/sh", {0: ("-c", "sleep 30")}, {0: {}}, log_dir=tmp_path
    )
    try:
        with pytest.raises(error) as exc:
            await asyncio.wait_for(ctx.dump_stacks(**kwargs), 10)
        for needle in needles:
            assert needle in str(exc.value), f"{needle!r} not in {exc.value}"
    finally:
        await ctx.close(timeout=5)
