"""``main``: parse, configure, run the agent on a fresh event loop, report."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from ._checks import make_log_dir
from ._client import VERBS
from ._config import LaunchConfig, config_from_args
from ._parser import BadEnvironment, get_args_parser
from ._preflight import check_entrypoint

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..agent import RunResult

__all__ = ["main"]

log = logging.getLogger("aiolaunch.cli")


async def _launch(cfg: LaunchConfig) -> RunResult:
    from .._errors import SignalException
    from ..agent import LocalElasticAgent
    from ..agent._quarantine import HostExcluded

    agent = LocalElasticAgent(
        cfg.spec,
        start_method=cfg.start_method,
        log_dir=cfg.log_dir,
        logs_specs=cfg.logs_specs,
        log_line_prefix_template=cfg.log_line_prefix_template,
        shutdown_timeout=cfg.shutdown_timeout,
        preload=list(cfg.preload.now) if cfg.preload is not None else None,
        resilience=cfg.resilience,
    )
    shutdown_rdzv = True
    try:
        return await agent.run()
    except (SignalException, HostExcluded):
        # As torchrun: a node stopped by a signal leaves the rendezvous open,
        # so the job can go on (or scale) without it; so does a host kept out.
        shutdown_rdzv = False
        raise
    finally:
        if shutdown_rdzv and cfg.torch_handler is not None:
            import anyio.to_thread

            await anyio.to_thread.run_sync(cfg.torch_handler.shutdown)


def _prestart(args: argparse.Namespace) -> bool:
    """Start the zygote now, before the configuration imports the agent: its
    imports (torch) overlap ours. ``False`` if it did not (then the first
    spawn starts it, or a bad option is reported by the configuration)."""
    from ._config import early_preload

    try:
        got = early_preload(args)
    except (ValueError, TypeError):
        return False
    if got is None:
        return False
    from .._warm._registry import zygote_for
    from ..agent._env import shared_env

    preload, nproc = got
    # spares for the workers and the first attempt's store
    return zygote_for(preload, shared_env(nproc, os.environ), spares=nproc + 1) is not None


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record to ``sys.stderr`` as it is then: a stream replaced
    since (pytest's capture, a notebook) is never written to once closed."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _setup_logging() -> None:
    level = os.environ.get("LOGLEVEL", "WARNING").upper()
    handler = _StderrHandler()
    handler.setFormatter(
        logging.Formatter("%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s")
    )
    root = logging.getLogger("aiolaunch")
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)  # one per process, however often main() runs
    root.addHandler(handler)
    root.setLevel(getattr(logging, level, logging.WARNING))
    root.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (the table of :mod:`._exit`).

    0: every worker succeeded. 1: the group failed after its restarts (the
    root cause is summarised on stderr), as torchrun; with ``--exit-code
    root-cause``, the root cause's own exit code. 2 (do not retry): bad
    options, nothing to run, or a crash loop. 3: this host is kept out of
    the job (quarantined, or its health check failed). ``128 + N``: signal
    ``N`` stopped the run (the workers were stopped first). On a non-zero
    status the root cause is also written as the termination message.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in VERBS:
        # `aiolaunch status|stacks|top|events|attach`: talk to a running job's control
        # socket (a script named "status" still runs as `aiolaunch ./status`).
        return VERBS[argv[0]](argv[1:])
    from ._init import run_as_init

    init_status = run_as_init()  # PID 1 (a container without an init): reap orphans
    if init_status is not None:
        return init_status
    from ._exit import EXIT_DO_NOT_RETRY, write_termination_message

    args = _parse(argv)
    _setup_logging()
    warm = _prestart(args)
    try:
        try:
            cfg = config_from_args(args)  # bad options first, then what to run
            check_entrypoint(args)
            make_log_dir(cfg.log_root)  # last: nothing is left behind when a check fails
        except (ValueError, TypeError, ImportError, OSError) as exc:
            print(f"aiolaunch: error: {exc}", file=sys.stderr)
            write_termination_message(f"aiolaunch: error: {exc}")
            return EXIT_DO_NOT_RETRY
        warm = warm or cfg.preload is not None
        for notice in cfg.notices:
            print(f"aiolaunch: {notice}", file=sys.stderr)
        for warning in cfg.warnings:
            log.warning(warning)
        return _run(cfg)
    finally:
        if warm:  # the run is over: its zygote too
            from .._warm._registry import close_zygotes

            close_zygotes()


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse; a usage error exits 2 (do not retry) with the termination message."""
    from ._exit import write_termination_message

    try:
        parser = get_args_parser()
    except BadEnvironment as exc:  # e.g. PET_STANDALONE=yes
        write_termination_message(str(exc))
        argparse.ArgumentParser(prog="aiolaunch").error(str(exc))
    exit_ = parser.exit

    def _exit(status: int = 0, message: str | None = None) -> NoReturn:
        if status and message:
            write_termination_message(message.strip())
        exit_(status, message)

    parser.exit = _exit  # type: ignore[method-assign]
    return parser.parse_args(argv)


