"""From parsed options to a :class:`LaunchConfig`: validation, the worker command, the rendezvous.

Nothing starts here; torch is imported only for the options that need it.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._workers._runpath import run_script_path
from ._parser import DEFAULT_MASTER_PORT, DEFAULT_SIGNALS

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from .._workers._preload import Preload
    from ..agent import WorkerSpec

__all__ = [
    "LaunchConfig",
    "config_from_args",
    "determine_local_world_size",
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
        raise ValueError(f"--nnodes={nnodes!r}: need 0 < MIN <= MAX")
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


def parse_endpoint(endpoint: str, default_port: int | None) -> tuple[str, int | None]:
    """``"host[:port]"`` (``[v6]:port`` too) → ``(host, port)`` (torch's rules)."""
    endpoint = endpoint.strip()
    if not endpoint:
        return "localhost", default_port
    if endpoint.startswith("[") and endpoint.endswith("]"):
        host, rest = endpoint, None
    else:
        host, sep, rest_ = endpoint.rpartition(":")
        if not sep:
            host, rest = endpoint, None
        else:
            rest = rest_
    if len(host) > 1 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
    port = default_port
    if rest is not None:
        if not rest.isdigit() or not 0 <= int(rest) < 65536:
            raise ValueError(
                f"the port of the endpoint {endpoint!r} must be an integer in 0..65535"
            )
        port = int(rest)
    if not re.match(r"^[\w.:-]+$", host):
        raise ValueError(
            f"the host of the endpoint {endpoint!r} must be a hostname, an IPv4 or an IPv6 address"
        )
    return host, port


def determine_local_world_size(nproc_per_node: str) -> int:
    """``--nproc-per-node``: an int, or ``cpu``/``gpu``/``xpu``/``auto`` (torch's rules)."""
    try:
        n = int(nproc_per_node)
    except ValueError:
        pass
    else:
        if n < 1:
            raise ValueError(f"--nproc-per-node={nproc_per_node!r} must be >= 1")
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
    #: warm start: the zygote's modules (--preload / the default), or None
    preload: Preload | None = None
    warnings: list[str] = field(default_factory=list)
    #: set in this process's environment before the agent starts
    environ: dict[str, str] = field(default_factory=dict)
    #: ``--exit-code``: ``"torchrun"`` or ``"root-cause"`` (see ``_exit.py``)
    exit_code: str = "torchrun"
    #: one-line notices for stderr (what was taken from Slurm)
    notices: list[str] = field(default_factory=list)


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
        raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0")
    if args.monitor_interval <= 0:
        raise ValueError(f"--monitor-interval={args.monitor_interval} must be > 0")
    nproc = determine_local_world_size(args.nproc_per_node)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.virtual_local_rank and visible is not None and nproc > len(visible.split(",")):
        raise ValueError(
            f"--virtual-local-rank with --nproc-per-node={nproc}, but CUDA_VISIBLE_DEVICES="
            f"{visible} names {len(visible.split(','))} device(s); start fewer workers"
        )
    redirects = _std(Std, "--redirects", args.redirects)
    tee = _std(Std, "--tee", args.tee)
    ranks: set[int] | None = None
    if args.local_ranks_filter:
        try:
            ranks = {int(r) for r in args.local_ranks_filter.split(",")}
        except ValueError:
            raise ValueError(
                f"--local-ranks-filter={args.local_ranks_filter!r} must be a comma-separated "
                "list of integers, e.g. --local-ranks-filter 0,1,2"
            ) from None
    rdzv_conf = parse_rdzv_conf(args.rdzv_conf)
    _check_event_log_handler(args.event_log_handler)
    numa_options = _numa_options(args.numa_binding)
    # torchrun's launcher hands the signal list to the workers' supervisor
    # through the environment; --forward-signals goes the same way.
    environ = {"TORCHELASTIC_SIGNALS_TO_HANDLE": args.signals_to_handle or DEFAULT_SIGNALS}
    if args.forward_signals:
        environ["AIOLAUNCH_FORWARD_SIGNALS"] = args.forward_signals

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
            host, port = parse_endpoint(endpoint, args.master_port)
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
            master_addr, master_port = parse_endpoint(endpoint, None)
            if master_port is None:
                raise ValueError(f"--rdzv-endpoint={endpoint!r} has no port; add :PORT")
        elif args.node_rank != 0:
            warnings.append(
                f"--node-rank applies to the static rendezvous only; with --rdzv-backend "
                f"{args.rdzv_backend} the rendezvous assigns node ranks"
            )
        torch_handler = create_handler(
            backend=args.rdzv_backend,
            endpoint=endpoint,
            run_id=args.rdzv_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr=args.local_addr,
            **rdzv_conf,
        )
        rdzv = torch_handler

    logs_specs: Any = None
    if args.logs_specs is not None:
        cls = _load_logs_specs_class(args.logs_specs)
        logs_specs = cls(
            log_dir=args.log_dir, redirects=redirects, tee=tee, local_ranks_filter=ranks
        )
    elif ranks is not None:
        from .._logs._specs import DefaultLogsSpecs

        logs_specs = DefaultLogsSpecs(
            log_dir=args.log_dir, redirects=redirects, tee=tee, local_ranks_filter=ranks
        )

    timeout: float = 30.0
    if args.shutdown_timeout is not None:
        timeout = float(args.shutdown_timeout)
    elif os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        timeout = float(os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])

    watchdog = _watchdog(args)
    if args.metrics_port is None and args.metrics_host != "127.0.0.1":
        raise ValueError("--metrics-host needs --metrics-port PORT (metrics are off)")
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
        preload=preload,
        warnings=warnings,
        environ=environ,
        exit_code=getattr(args, "exit_code", "torchrun"),
        notices=[slurm] if slurm else [],
    )


