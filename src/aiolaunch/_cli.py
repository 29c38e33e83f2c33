"""``aiolaunch``: torchrun's command line, on the asyncio agent.

``aiolaunch [options] script.py [script args]`` takes torchrun's flags, their
defaults, their underscore spellings (``--nproc_per_node``) and their
``PET_*`` environment variables, so that replacing ``torchrun`` with
``aiolaunch`` in a command line just works. One machine (the default, or
``--standalone``) needs no torch; several machines join through torch's own
rendezvous (``--rdzv-backend c10d``).

Only the standard library is imported until the arguments are parsed, so
``aiolaunch --help`` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .agent import RunResult, WorkerSpec

__all__ = ["get_args_parser", "main", "parse_args", "run_script_path"]

log = logging.getLogger("aiolaunch.cli")

DEFAULT_MASTER_PORT = 29500
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
LOCAL_RANK_MACRO = "${local_rank}"


class _Env(argparse.Action):
    """An option whose default comes from ``PET_{DEST}`` when set (torch's ``env``)."""

    def __init__(self, dest: str, default: Any = None, required: bool = False, **kw: Any) -> None:
        default = os.environ.get(f"PET_{dest.upper()}", default)
        if default:
            required = False
        super().__init__(dest=dest, default=default, required=required, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


class _CheckEnv(argparse.Action):
    """A flag that is also on when ``PET_{DEST}`` is a non-zero int (torch's ``check_env``)."""

    def __init__(self, dest: str, default: bool = False, **kw: Any) -> None:
        default = bool(int(os.environ.get(f"PET_{dest.upper()}", "1" if default else "0")))
        super().__init__(dest=dest, const=True, default=default, nargs=0, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.const)


def _comma_separated_list(value: str) -> list[str]:
    # torch's parsing: ",," escapes a comma
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


def get_args_parser() -> argparse.ArgumentParser:
    """The argument parser: torchrun's options, defaults and aliases."""
    p = argparse.ArgumentParser(
        prog="aiolaunch",
        description="aiolaunch: an asyncio-native, torchrun-compatible launcher. "
        "Every option can also be set by the PET_<OPTION> environment variable, as with torchrun.",
    )
    add = p.add_argument
    # worker/node sizes
    add(
        "--nnodes",
        action=_Env,
        type=str,
        default="1:1",
        help="Number of nodes, or the range of nodes in form <minimum_nodes>:<maximum_nodes>.",
    )
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        action=_Env,
        type=str,
        default="1",
        help="Number of workers per node; supported values: [auto, cpu, gpu, xpu, int].",
    )
    # rendezvous
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        action=_Env,
        type=str,
        default="static",
        help="Rendezvous backend (static: one machine needs no torch; c10d for several).",
    )
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        action=_Env,
        type=str,
        default="",
        help="Rendezvous backend endpoint; usually in form <host>:<port>.",
    )
    add(
        "--rdzv-id",
        "--rdzv_id",
        action=_Env,
        type=str,
        default="none",
        help="User-defined group id.",
    )
    add(
        "--rdzv-conf",
        "--rdzv_conf",
        action=_Env,
        type=str,
        default="",
        help="Additional rendezvous configuration (<key1>=<value1>,<key2>=<value2>,...).",
    )
    add(
        "--standalone",
        action=_CheckEnv,
        help="Single-node job: a local rendezvous on a free port with a fresh run id "
        "(no torch needed). --rdzv-backend, --rdzv-endpoint and --rdzv-id are ignored.",
    )
    # user code
    add(
        "--max-restarts",
        "--max_restarts",
        action=_Env,
        type=int,
        default=0,
        help="Maximum number of worker group restarts before failing.",
    )
    add(
        "--monitor-interval",
        "--monitor_interval",
        action=_Env,
        type=float,
        default=0.1,
        help="Accepted for torchrun compatibility: worker exits are events, not polls "
        "(with a torch rendezvous it paces the check for joining nodes, at least 1 s).",
    )
    add(
        "--start-method",
        "--start_method",
        action=_Env,
        type=str,
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="Multiprocessing start method (used with --run-path).",
    )
    add(
        "--event-log-handler",
        "--event_log_handler",
        action=_Env,
        type=str,
        default="null",
        help="Accepted for torchrun compatibility; aiolaunch records no torch events.",
    )
    add(
        "--role",
        action=_Env,
        type=str,
        default="default",
        help="User-defined role for the workers.",
    )
    add(
        "-m",
        "--module",
        action=_CheckEnv,
        help="Run the script argument as a Python module, like 'python -m'.",
    )
    add(
        "--no-python",
        "--no_python",
        action=_CheckEnv,
        help="Execute the script directly instead of with 'python' (e.g. a binary).",
    )
    add(
        "--run-path",
        "--run_path",
        action=_CheckEnv,
        help="Run the script with runpy.run_path in a function worker (an absolute path). "
        "Takes precedence over --no-python.",
    )
    add(
        "--log-dir",
        "--log_dir",
        action=_Env,
        type=str,
        default=None,
        help="Base directory for log files; reusable across runs (each run gets a unique "
        "sub-directory prefixed with its run id).",
    )
    add(
        "-r",
        "--redirects",
        action=_Env,
        type=str,
        default="0",
        help="Redirect std streams into log files (e.g. -r 3 redirects stdout+stderr of all "
        "workers, -r 0:1,1:2 stdout of local rank 0 and stderr of local rank 1).",
    )
    add(
        "-t",
        "--tee",
        action=_Env,
        type=str,
        default="0",
        help="Tee std streams into a log file and also to the console (format as --redirects).",
    )
    add(
        "--local-ranks-filter",
        "--local_ranks_filter",
        action=_Env,
        type=str,
        default="",
        help="Only show the console output of these local ranks (e.g. 0,1,2); log files "
        "are unaffected.",
    )
    add(
        "--duplicate-stdout-filters",
        "--duplicate_stdout_filters",
        action=_Env,
        type=_comma_separated_list,
        default=[],
        help="Accepted for torchrun compatibility; not supported (a warning when given).",
    )
    add(
        "--duplicate-stderr-filters",
        "--duplicate_stderr_filters",
        action=_Env,
        type=_comma_separated_list,
        default=[],
        help="Accepted for torchrun compatibility; not supported (a warning when given).",
    )
    # caffe2.distributed.launch compatibility
    add(
        "--node-rank",
        "--node_rank",
        action=_Env,
        type=int,
        default=0,
        help="Rank of the node (static rendezvous with several nodes only).",
    )
    add(
        "--master-addr",
        "--master_addr",
        action=_Env,
        type=str,
        default="127.0.0.1",
        help="Address of the master node (static rendezvous only).",
    )
    add(
        "--master-port",
        "--master_port",
        action=_Env,
        type=int,
        default=None,
        help="Port on the master node (static rendezvous only); default: a free port on one "
        f"node, {DEFAULT_MASTER_PORT} with several.",
    )
    add(
        "--local-addr",
        "--local_addr",
        action=_Env,
        type=str,
        default=None,
        help="Address of this node, as the other nodes reach it.",
    )
    add(
        "--logs-specs",
        "--logs_specs",
        type=str,
        default=None,
        help="Name of a 'torchrun.logs_specs' entry point (a LogsSpecs class).",
    )
    add(
        "--numa-binding",
        "--numa_binding",
        type=str,
        default=None,
        help="Accepted for torchrun compatibility; not supported (a warning when given).",
    )
    add(
        "--signals-to-handle",
        "--signals_to_handle",
        action=_Env,
        type=str,
        default=DEFAULT_SIGNALS,
        help="aiolaunch always forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to the workers.",
    )
    add(
        "--shutdown-timeout",
        "--shutdown_timeout",
        action=_Env,
        type=int,
        default=None,
        help="Seconds between the death signal and SIGKILL when workers are stopped "
        "(default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).",
    )
    add(
        "--virtual-local-rank",
        "--virtual_local_rank",
        action=_CheckEnv,
        help="Not supported by aiolaunch (an error when given).",
    )
    add(
        "training_script",
        type=str,
        help="The script (or module with -m, or binary with --no-python) to run in each "
        "worker, followed by its arguments.",
    )
    add("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a torchrun-style command line."""
    return get_args_parser().parse_args(argv)


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Run ``training_script`` with :func:`runpy.run_path` as ``__main__`` (``--run-path``)."""
    import runpy

    sys.argv = [training_script, *training_script_args]
    try:
        runpy.run_path(training_script, run_name="__main__")
    except SystemExit as exc:
        # a script that ends with sys.exit(0) succeeded (as torch's @record)
        if exc.code not in (0, None):
            raise


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
        from .agent._rendezvous._torch import accelerator_count

        try:
            return accelerator_count(nproc_per_node)[0]
        except ValueError:
            if nproc_per_node == "auto":
                return _cpu_count()
            raise
    raise ValueError(
        f"--nproc-per-node={nproc_per_node!r} is not supported; "
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


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validate the parsed options and build the worker spec (nothing starts here)."""
    from ._types import Std
    from .agent import StaticRendezvous, WorkerSpec
    from .agent._spec import entrypoint_name

    warnings: list[str] = []
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0")
    if args.monitor_interval <= 0:
        raise ValueError(f"--monitor-interval={args.monitor_interval} must be > 0")
    if args.virtual_local_rank:
        raise ValueError(
            "--virtual-local-rank is not supported by aiolaunch; set CUDA_VISIBLE_DEVICES "
            "in your script from LOCAL_RANK instead"
        )
    nproc = determine_local_world_size(args.nproc_per_node)
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
    for flag, value, default in (
        ("--event-log-handler", args.event_log_handler, "null"),
        ("--numa-binding", args.numa_binding, None),
        ("--duplicate-stdout-filters", args.duplicate_stdout_filters, []),
        ("--duplicate-stderr-filters", args.duplicate_stderr_filters, []),
    ):
        if value != default:
            warnings.append(f"{flag}={value!r} is not supported by aiolaunch and is ignored")
    if set(args.signals_to_handle.replace(" ", "").split(",")) != set(DEFAULT_SIGNALS.split(",")):
        warnings.append(
            f"--signals-to-handle={args.signals_to_handle!r} is ignored: aiolaunch forwards "
            f"{DEFAULT_SIGNALS} to the workers"
        )

    # the command every worker runs (torch's rules)
    entrypoint: Callable[..., Any] | str
    cmd_args: list[str] = []
    if args.run_path:
        entrypoint = run_script_path
        cmd_args.append(args.training_script)
    elif not args.no_python:
        entrypoint = os.getenv("PYTHON_EXEC", sys.executable)
        cmd_args.append("-u")
        if args.module:
            cmd_args.append("-m")
        cmd_args.append(args.training_script)
    else:
        if args.module:
            raise ValueError("--no-python and --module cannot be used together; drop one")
        entrypoint = args.training_script
    cmd_args.extend(args.training_script_args)

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
        from .agent._rendezvous._torch import create_handler

        endpoint = args.rdzv_endpoint
        if args.rdzv_backend == "static":
            rdzv_conf["rank"] = args.node_rank  # type: ignore[assignment]
            if not endpoint:
                port_ = args.master_port if args.master_port is not None else DEFAULT_MASTER_PORT
                endpoint = f"{args.master_addr}:{port_}"
            master_addr, master_port = parse_endpoint(endpoint, None)
            if master_port is None:
                raise ValueError(f"--rdzv-endpoint={endpoint!r} has no port; add :PORT")
        elif args.node_rank != 0:
            warnings.append(
                f"--node-rank is only used by the static rendezvous; ignored with "
                f"--rdzv-backend {args.rdzv_backend}"
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
        from ._logs_specs import DefaultLogsSpecs

        logs_specs = DefaultLogsSpecs(
            log_dir=args.log_dir, redirects=redirects, tee=tee, local_ranks_filter=ranks
        )

    timeout: float = 30.0
    if args.shutdown_timeout is not None:
        timeout = float(args.shutdown_timeout)
    elif os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        timeout = float(os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])

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
    )


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