def _run(cfg: LaunchConfig) -> int:
    from .._errors import ChildFailedError, SignalException
    from .._live._metrics import MetricsBindError
    from ..agent._numa import NumaBindingError
    from ..agent._quarantine import HostExcluded
    from ._exit import (
        EXIT_DO_NOT_RETRY,
        EXIT_HOST_EXCLUDED,
        failure_exit_status,
        failure_message,
        signal_exit_status,
        write_termination_message,
    )

    # The supervisor reads its signal lists from the environment (as torch's
    # PContext does); set for the run, restored after it for in-process callers.
    saved = {key: os.environ.get(key) for key in cfg.environ}
    os.environ.update(cfg.environ)
    try:
        result = asyncio.run(_launch(cfg))
    except NumaBindingError as exc:
        # torchrun fails the same way (a traceback, exit 1) where it cannot bind
        print(f"aiolaunch: error: {exc}", file=sys.stderr)
        write_termination_message(f"aiolaunch: error: {exc}")
        return 1
    except FileNotFoundError as exc:
        # start_processes' check: the binary to run is not on PATH
        print(f"aiolaunch: error: {exc}", file=sys.stderr)
        write_termination_message(f"aiolaunch: error: {exc}")
        return EXIT_DO_NOT_RETRY
    except SignalException as exc:
        from .._signals._names import describe_signal

        name = describe_signal(exc.sigval)
        print(f"aiolaunch: received {name}; all workers were stopped", file=sys.stderr)
        write_termination_message(f"aiolaunch: stopped by {name}; all workers were stopped")
        return signal_exit_status(exc.sigval)
    except HostExcluded as exc:  # quarantined, or its health check failed: the job goes on
        print(f"aiolaunch: {exc.reason}", file=sys.stderr)
        write_termination_message(f"aiolaunch: {exc.reason}")
        return EXIT_HOST_EXCLUDED
    except MetricsBindError as exc:  # --metrics-port in use: nothing started
        print(f"aiolaunch: error: {exc.strerror or exc}", file=sys.stderr)
        write_termination_message(f"aiolaunch: error: {exc.strerror or exc}")
        return EXIT_DO_NOT_RETRY
    except ImportError as exc:  # a preload module failed in the zygote: nothing started
        print(f"aiolaunch: error: {exc}", file=sys.stderr)
        write_termination_message(f"aiolaunch: error: {exc}")
        return EXIT_DO_NOT_RETRY
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if result.is_failed():
        err = ChildFailedError(cfg.entrypoint_name, result.failures)
        print(err.format_msg(), file=sys.stderr)
        message = failure_message(cfg.entrypoint_name, result.failures)
        if result.stopped_early is not None:  # a crash loop: retrying will not help
            print(f"aiolaunch: {result.stopped_early}", file=sys.stderr)
            write_termination_message(f"aiolaunch: {result.stopped_early}\n{message}")
            return EXIT_DO_NOT_RETRY
        write_termination_message(message)
        _, root = err.get_first_failure()
        return failure_exit_status(root, cfg.exit_code)
    return 0
