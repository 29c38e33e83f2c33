"""The argument parser: torchrun's options, defaults, aliases and ``PET_*`` variables.

Only the standard library is imported here, so ``aiolaunch --help`` is instant.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .._types import START_METHODS
from ._actions import GIVEN, BadEnvironment, EnvFlag, EnvOption, comma_list, env_name, one_of
from ._hosts import add_host_flags

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DEFAULT_SIGNALS",
    "GIVEN",
    "NUMA_MODES",
    "BadEnvironment",
    "env_name",
    "get_args_parser",
    "parse_args",
]

DEFAULT_MASTER_PORT = 29500
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
#: torch.numa.binding.AffinityMode values (spelled out: the parser imports no torch)
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


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
        action=EnvOption,
        type=str,
        default="1:1",
        help="Number of nodes, or the range of nodes in form <minimum_nodes>:<maximum_nodes>.",
    )
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        action=EnvOption,
        type=str,
        default="1",
        help="Number of workers per node; supported values: [auto, cpu, gpu, xpu, int].",
    )
    # rendezvous
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        action=EnvOption,
        type=str,
        default="static",
        help="Rendezvous backend (static: one machine needs no torch; c10d for several).",
    )
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        action=EnvOption,
        type=str,
        default="",
        help="Rendezvous backend endpoint; usually in form <host>:<port>.",
    )
    add(
        "--rdzv-id",
        "--rdzv_id",
        action=EnvOption,
        type=str,
        default="none",
        help="User-defined group id.",
    )
    add(
        "--rdzv-conf",
        "--rdzv_conf",
        action=EnvOption,
        type=str,
        default="",
        help="Additional rendezvous configuration (<key1>=<value1>,<key2>=<value2>,...).",
    )
    add(
        "--standalone",
        action=EnvFlag,
        help="Single-node job: a local rendezvous on a free port with a fresh run id "
        "(no torch needed); --rdzv-backend, --rdzv-endpoint and --rdzv-id are auto-assigned, "
        "as with torchrun.",
    )
    # user code
    add(
        "--max-restarts",
        "--max_restarts",
        action=EnvOption,
        type=int,
        default=0,
        help="Maximum number of worker group restarts before failing.",
    )
    add(
        "--monitor-interval",
        "--monitor_interval",
        action=EnvOption,
        type=float,
        default=0.1,
        help="Accepted for torchrun compatibility: worker exits are events, not polls "
        "(with a torch rendezvous it paces the check for joining nodes, at least 1 s).",
    )
    add(
        "--start-method",
        "--start_method",
        action=EnvOption,
        type=one_of("start_method", START_METHODS),
        default="spawn",
        choices=list(START_METHODS),
        help="Multiprocessing start method (used with --run-path).",
    )
    add(
        "--event-log-handler",
        "--event_log_handler",
        action=EnvOption,
        type=str,
        default="null",
        help="Name of a registered torch elastic events handler (null, console, or one "
        "registered with torch): the agent records torchrun's events through it.",
    )
    add(
        "--role",
        action=EnvOption,
        type=str,
        default="default",
        help="User-defined role for the workers.",
    )
    add(
        "-m",
        "--module",
        action=EnvFlag,
        help="Run the script argument as a Python module, like 'python -m'.",
    )
    add(
        "--no-python",
        "--no_python",
        action=EnvFlag,
        help="Execute the script directly instead of with 'python' (e.g. a binary).",
    )
    add(
        "--run-path",
        "--run_path",
        action=EnvFlag,
        help="Run the script with runpy.run_path in a function worker (an absolute path). "
        "Takes precedence over --no-python.",
    )
    add(
        "--log-dir",
        "--log_dir",
        action=EnvOption,
        type=str,
        default=None,
        help="Base directory for log files; reusable across runs (each run gets a unique "
        "sub-directory prefixed with its run id).",
    )
    add(
        "-r",
        "--redirects",
        action=EnvOption,
        type=str,
        default="0",
        help="Redirect std streams into log files (e.g. -r 3 redirects stdout+stderr of all "
        "workers, -r 0:1,1:2 stdout of local rank 0 and stderr of local rank 1).",
    )
    add(
        "-t",
        "--tee",
        action=EnvOption,
        type=str,
        default="0",
        help="Tee std streams into a log file and also to the console (format as --redirects).",
    )
    add(
        "--local-ranks-filter",
        "--local_ranks_filter",
        action=EnvOption,
        type=str,
        default="",
        help="Only show the console output of these local ranks (e.g. 0,1,2); log files "
        "are unaffected.",
    )
    add(
        "--duplicate-stdout-filters",
        "--duplicate_stdout_filters",
        action=EnvOption,
        type=comma_list,
        default=[],
        help="Also write tee'd stdout lines that contain any of these strings (comma-"
        "separated; ',,' escapes a comma) to filtered_stdout.log, for all ranks.",
    )
    add(
        "--duplicate-stderr-filters",
        "--duplicate_stderr_filters",
        action=EnvOption,
        type=comma_list,
        default=[],
        help="Also write tee'd stderr lines that contain any of these strings to "
        "filtered_stderr.log, for all ranks.",
    )
    # caffe2.distributed.launch compatibility
    add(
        "--node-rank",
        "--node_rank",
        action=EnvOption,
        type=int,
        default=0,
        help="Rank of the node (static rendezvous with several nodes only).",
    )
    add(
        "--master-addr",
        "--master_addr",
        action=EnvOption,
        type=str,
        default="127.0.0.1",
        help="Address of the master node (static rendezvous only).",
    )
    add(
        "--master-port",
        "--master_port",
        action=EnvOption,
        type=int,
        default=None,
        help="Port on the master node (static rendezvous only); default: a free port on one "
        f"node, {DEFAULT_MASTER_PORT} with several.",
    )
    add(
        "--local-addr",
        "--local_addr",
        action=EnvOption,
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
        choices=list(NUMA_MODES),
        default=None,
        help="Bind each worker to the CPUs near its GPU (torch's torch.numa.binding modes; "
        "needs torch, a GPU and numactl, and fails like torchrun where they are missing).",
    )
    add(
        "--signals-to-handle",
        "--signals_to_handle",
        action=EnvOption,
        type=str,
        default=DEFAULT_SIGNALS,
        help="Comma-separated signals that stop the workers and end the run "
        "(sets TORCHELASTIC_SIGNALS_TO_HANDLE), e.g. SIGTERM,SIGINT,SIGUSR1.",
    )
    add(
        "--forward-signals",
        "--forward_signals",
        action=EnvOption,
        type=str,
        default=None,
        help="Beyond torchrun: comma-separated signals (e.g. SIGUSR1) only forwarded to the "
        "workers, which keep running (a preemption notice: checkpoint now); sets "
        "AIOLAUNCH_FORWARD_SIGNALS.",
    )
    add(
        "--shutdown-timeout",
        "--shutdown_timeout",
        action=EnvOption,
        type=int,
        default=None,
        help="Seconds between the death signal and SIGKILL when workers are stopped "
        "(default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).",
    )
    # -- hang forensics (aiolaunch's own) --
    add(
        "--stall-timeout",
        "--stall_timeout",
        action=EnvOption,
        type=float,
        default=None,
        metavar="SECONDS",
        help="Watchdog: a worker with no output for this long whose stack did not move (or, "
        "for workers that cannot be sampled, without CPU) is stalled; every rank's stacks "
        "are dumped to LOG_DIR/<rank>/stacks-<n>.txt (default: off).",
    )
    add(
        "--on-stall",
        "--on_stall",
        action=EnvOption,
        type=one_of("on_stall", ("observe", "fail", "restart")),
        choices=("observe", "fail", "restart"),
        default=None,
        help="What a stall does after the dump: report only (observe), stop the job and "
        "report the stalled rank (fail, the default), or restart the group within "
        "--max-restarts (restart). Needs --stall-timeout.",
    )
    add(
        "--progress-regex",
        "--progress_regex",
        action=EnvOption,
        default=None,
        metavar="REGEX",
        help="Watchdog: only output lines matching REGEX count as progress (e.g. '^step '); "
        "ranks that never print one follow the group's progress. Needs --stall-timeout.",
    )
    add(
        "--straggler-sample",
        "--straggler_sample",
        action=EnvOption,
        type=float,
        default=None,
        metavar="SECONDS",
        help="Watchdog: sample every rank's stack this often and name a rank that waits in "
        "torch.distributed collectives far less than its peers (a straggler: they wait for "
        "it) in a warning, `aiolaunch status` and the report. Needs --stall-timeout.",
    )
    # -- live observability (aiolaunch's own) --
    add(
        "--metrics-port",
        "--metrics_port",
        action=EnvOption,
        type=int,
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics (per-rank samples labelled rank) at "
        "http://127.0.0.1:PORT/metrics while the job runs; 0: any free port (default: off).",
    )
    add(
        "--metrics-host",
        "--metrics_host",
        action=EnvOption,
        default="127.0.0.1",
        metavar="HOST",
        help="The address the metrics are served on (default 127.0.0.1: this machine only; "
        "0.0.0.0: every interface). Needs --metrics-port.",
    )
    add(
        "--virtual-local-rank",
        "--virtual_local_rank",
        action=EnvFlag,
        help="Every worker gets LOCAL_RANK=0 and sees only its own GPU through "
        "CUDA_VISIBLE_DEVICES (torchrun's virtual local rank mode).",
    )
    # -- schedulers and engines (aiolaunch's own; see _exit.py, _slurm.py) --
    add(
        "--exit-code",
        "--exit_code",
        action=EnvOption,
        type=one_of("exit_code", ("torchrun", "root-cause")),
        choices=("torchrun", "root-cause"),
        default="torchrun",
        help="Exit status when the workers fail: 1 as torchrun (torchrun, the default), or "
        "the root cause's own exit code, 128+N for a worker killed by signal N (root-cause). "
        "Whatever this says: 2 means bad arguments or nothing to run (do not retry), 128+N "
        "that signal N stopped aiolaunch (143: SIGTERM).",
    )
    # -- warm start (aiolaunch's own) --
    add(
        "--preload",
        action=EnvOption,
        default=None,
        metavar="MOD[,MOD...]",
        help="Warm start: fork the Python workers from a zygote process that imported these "
        "modules once (the first start and every restart skip those imports). Default: torch, "
        "for a Python script or module that imports torch (when torch is installed).",
    )
    add(
        "--no-preload",
        "--no_preload",
        action=EnvFlag,
        help="Start every worker afresh, without a zygote (as torchrun does).",
    )
    add_host_flags(p)  # resilience across hosts (aiolaunch's own; _hosts.py)
    add(
        "training_script",
        type=str,
        help="The script (or module with -m, or binary with --no-python) to run in each "
        "worker, followed by its arguments.",
    )
    add("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a torchrun-style command line (exit 2 with a message on bad options)."""
    try:
        parser = get_args_parser()
    except BadEnvironment as exc:
        argparse.ArgumentParser(prog="aiolaunch").error(str(exc))
    return parser.parse_args(argv)
