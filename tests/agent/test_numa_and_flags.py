"""The agent's torch-parity fields: NUMA binding, virtual local rank, duplicate filters.

Real worker processes; the CPU affinity each worker gets is read in the worker.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import pytest

import aiolaunch
from aiolaunch import Std
from aiolaunch.agent import LocalElasticAgent, WorkerSpec, WorkerState
from aiolaunch.agent._env import GroupAssignment, worker_envs
from aiolaunch.agent._numa import NumaBindingError, _ranges, numa_cpus, wrap_for_numa

if TYPE_CHECKING:
    from pathlib import Path

needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="needs sched_getaffinity (Linux)"
)


def my_affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def test_cpu_lists_in_numactl_syntax() -> None:
    assert _ranges({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert _ranges({5}) == "5"


def test_binaries_run_under_numactl_with_their_own_cpus() -> None:
    entry, args = wrap_for_numa("/bin/prog", {0: ("a",), 1: ("b",)}, {0: {0, 1}, 1: {2, 3}})
    assert entry == "numactl"
    assert args == {
        0: ("--physcpubind=0-1", "/bin/prog", "a"),
        1: ("--physcpubind=2-3", "/bin/prog", "b"),
    }
    # nothing to bind: unchanged
    assert wrap_for_numa("/bin/prog", {0: ()}, {}) == ("/bin/prog", {0: ()})


@needs_affinity
async def test_function_workers_get_exactly_their_cpus(tmp_path: Path) -> None:
    cpus = my_affinity()
    plan = {0: {cpus[0]}, 1: {cpus[-1]}}
    entry, args = wrap_for_numa(my_affinity, {0: (), 1: ()}, plan)
    async with aiolaunch.start_processes(
        name="numa", entrypoint=entry, args=args, envs={0: {}, 1: {}}, log_dir=tmp_path
    ) as ctx:
        result = await ctx.wait()
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: [cpus[0]], 1: [cpus[-1]]}


def _cpu_only() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CPU-only behaviour cannot be shown here")


def test_cpu_only_binding_fails_with_torchs_error_as_cause() -> None:
    _cpu_only()
    from torch.numa.binding import AffinityMode, NumaOptions

    with pytest.raises(NumaBindingError, match="cannot bind local_rank 0") as info:
        numa_cpus(NumaOptions(affinity_mode=AffinityMode.NODE), 2)
    assert info.value.__cause__ is not None


@needs_affinity
async def test_fallback_runs_workers_unbound(tmp_path: Path) -> None:
    _cpu_only()
    from torch.numa.binding import AffinityMode, NumaOptions

    options = NumaOptions(affinity_mode=AffinityMode.NODE, should_fall_back_if_binding_fails=True)
    spec = WorkerSpec(role="numa", local_world_size=2, entrypoint=my_affinity, numa_options=options)
    result = await LocalElasticAgent(spec, log_dir=tmp_path).run()
    assert result.state == WorkerState.SUCCEEDED
    assert result.return_values == {0: my_affinity(), 1: my_affinity()}


def _assignment() -> GroupAssignment:
    return GroupAssignment(
        group_rank=0,
        group_world_size=1,
        base_global_rank=0,
        global_world_size=3,
        base_role_rank=0,
        role_world_size=3,
        master_addr="h",
        master_port=1,
        run_id="r",
        use_agent_store=False,
    )


def _envs(environ: dict[str, str], virtual: bool = True) -> list[dict[str, str]]:
    envs = worker_envs(
        role="t",
        local_world_size=3,
        assignment=_assignment(),
        restart_count=0,
        max_restarts=0,
        environ=environ,
        virtual_local_rank=virtual,
    )
    return list(envs.values())


def test_virtual_local_rank_env_contract() -> None:
    envs = _envs({})
    assert [(e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [
        ("0", "0"),
        ("0", "1"),
        ("0", "2"),
    ]
    envs = _envs({"CUDA_VISIBLE_DEVICES": "4, 6,9"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4", "6", "9"]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="exceeds the devices"):
        _envs({"CUDA_VISIBLE_DEVICES": "4"})
    plain = _envs({}, virtual=False)
    assert [e["LOCAL_RANK"] for e in plain] == ["0", "1", "2"]
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in plain)


async def test_agent_duplicate_filters_write_per_attempt(tmp_path: Path) -> None:
    code = "import os; print('loss', os.environ['RANK']); print('noise')"
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        entrypoint=sys.executable,
        args=("-c", code),
        tee=Std.OUT,
        duplicate_stdout_filters=["loss"],
    )
    agent = LocalElasticAgent(spec, log_dir=tmp_path)
    result = await agent.run()
    assert result.state == WorkerState.SUCCEEDED
    assert agent.run_log_dir is not None
    path = os.path.join(agent.run_log_dir, "attempt_0", "filtered_stdout.log")
    with open(path) as f:
        assert sorted(f.read().splitlines()) == ["[trainer0]:loss 0", "[trainer1]:loss 1"]
