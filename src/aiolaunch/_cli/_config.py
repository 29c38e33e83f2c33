"""From parsed options to a :class:`LaunchConfig`: validation, the worker command, the rendezvous.

Nothing starts here; torch is imported only for the options that need it.
"""

from __future__ import annotations

import math
import os
import re
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._child._bootstrap import BOOTSTRAP
from .._child._runpath import run_script_path
from ._checks import (
    check_event_log_handler,
    check_log_dir,
    check_metrics,
    check_node,
    endpoint_of,
    load_logs_specs_class,
    local_ranks,
    numa_from_flag,
    parse_endpoint,
    shutdown_timeout,
    signal_environ,
    std_setting,
    watchdog_from_args,
)
from ._hosts import resilience_from_args
from ._parser import DEFAULT_MASTER_PORT

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from .._warm._preload import Preload
    from ..agent import WorkerSpec

__all__ = [
    "LaunchConfig",
    "config_from_args",
    "determine_local_world_size",
    "early_preload",
    "parse_endpoint",
    "parse_min_max_nnodes",
    "parse_rdzv_conf",
    "run_script_path",
]


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` → ``(min, max)``, with ``0 < min <= max``."""
    parts = nnodes.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f'--nnodes={nnodes!r} must be a number or "MIN:MAX", e.g. --nnodes 2 or --nnodes 1:4'
        ) from None
    if not 0 < lo <= hi:
        raise ValueError(f"--nnodes={nnodes!r}: need 0 < MIN <= MAX, e.g. --nnodes 2 or 1:4")
    return lo, hi


def parse_rdzv_conf(conf: str) -> dict[str, str]:
    """``"k1=v1,k2=v2"`` → ``{"k1": "v1", "k2": "v2"}`` (torch's rules)."""
    out: dict[str, str] = {}
    conf = conf.strip()
    if not conf:
        return out
    for kv in conf.split(","):
        key, sep, value = kv.partition("=")
        key, value = key.strip(), value.strip()
        if not key:
            raise ValueError(f"--rdzv-conf={conf!r} must be in the form key1=value1,key2=value2")
        if not sep or not value:
            raise ValueError(f"--rdzv-conf: option {key!r} needs a value (key=value)")
        out[key] = value
    return out


def determine_local_world_size(nproc_per_node: str) -> int:
    """``--nproc-per-node``: an int, or ``cpu``/``gpu``/``xpu``/``auto`` (torch's rules)."""
    try:
        n = int(nproc_per_node)
    except ValueError:
        pass
    else:
        if n < 1:
            raise ValueError(
                f"--nproc-per-node={nproc_per_node!r} must be >= 1 (workers on this machine), "
                "e.g. --nproc-per-node 4"
            )
        return n
    if nproc_per_node == "cpu":
        return _cpu_count()
    if nproc_per_node in ("gpu", "xpu", "auto"):
        if nproc_per_node == "auto":
            try:
                import torch  # noqa: F401
            except ImportError:
                return _cpu_count()
        from ..agent._rendezvous._torch import accelerator_count

        try:
            return accelerator_count(nproc_per_node)[0]
        except ValueError:
            if nproc_per_node == "auto":
                return _cpu_count()
            raise
    raise ValueError(
        f"--nproc-per-node={nproc_per_node!r} is not a valid value; "
        "pass a number, cpu, gpu, xpu or auto"
    )


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass
class LaunchConfig:
    """Everything :func:`main` derived from the command line."""

    spec: WorkerSpec
    entrypoint_name: str
    start_method: str
    log_dir: str | None
    logs_specs: Any
    shutdown_timeout: float
    log_line_prefix_template: str | None
    torch_handler: Any = None
    warnings: list[str] = field(default_factory=list)
    #: set in this process's environment before the agent starts
    environ: dict[str, str] = field(default_factory=dict)
    #: ``--exit-code``: ``"torchrun"`` or ``"root-cause"`` (see ``_exit.py``)
    exit_code: str = "torchrun"
    #: one-line notices for stderr (what was taken from Slurm)
    notices: list[str] = field(default_factory=list)
    #: warm start: the zygote's modules (--preload / the default), or None
    preload: Preload | None = None
    #: --log-dir as given (also where ``logs_specs`` holds it)
    log_root: str | None = None
    #: resilience across hosts (``_hosts.py``): an ``aiolaunch.agent.Resilience``, or None
    resilience: Any = None


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validate the parsed options and build the worker spec (nothing starts here)."""
    from .._types import Std
    from ..agent import StaticRendezvous, WorkerSpec
    from ..agent._spec import entrypoint_name
    from ._slurm import apply_slurm

    warnings: list[str] = []
    slurm = apply_slurm(args, os.environ)  # fills what the user left out, under Slurm
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0, e.g. --max-restarts 3")
    if not (math.isfinite(args.monitor_interval) and args.monitor_interval > 0):
        raise ValueError(
            f"--monitor-interval={args.monitor_interval} must be a number of seconds > 0, "
            "e.g. --monitor-interval 0.1"
        )
    if not args.role:
        raise ValueError("--role='' must be a non-empty name, e.g. --role trainer")
    check_log_dir(args.log_dir)
    if args.run_path and args.module:
        raise ValueError(
            "--run-path and --module cannot be used together: --run-path runs a file; drop one"
        )
    nproc = determine_local_world_size(args.nproc_per_node)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.virtual_local_rank and visible is not None and nproc > len(visible.split(",")):
        raise ValueError(
            f"--virtual-local-rank with --nproc-per-node={nproc}, but CUDA_VISIBLE_DEVICES="
            f"{visible} names {len(visible.split(','))} device(s); start fewer workers"
        )
    redirects = std_setting(Std, "--redirects", args.redirects)
    tee = std_setting(Std, "--tee", args.tee)
    ranks = local_ranks(args.local_ranks_filter, nproc)
    for flag, filters in (
        ("--duplicate-stdout-filters", args.duplicate_stdout_filters),
        ("--duplicate-stderr-filters", args.duplicate_stderr_filters),
    ):
        if "" in filters:
            raise ValueError(
                f"{flag}={','.join(filters)!r} has an empty filter, which matches every line; "
                "drop it (a stray comma? ',,' escapes a comma)"
            )
    rdzv_conf = parse_rdzv_conf(args.rdzv_conf)
    check_event_log_handler(args.event_log_handler)
    numa_options = numa_from_flag(args.numa_binding)
    environ = signal_environ(args)

    # the command every worker runs (torch's rules)
    entrypoint: Callable[..., Any] | str
    cmd_args: list[str] = []
    if args.run_path:
        entrypoint = run_script_path
        cmd_args.append(args.training_script)
    elif not args.no_python:
        entrypoint = os.getenv("PYTHON_EXEC", sys.executable)
        cmd_args.append("-u")
        if entrypoint == sys.executable:
            # Through the bootstrap (same argv, __main__ and exit status as
            # `python script.py`): `aiolaunch stacks` and the watchdog's dumps
            # work with no change to the script. Another interpreter
            # (PYTHON_EXEC) may not have aiolaunch: run it plainly.
            cmd_args += ["-m", BOOTSTRAP]
        if args.module:
            cmd_args.append("-m")
        cmd_args.append(args.training_script)
    else:
        if args.module:
            raise ValueError("--no-python and --module cannot be used together; drop one")
        entrypoint = args.training_script
    cmd_args.extend(args.training_script_args)
    python_workers = bool(args.run_path) or (not args.no_python and entrypoint == sys.executable)
    preload = _preload(args, python_workers)

    # the rendezvous: one machine needs no torch
    torch_handler: Any = None
    rdzv: Any
    master_addr: str | None = None
    master_port: int | None = None
    check_node(args, max_nodes)
    if args.standalone:
        if max_nodes > 1:
            raise ValueError(
                f"--standalone runs on one node, but --nnodes={args.nnodes}; drop --standalone "
                "and use --rdzv-backend c10d --rdzv-endpoint HOST:PORT for several nodes"
            )
        rdzv = StaticRendezvous(
            run_id=str(uuid.uuid4()),
            master_addr=args.master_addr,
            master_port=args.master_port,
            local_addr=args.local_addr,
        )
    elif args.rdzv_backend == "static" and max_nodes == 1:
        if not args.rdzv_endpoint and args.master_port is None:
            # torchrun turns this case into a standalone run: fresh id, free port
            rdzv = StaticRendezvous(
                run_id=str(uuid.uuid4()), master_addr=args.master_addr, local_addr=args.local_addr
            )
        else:
            endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
            host, port = endpoint_of(args, endpoint, args.master_port)
            if port is None:
                raise ValueError(
                    f"--rdzv-endpoint={endpoint!r} has no port; add :PORT or --master-port"
                )
            rdzv = StaticRendezvous(
                run_id=args.rdzv_id, master_addr=host, master_port=port, local_addr=args.local_addr
            )
    else:
        from ..agent._rendezvous._torch import create_handler

        endpoint = args.rdzv_endpoint
        if args.rdzv_backend == "static":
            # A string like every --rdzv-conf value (torch reads it with get_as_int).
            rdzv_conf["rank"] = str(args.node_rank)
            if not endpoint:
                port_ = args.master_port if args.master_port is not None else DEFAULT_MASTER_PORT
                endpoint = f"{args.master_addr}:{port_}"
            master_addr, master_port = endpoint_of(args, endpoint, None)
            if master_port is None:
                raise ValueError(f"--rdzv-endpoint={endpoint!r} has no port; add :PORT")
        elif args.node_rank != 0:
            warnings.append(
                f"--node-rank applies to the static rendezvous only; with --rdzv-backend "
                f"{args.rdzv_backend} the rendezvous assigns node ranks"
            )
        try:
            torch_handler = create_handler(
                backend=args.rdzv_backend,
                endpoint=endpoint,
                run_id=args.rdzv_id,
                min_nodes=min_nodes,
                max_nodes=max_nodes,
                local_addr=args.local_addr,
                **rdzv_conf,
            )
        except (ValueError, RuntimeError) as exc:
            if "is not registered" not in str(exc):
                raise
            raise ValueError(
                f"--rdzv-backend={args.rdzv_backend!r} is not a rendezvous backend torch knows; "
                "use static (the default) or c10d (several machines), or register yours"
            ) from None
        rdzv = torch_handler

    logs_specs: Any = None
    if args.logs_specs is not None:
        cls = load_logs_specs_class(args.logs_specs)
        logs_specs = cls(
            log_dir=args.log_dir, redirects=redirects, tee=tee, local_ranks_filter=ranks
        )
    elif ranks is not None:
        from .._logs._specs import DefaultLogsSpecs

        logs_specs = DefaultLogsSpecs(
            log_dir=args.log_dir, redirects=redirects, tee=tee, local_ranks_filter=ranks
        )

    timeout = shutdown_timeout(args.shutdown_timeout)
    watchdog = watchdog_from_args(args)
    resilience = resilience_from_args(args, rounds=callable(getattr(torch_handler, "watch", None)))
    check_metrics(args)
    spec = WorkerSpec(
        role=args.role,
        local_world_size=nproc,
        entrypoint=entrypoint,
        args=tuple(cmd_args),
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        redirects=redirects,
        tee=tee,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=args.local_addr,
        rdzv_handler=rdzv,
        event_log_handler=args.event_log_handler,
        numa_options=numa_options,
        duplicate_stdout_filters=list(args.duplicate_stdout_filters) or None,
        duplicate_stderr_filters=list(args.duplicate_stderr_filters) or None,
        virtual_local_rank=bool(args.virtual_local_rank),
        watchdog=watchdog,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    return LaunchConfig(
        spec=spec,
        entrypoint_name=entrypoint_name(entrypoint, tuple(cmd_args)),
        start_method=args.start_method,
        log_dir=None if logs_specs is not None else args.log_dir,
        logs_specs=logs_specs,
        shutdown_timeout=timeout,
        log_line_prefix_template=os.getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        torch_handler=torch_handler,
        warnings=warnings,
        environ=environ,
        exit_code=getattr(args, "exit_code", "torchrun"),
        notices=[slurm] if slurm else [],
        preload=preload,
        log_root=args.log_dir,
        resilience=resilience,
    )


def early_preload(args: argparse.Namespace) -> tuple[Preload, int] | None:
    """``(preload, nproc)`` before the configuration is built, where that is cheap.

    ``None`` when there is no preload, or ``--nproc-per-node`` is not a
    number (``gpu``, ``auto``: counting devices imports torch).
    """
    python = os.getenv("PYTHON_EXEC", sys.executable) == sys.executable
    preload = _preload(args, bool(args.run_path) or (not args.no_python and python))
    try:
        nproc = int(args.nproc_per_node)
    except ValueError:
        return None
    return None if preload is None or nproc < 1 else (preload, nproc)


def _preload(args: argparse.Namespace, python_workers: bool) -> Preload | None:
    """``--preload``/``--no-preload``; by default torch, for a Python script that imports it."""
    from .._warm._preload import resolve_preload, supported, workers_folder

    if args.preload is not None and not [m for m in args.preload.split(",") if m.strip()]:
        raise ValueError(
            f"--preload={args.preload!r} names no module; pass e.g. --preload torch, or "
            "--no-preload to start every worker afresh"
        )
    if args.no_preload:
        if args.preload:
            raise ValueError("--preload and --no-preload contradict each other; drop one")
        return None
    if args.preload:
        if not python_workers:
            raise ValueError(
                "--preload forks Python workers from a zygote; it needs a Python script or "
                "module (drop --no-python or --preload)"
            )
        names = [m.strip() for m in args.preload.split(",") if m.strip()]
        # A script's folder is its workers' sys.path[0]: a module beside it preloads.
        script = not args.module and not args.run_path
        folder = workers_folder(sys.executable, [args.training_script]) if script else ""
        return resolve_preload(names, "--preload", folder)
    if not python_workers or not supported():
        return None
    import importlib.util

    if importlib.util.find_spec("torch") is None or not _imports_torch(args):
        return None
    return resolve_preload(True)


#: ``import torch``, ``import numpy as np, torch``, ``from torch import nn``, at
#: the start of a line or after a ``;``
_IMPORTS_TORCH = re.compile(
    rb"(?:^|;)[ \t]*(?:import[ \t]+(?:[\w.]+(?:[ \t]+as[ \t]+\w+)?[ \t]*,[ \t]*)*torch\b"
    rb"|from[ \t]+torch\b)",
    re.M,
)


def _imports_torch(args: argparse.Namespace) -> bool:
    """Whether the worker's script (or ``-m`` module) has an ``import torch``/``from torch`` line.

    The default warm start pays one ``import torch`` up front: worth it for a
    torch script (its workers skip theirs), a loss for one that never imports
    torch. A script that imports torch only through its own modules starts
    the ordinary way, as without a zygote (``--preload torch`` forces it).
    """
    path: str | None = args.training_script
    if args.module:
        path = _module_file(args.training_script)
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            return _IMPORTS_TORCH.search(f.read(1 << 20)) is not None
    except OSError:
        return False


def _module_file(name: str) -> str | None:
    """The source file of module ``name``, found without importing its packages."""
    from importlib.machinery import PathFinder

    search: list[str] | None = [os.getcwd(), *sys.path]
    spec = None
    for part in name.split("."):
        spec = PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec is not None and spec.submodule_search_locations:  # a package: its __main__
        spec = PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
    return spec.origin if spec is not None else None
