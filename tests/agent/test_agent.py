"""LocalElasticAgent with real worker processes (no torch needed)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _helpers import alive
from aiolaunch import Std
from aiolaunch.agent import LocalElasticAgent, RunResult, WorkerSpec, WorkerState

# A worker script: records its view of the world, then fails while
# TORCHELASTIC_RESTART_COUNT < succeed_at (rank 1 only), else exits 0.
RECORDER = textwrap.dedent(
    """
    import json, os, sys
    out, succeed_at = sys.argv[1], int(sys.argv[2])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")
    env = {k: os.environ.get(k) for k in keys}
    attempt = int(env["TORCHELASTIC_RESTART_COUNT"])
    path = os.path.join(out, f"attempt{attempt}_rank{env['RANK']}.json")
    with open(path, "w") as f:
        json.dump(env, f)
    print(f"hello from rank {env['RANK']} attempt {attempt}", flush=True)
    if env["RANK"] == "1" and attempt < succeed_at:
        # Fail only once rank 0 has recorded this attempt (fail-fast would stop it).
        import time
        peer = os.path.join(out, f"attempt{attempt}_rank0.json")
        deadline = time.monotonic() + 20
        while not os.path.exists(peer) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        print(f"rank 1 fails in attempt {attempt}", file=sys.stderr, flush=True)
        sys.exit(3)
    """
)


def _script(tmp_path: Path, name: str, code: str) -> str:
    path = tmp_path / name
    path.write_text(code)
    return str(path)


def _records(out: Path) -> dict[str, dict[str, str]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def env_view(tag: str) -> dict[str, str]:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT")
    return {"tag": tag, **{k: os.environ[k] for k in keys}}


def fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 cannot go on: boom")
    time.sleep(30)


async def test_function_workers_succeed_with_results_by_global_rank(tmp_path: Path) -> None:
    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint=env_view, args=("x",))
    agent = LocalElasticAgent(spec, log_dir=tmp_path)
    result = await asyncio.wait_for(agent.run(), 60)
    assert isinstance(result, RunResult)
    assert result.state == WorkerState.SUCCEEDED
    assert not result.is_failed()
    assert result.failures == {}
    assert set(result.return_values) == {0, 1}
    for rank, value in result.return_values.items():
        assert value == {
            "tag": "x",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "ROLE_NAME": "trainer",
            "TORCHELASTIC_RESTART_COUNT": "0",
        }
    assert agent.state == WorkerState.SUCCEEDED
    assert agent.restart_count == 0


async def test_restarts_until_success_and_workers_see_restart_count(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, "rec.py", RECORDER)
    spec = WorkerSpec(
        role="w",
        local_world_size=2,
        entrypoint=sys.executable,
        args=(script, str(out), "2"),
        max_restarts=3,
        redirects=Std.ALL,
    )
    agent = LocalElasticAgent(spec, log_dir=tmp_path / "logs")
    result = await asyncio.wait_for(agent.run(), 60)
    assert result.state == WorkerState.SUCCEEDED, result.failures
    assert result.return_values == {0: None, 1: None}
    assert agent.restart_count == 2
    recs = _records(out)
    assert sorted(recs) == [f"attempt{k}_rank{r}" for k in range(3) for r in range(2)]
    for name, env in recs.items():
        assert name.startswith(f"attempt{env['TORCHELASTIC_RESTART_COUNT']}_")
        assert env["TORCHELASTIC_RUN_ID"] == agent.run_id

    # per-attempt logs: {log_dir}/{run_id}_<unique>/attempt_{k}/{rank}/
    run_dir = Path(agent.run_log_dir or "")
    assert run_dir.parent == tmp_path / "logs"
    assert run_dir.name.startswith(f"{agent.run_id}_")
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt_0", "attempt_1", "attempt_2"]
    for k in range(3):
        for rank in range(2):
            stdout = (run_dir / f"attempt_{k}" / str(rank) / "stdout.log").read_text()
            assert stdout == f"hello from rank {rank} attempt {k}\n"
            env = recs[f"attempt{k}_rank{rank}"]
            assert env["TORCHELASTIC_ERROR_FILE"] == str(
                run_dir / f"attempt_{k}" / str(rank) / "error.json"
            )
    assert "rank 1 fails in attempt 1" in (run_dir / "attempt_1" / "1" / "stderr.log").read_text()


async def test_final_failure_reports_the_root_cause(tmp_path: Path) -> None:
    spec = WorkerSpec(role="w", local_world_size=2, entrypoint=fail_on_rank_one, max_restarts=1)
    agent = LocalElasticAgent(spec, log_dir=tmp_path, shutdown_timeout=5)
    t0 = time.monotonic()
    result = await asyncio.wait_for(agent.run(), 60)
    # exits are events: two attempts with a 30 s sleeper must not take 30 s
    assert time.monotonic() - t0 < 20
    assert result.state == WorkerState.FAILED
    assert result.is_failed()
    assert agent.restart_count == 1
    assert set(result.failures) == {1}  # the sleeper stopped on purpose is no failure
    failure = result.failures[1]
    assert failure.local_rank == 1
    # torch's shape: the error file's "message" (here the nested dict format)
    assert "ValueError: rank 1 cannot go on: boom" in str(failure.message)
    assert failure.error_file.endswith(os.path.join("attempt_1", "1", "error.json"))

    from aiolaunch import ChildFailedError

    summary = ChildFailedError("fail_on_rank_one", result.failures).format_msg()
    assert "fail_on_rank_one" in summary
    assert "boom" in summary


async def test_local_rank_macro_is_substituted_per_worker(tmp_path: Path) -> None:
    code = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"
    script = _script(tmp_path, "w.py", code)
    target = str(tmp_path / "r${local_rank}.txt")
    spec = WorkerSpec(
        role="w",
        local_world_size=3,
        entrypoint=sys.executable,
        args=(script, target, "lr=${local_rank}"),
    )
    result = await asyncio.wait_for(LocalElasticAgent(spec, log_dir=tmp_path / "l").run(), 60)
    assert result.state == WorkerState.SUCCEEDED
    for r in range(3):
        assert (tmp_path / f"r{r}.txt").read_text() == f"lr={r}"


async def test_log_dir_is_reusable_across_runs(tmp_path: Path) -> None:
    script = _script(tmp_path, "ok.py", "print('ok')")
    spec = WorkerSpec(
        role="w", local_world_size=1, entrypoint=sys.executable, args=(script,), redirects=Std.OUT
    )
    a1 = LocalElasticAgent(spec, log_dir=tmp_path / "logs")
    a2 = LocalElasticAgent(spec, log_dir=tmp_path / "logs")
    assert (await a1.run()).state == WorkerState.SUCCEEDED
    assert (await a2.run()).state == WorkerState.SUCCEEDED
    assert a1.run_log_dir != a2.run_log_dir
    for agent in (a1, a2):
        log = Path(agent.run_log_dir or "") / "attempt_0" / "0" / "stdout.log"
        assert log.read_text() == "ok\n"


async def test_restart_backoff_waits_between_attempts(tmp_path: Path) -> None:
    script = _script(tmp_path, "fail.py", "import sys; sys.exit(1)")
    spec = WorkerSpec(
        role="w", local_world_size=1, entrypoint=sys.executable, args=(script,), max_restarts=2
    )
    agent = LocalElasticAgent(spec, log_dir=tmp_path, restart_backoff=0.4, restart_backoff_max=0.5)
    t0 = time.monotonic()
    result = await asyncio.wait_for(agent.run(), 60)
    elapsed = time.monotonic() - t0
    assert result.state == WorkerState.FAILED
    assert result.failures[0].exitcode == 1
    # 0.4 s before restart 1, min(0.5, 0.8) before restart 2
    assert elapsed >= 0.9


async def test_cancelling_run_stops_the_workers(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os, sys, time
        path = os.path.join(sys.argv[1], f"{os.environ['LOCAL_RANK']}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # atomic: the test never reads it empty
        time.sleep(60)
        """
    )
    script = _script(tmp_path, "sleep.py", code)
    spec = WorkerSpec(
        role="w", local_world_size=2, entrypoint=sys.executable, args=(script, str(tmp_path))
    )
    agent = LocalElasticAgent(spec, log_dir=tmp_path / "logs", shutdown_timeout=5)
    task = asyncio.ensure_future(agent.run())
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.pid"))) < 2:
        assert time.monotonic() < deadline, "workers did not start"
        await asyncio.sleep(0.05)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert all(alive(pid) for pid in pids)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 15)
    assert not any(alive(pid) for pid in pids)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"start_method": "thread"}, ValueError, "start_method"),
        ({"exit_barrier_timeout": -1}, ValueError, "exit_barrier_timeout"),
        ({"restart_backoff": -1}, ValueError, "restart_backoff"),
    ],
)
def test_agent_rejects_bad_input(
    kwargs: dict[str, object], exc: type[Exception], match: str
) -> None:
    spec = WorkerSpec(role="w", local_world_size=1, entrypoint="true")
    with pytest.raises(exc, match=match):
        LocalElasticAgent(spec, **kwargs)  # type: ignore[arg-type]


def test_agent_rejects_a_file_as_log_dir(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    spec = WorkerSpec(role="w", local_world_size=1, entrypoint="true")
    with pytest.raises(NotADirectoryError, match="log_dir"):
        LocalElasticAgent(spec, log_dir=f)


def test_unknown_rdzv_handler_is_rejected() -> None:
    spec = WorkerSpec(role="w", local_world_size=1, entrypoint="true", rdzv_handler=object())
    with pytest.raises(TypeError, match="rdzv_handler"):
        LocalElasticAgent(spec)
