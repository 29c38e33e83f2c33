"""NUMA binding of workers (torchrun's ``--numa-binding``), through torch's own rules.

The CPUs for worker ``local_rank`` are what ``torch.numa.binding`` computes
for GPU ``local_rank`` (modes ``node``, ``socket``, ``exclusive``,
``core-complex``), validated as torch validates them (``numactl`` on PATH, a
non-empty set). They are applied as torch applies them: a binary worker runs
under ``numactl --physcpubind=<cpus>``, a function worker calls
``sched_setaffinity`` for all its threads before the entrypoint.

Where that fails (no GPU, no ``numactl``), the error propagates before any
worker starts - on a CPU-only machine torch 2.13 fails the same way - unless
``should_fall_back_if_binding_fails`` is set: then a warning is logged and the
worker runs unbound, as in torch.

torch is imported only when ``numa_options`` is given.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["NumaBindingError", "bind_and_call", "numa_cpus", "wrap_for_numa"]


log = logging.getLogger("aiolaunch.agent")


class NumaBindingError(RuntimeError):
    """The CPUs for a worker could not be determined; torch's error is the ``__cause__``."""


def numa_cpus(numa_options: Any, local_world_size: int) -> dict[int, set[int]]:
    """``{local_rank: cpus}`` for the ranks that can be bound (torch's computation).

    :raises NumaBindingError: torch's computation failed (its error as
        ``__cause__``), unless the options allow falling back (those ranks are
        then left out, with a warning).
    """
    from torch.numa import binding

    out: dict[int, set[int]] = {}
    for local_rank in range(local_world_size):
        try:
            cpus = binding._get_validated_logical_cpus_to_bind_to(
                gpu_index=local_rank, numa_options=numa_options
            )
        except Exception as exc:
            if not getattr(numa_options, "should_fall_back_if_binding_fails", False):
                mode = getattr(numa_options.affinity_mode, "value", numa_options.affinity_mode)
                raise NumaBindingError(
                    f"--numa-binding={mode}: cannot bind local_rank {local_rank} "
                    f"({type(exc).__name__}: {exc}); torch's binding needs a GPU per local "
                    "rank and numactl on PATH"
                ) from exc
            log.warning(
                "NUMA binding failed for local_rank %d; it runs without binding",
                local_rank,
                exc_info=True,
            )
            continue
        out[local_rank] = set(cpus)
    return out


def _ranges(cpus: set[int]) -> str:
    # "0-3,8,10-11": numactl's CPU list syntax
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def bind_and_call(cpus: list[int], fn: Any, *args: Any) -> Any:
    """Bind every thread of this process to ``cpus``, then return ``fn(*args)``.

    Runs in a function worker. Threads that already have an affinity of their
    own are left alone (torch's rule).
    """
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    from .._workers._proc import task_ids

    for tid in task_ids() or ():
        try:
            if os.sched_getaffinity(tid) == original:
                os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # the thread ended meanwhile
    return fn(*args)


def wrap_for_numa(
    entrypoint: Any, args: dict[int, tuple[Any, ...]], cpus: dict[int, set[int]]
) -> tuple[Any, dict[int, tuple[Any, ...]]]:
    """The entrypoint and per-rank args that apply ``cpus`` (ranks not in it: unbound).

    A binary becomes ``numactl --physcpubind=<cpus> <binary> <args>``; a
    function becomes :func:`bind_and_call` with the CPUs and the function
    first. Every rank gets the same entrypoint, so unbound ranks of a binary
    run under ``numactl`` without a CPU list only if some rank is bound.
    """
    if not cpus:
        return entrypoint, args
    if isinstance(entrypoint, str):
        wrapped: dict[int, tuple[Any, ...]] = {}
        for rank, a in args.items():
            bind = (f"--physcpubind={_ranges(cpus[rank])}",) if rank in cpus else ()
            wrapped[rank] = (*bind, entrypoint, *a)
        return "numactl", wrapped
    return bind_and_call, {
        rank: (sorted(cpus.get(rank, os.sched_getaffinity(0))), entrypoint, *a)
        for rank, a in args.items()
    }
