"""The worker environment contract (unit tests of the pure parts)."""

from __future__ import annotations

import socket

import pytest

from aiolaunch.agent import StaticRendezvous, WorkerSpec
from aiolaunch.agent._env import (
    OMP_NOTICE,
    GroupAssignment,
    omp_notice,
    substitute_local_rank,
    worker_envs,
)

CONTRACT_KEYS = {
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}


def _assignment(**kw: object) -> GroupAssignment:
    base: dict[str, object] = {
        "group_rank": 0,
        "group_world_size": 1,
        "base_global_rank": 0,
        "global_world_size": 2,
        "base_role_rank": 0,
        "role_world_size": 2,
        "master_addr": "127.0.0.1",
        "master_port": 29501,
        "run_id": "run-1",
        "use_agent_store": False,
    }
    base.update(kw)
    return GroupAssignment(**base)  # type: ignore[arg-type]


def test_single_node_env_has_every_contract_key() -> None:
    envs = worker_envs(
        role="trainer",
        local_world_size=2,
        assignment=_assignment(),
        restart_count=0,
        max_restarts=3,
        environ={"OMP_NUM_THREADS": "4"},
    )
    assert set(envs) == {0, 1}
    for local_rank, env in envs.items():
        assert set(env) == CONTRACT_KEYS | {"OMP_NUM_THREADS"}
        assert env["LOCAL_RANK"] == env["RANK"] == env["ROLE_RANK"] == str(local_rank)
        assert env["GROUP_RANK"] == "0"
        assert env["ROLE_NAME"] == "trainer"
        assert env["LOCAL_WORLD_SIZE"] == env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["GROUP_WORLD_SIZE"] == "1"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29501")
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert env["TORCHELASTIC_RUN_ID"] == "run-1"
        # torch writes str(bool): the exact spelling matters to its workers
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["OMP_NUM_THREADS"] == "4"
        assert all(isinstance(v, str) for v in env.values())


def test_second_node_of_a_multi_node_world() -> None:
    a = _assignment(
        group_rank=1,
        group_world_size=2,
        base_global_rank=3,
        global_world_size=5,
        base_role_rank=1,
        role_world_size=4,
        use_agent_store=True,
    )
    envs = worker_envs(
        role="r", local_world_size=2, assignment=a, restart_count=2, max_restarts=2, environ={}
    )
    assert [envs[i]["RANK"] for i in (0, 1)] == ["3", "4"]
    assert [envs[i]["ROLE_RANK"] for i in (0, 1)] == ["1", "2"]
    assert [envs[i]["LOCAL_RANK"] for i in (0, 1)] == ["0", "1"]
    assert envs[1]["WORLD_SIZE"] == "5"
    assert envs[1]["ROLE_WORLD_SIZE"] == "4"
    assert envs[1]["GROUP_RANK"] == "1"
    assert envs[1]["GROUP_WORLD_SIZE"] == "2"
    assert envs[1]["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert envs[1]["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_omp_num_threads_is_one_when_unset_and_several_workers() -> None:
    envs = worker_envs(
        role="r",
        local_world_size=2,
        assignment=_assignment(),
        restart_count=0,
        max_restarts=0,
        environ={},
    )
    assert envs[0]["OMP_NUM_THREADS"] == envs[1]["OMP_NUM_THREADS"] == "1"
    assert omp_notice(2, {}) == OMP_NOTICE
    assert "OMP_NUM_THREADS" in OMP_NOTICE


def test_omp_num_threads_left_alone_for_one_worker_or_when_set() -> None:
    one = worker_envs(
        role="r",
        local_world_size=1,
        assignment=_assignment(global_world_size=1, role_world_size=1),
        restart_count=0,
        max_restarts=0,
        environ={},
    )
    assert "OMP_NUM_THREADS" not in one[0]
    assert omp_notice(1, {}) is None
    assert omp_notice(4, {"OMP_NUM_THREADS": "8"}) is None


def test_nccl_async_error_handling_passes_through() -> None:
    envs = worker_envs(
        role="r",
        local_world_size=1,
        assignment=_assignment(),
        restart_count=0,
        max_restarts=0,
        environ={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
    )
    assert envs[0]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_restart_count_beyond_max_restarts_is_rejected() -> None:
    with pytest.raises(ValueError, match="restart_count"):
        worker_envs(
            role="r",
            local_world_size=1,
            assignment=_assignment(),
            restart_count=2,
            max_restarts=1,
            environ={},
        )


def test_local_rank_macro_substitution() -> None:
    args = ("--out=/tmp/r${local_rank}.txt", 7, "${local_rank}", "cost$$5", "$local_rankx")
    assert substitute_local_rank(args, 3) == (
        "--out=/tmp/r3.txt",
        7,
        "3",
        "cost$$5",
        "$local_rankx",
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local_world_size": 0}, "local_world_size"),
        ({"role": ""}, "role"),
        ({"entrypoint": 3}, "entrypoint"),
        ({"args": ["a"]}, "args"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"monitor_interval": 0}, "monitor_interval"),
        ({"master_port": 70000}, "master_port"),
        ({"redirects": {5: 0}}, "redirects"),
    ],
)
def test_worker_spec_rejects_bad_input(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"role": "r", "local_world_size": 2, "entrypoint": "echo"}
    base.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        WorkerSpec(**base)  # type: ignore[arg-type]


async def test_static_rendezvous_is_one_group_on_a_free_port() -> None:
    rdzv = StaticRendezvous(run_id="abc")
    a = await rdzv.next_rendezvous(role="r", local_world_size=3, master_addr=None, master_port=None)
    assert (a.group_rank, a.group_world_size) == (0, 1)
    assert (a.base_global_rank, a.global_world_size) == (0, 3)
    assert (a.base_role_rank, a.role_world_size) == (0, 3)
    assert a.run_id == rdzv.run_id == "abc"
    assert a.master_addr == "127.0.0.1"
    assert a.use_agent_store is False
    # the port is free: a worker can bind it
    with socket.socket() as s:
        s.bind(("127.0.0.1", a.master_port))
    fixed = await StaticRendezvous(master_port=4242).next_rendezvous(
        role="r", local_world_size=1, master_addr="10.0.0.1", master_port=None
    )
    assert (fixed.master_addr, fixed.master_port) == ("10.0.0.1", 4242)


def test_static_rendezvous_default_run_id_is_unique() -> None:
    assert StaticRendezvous().run_id != StaticRendezvous().run_id
    with pytest.raises(ValueError, match="master_port"):
        StaticRendezvous(master_port=0)
