"""The worker environment contract of torchrun, as one pure function.

Kept free of I/O and of the process machinery so that a test can pin the
contract key by key (``tests/agent/test_env.py``) and compare it with what
real ``torchrun`` gives (``tests/agent/test_torchrun_env.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["GroupAssignment", "omp_notice", "shared_env", "substitute_local_rank", "worker_envs"]

LOCAL_RANK_MACRO = "${local_rank}"

OMP_NOTICE = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
    "to avoid your system being overloaded, please further tune the variable for optimal "
    "performance in your application as needed. \n"
    "*****************************************"
)


@dataclass(frozen=True)
class GroupAssignment:
    """What one rendezvous decided for this agent's worker group.

    Worker ``local_rank`` gets global rank ``base_global_rank + local_rank``
    and role rank ``base_role_rank + local_rank`` (torch's layout: each agent
    owns a contiguous block of ranks).
    """

    group_rank: int
    group_world_size: int
    base_global_rank: int
    global_world_size: int
    base_role_rank: int
    role_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    use_agent_store: bool
    #: the rendezvous round this assignment is of (the job's records key on it)
    rdzv_round: int = 0


def worker_envs(
    *,
    role: str,
    local_world_size: int,
    assignment: GroupAssignment,
    restart_count: int,
    max_restarts: int,
    environ: Mapping[str, str],
    virtual_local_rank: bool = False,
) -> dict[int, dict[str, str]]:
    """Build ``{local_rank: env}`` exactly as torchrun's agent does.

    The result holds only the keys the agent sets; ``start_processes`` lays
    them over the parent's environment (and adds ``TORCHELASTIC_ERROR_FILE``).

    :param role: ``ROLE_NAME``.
    :param local_world_size: workers on this machine.
    :param assignment: the rendezvous outcome (ranks, sizes, master, run id).
    :param restart_count: ``TORCHELASTIC_RESTART_COUNT``: 0 for the first
        attempt, ``k`` for the ``k``-th restart.
    :param max_restarts: ``TORCHELASTIC_MAX_RESTARTS``.
    :param environ: the agent's environment (normally ``os.environ``):
        ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (default ``"1"``) and
        ``OMP_NUM_THREADS`` are read from it. ``OMP_NUM_THREADS`` passes
        through; when unset and ``local_world_size > 1`` it is ``"1"``, as
        torchrun sets it (see :func:`omp_notice` for the notice to show).
        ``CUDA_VISIBLE_DEVICES`` is read too (``virtual_local_rank``).
    :param virtual_local_rank: torch's virtual local rank mode: ``LOCAL_RANK``
        is ``"0"`` for every worker and ``CUDA_VISIBLE_DEVICES`` names only
        the worker's own device (entry ``local_rank`` of the agent's list,
        else ``local_rank``).
    :raises ValueError: with ``virtual_local_rank``, more workers than
        devices in the agent's ``CUDA_VISIBLE_DEVICES``.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size!r} must be >= 1")
    if not 0 <= restart_count <= max_restarts:
        raise ValueError(
            f"restart_count={restart_count!r} must be in 0..max_restarts ({max_restarts})"
        )
    a = assignment
    shared = shared_env(local_world_size, environ)
    envs: dict[int, dict[str, str]] = {}
    for local_rank in range(local_world_size):
        env = {
            "LOCAL_RANK": str(local_rank),
            "RANK": str(a.base_global_rank + local_rank),
            "GROUP_RANK": str(a.group_rank),
            "ROLE_RANK": str(a.base_role_rank + local_rank),
            "ROLE_NAME": role,
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "WORLD_SIZE": str(a.global_world_size),
            "GROUP_WORLD_SIZE": str(a.group_world_size),
            "ROLE_WORLD_SIZE": str(a.role_world_size),
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(a.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": a.run_id,
            # str(bool): "True"/"False", the spelling torch's workers parse.
            "TORCHELASTIC_USE_AGENT_STORE": str(a.use_agent_store),
            **shared,
        }
        if virtual_local_rank:
            env["LOCAL_RANK"] = "0"
            env["CUDA_VISIBLE_DEVICES"] = _visible_device(local_rank, environ)
        envs[local_rank] = env
    return envs


def shared_env(local_world_size: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The part of :func:`worker_envs` that is the same for every worker of every attempt.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (``"1"`` unless ``environ`` sets it) and
    ``OMP_NUM_THREADS`` (passed through; ``"1"`` when unset and
    ``local_world_size > 1``). Both are read when a library loads, so a warm
    start's zygote is started with them too.
    """
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    omp = environ.get("OMP_NUM_THREADS")
    if omp is None and local_world_size > 1:
        # torchrun puts OMP_NUM_THREADS=1 in its own os.environ (run.py,
        # config_from_args) so that every worker inherits it; we set it per
        # worker instead and leave the agent's environment alone.
        omp = "1"
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return env


def _visible_device(local_rank: int, environ: Mapping[str, str]) -> str:
    parent = environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return str(local_rank)
    devices = parent.split(",")
    if local_rank >= len(devices):
        raise ValueError(
            f"--virtual-local-rank: local_rank {local_rank} exceeds the devices in "
            f"CUDA_VISIBLE_DEVICES={parent} ({len(devices)}); start fewer workers per node"
        )
    return devices[local_rank].strip()


def omp_notice(local_world_size: int, environ: Mapping[str, str]) -> str | None:
    """The notice torchrun prints when it sets ``OMP_NUM_THREADS=1``, or ``None``."""
    if "OMP_NUM_THREADS" not in environ and local_world_size > 1:
        return OMP_NOTICE
    return None


def substitute_local_rank(args: tuple[object, ...], local_rank: int) -> tuple[object, ...]:
    """Replace ``${local_rank}`` in every str argument (torch's ``macros.substitute``).

    Only the ``${local_rank}`` spelling is replaced; other ``$`` text is left
    exactly as given (torch's ``Template`` would also eat ``$$``).
    """
    return tuple(
        a.replace(LOCAL_RANK_MACRO, str(local_rank)) if isinstance(a, str) else a for a in args
    )