async def _launch(cfg: LaunchConfig) -> RunResult:
    from ._errors import SignalException
    from .agent import LocalElasticAgent

    agent = LocalElasticAgent(
        cfg.spec,
        start_method=cfg.start_method,
        log_dir=cfg.log_dir,
        logs_specs=cfg.logs_specs,
        log_line_prefix_template=cfg.log_line_prefix_template,
        shutdown_timeout=cfg.shutdown_timeout,
    )
    shutdown_rdzv = True
    try:
        return await agent.run()
    except SignalException:
        # As torchrun: a node stopped by a signal leaves the rendezvous open,
        # so the job can go on (or scale) without it.
        shutdown_rdzv = False
        raise
    finally:
        if shutdown_rdzv and cfg.torch_handler is not None:
            import anyio.to_thread

            await anyio.to_thread.run_sync(cfg.torch_handler.shutdown)


def _setup_logging() -> None:
    level = os.environ.get("LOGLEVEL", "WARNING").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s")
    )
    root = logging.getLogger("aiolaunch")
    root.addHandler(handler)
    root.setLevel(getattr(logging, level, logging.WARNING))
    root.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    0: every worker succeeded. 1: the group failed after its restarts (the
    root cause is summarised on stderr) or a signal stopped it (the workers
    were stopped first), as with torchrun. 2: bad options.
    """
    args = parse_args(argv)
    _setup_logging()
    try:
        cfg = config_from_args(args)
    except (ValueError, TypeError, ImportError, NotADirectoryError) as exc:
        print(f"aiolaunch: error: {exc}", file=sys.stderr)
        return 2
    for warning in cfg.warnings:
        log.warning(warning)

    from ._errors import ChildFailedError, SignalException

    try:
        result = asyncio.run(_launch(cfg))
    except SignalException as exc:
        import signal

        try:
            name = signal.Signals(exc.sigval).name
        except ValueError:
            name = f"signal {exc.sigval}"
        print(f"aiolaunch: received {name}; all workers were stopped", file=sys.stderr)
        return 1
    if result.is_failed():
        err = ChildFailedError(cfg.entrypoint_name, result.failures)
        print(err.format_msg(), file=sys.stderr)
        return 1
    return 0