def _check_event_log_handler(name: str) -> None:
    if name == "null":
        return
    try:
        from torch.distributed.elastic.events import handlers
    except ImportError:
        known = ["null", "console"]
    else:
        known = sorted(handlers._log_handlers)
    if name not in known:
        raise ValueError(
            f"--event-log-handler={name!r} is not a registered handler; use one of {known}"
        )


def _numa_options(mode: str | None) -> Any:
    if mode is None:
        return None
    try:
        from torch.numa.binding import AffinityMode, NumaOptions
    except ImportError:
        raise ValueError(
            f"--numa-binding={mode} needs torch (pip install 'aiolaunch[torch]')"
        ) from None
    return NumaOptions(affinity_mode=AffinityMode(mode))


BOOTSTRAP = "aiolaunch._bootstrap"


def _preload(args: argparse.Namespace, python_workers: bool) -> Preload | None:
    """``--preload``/``--no-preload``; by default torch, for a Python script that imports it."""
    from .._workers._preload import resolve_preload, supported

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
        return resolve_preload(names, "--preload")
    if not python_workers or not supported():
        return None
    import importlib.util

    if importlib.util.find_spec("torch") is None or not _imports_torch(args):
        return None
    return resolve_preload(True)


_IMPORTS_TORCH = re.compile(
    rb"^[ \t]*(?:import[ \t]+(?:[\w.]+[ \t]*,[ \t]*)*torch\b|from[ \t]+torch\b)", re.M
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


def _watchdog(args: argparse.Namespace) -> Any:
    if args.stall_timeout is None:
        for flag, value in (
            ("--on-stall", args.on_stall),
            ("--progress-regex", args.progress_regex),
            ("--straggler-sample", args.straggler_sample),
        ):
            if value is not None:
                raise ValueError(f"{flag} needs --stall-timeout SECONDS (the watchdog is off)")
        return None
    from .._watchdog import Watchdog

    try:
        return Watchdog(
            stall_after=float(args.stall_timeout),
            progress=args.progress_regex or None,
            action=args.on_stall or "fail",
            stragglers=None if args.straggler_sample is None else float(args.straggler_sample),
        )
    except ValueError as exc:  # name the flag, not the field
        text = str(exc)
        for field, flag in (
            ("Watchdog(stall_after=", "--stall-timeout "),
            ("Watchdog(progress=", "--progress-regex "),
            ("Watchdog(stragglers=", "--straggler-sample "),
        ):
            end = max(text.rfind(") must "), text.rfind(") is not "))
            if text.startswith(field) and end > 0:
                value, rest = text[len(field) : end], text[end + 1 :]
                raise ValueError(f"{flag}{value}{rest}".replace(", or None (off)", "")) from None
        raise


def _std(std_cls: Any, flag: str, value: str) -> Any:
    try:
        return std_cls.from_str(value)
    except (ValueError, KeyError) as exc:
        raise ValueError(
            f"{flag}={value!r} must be 0-3 for every rank, or LOCAL_RANK:VALUE pairs "
            f"such as 0:3,1:1 ({exc})"
        ) from None


def _load_logs_specs_class(name: str) -> Any:
    from importlib import metadata

    for group in ("aiolaunch.logs_specs", "torchrun.logs_specs"):
        eps = metadata.entry_points().select(group=group, name=name)
        for ep in eps:
            return ep.load()
    raise ValueError(
        f"--logs-specs={name!r}: no entry point of that name in the 'torchrun.logs_specs' "
        "(or 'aiolaunch.logs_specs') group"
    )
