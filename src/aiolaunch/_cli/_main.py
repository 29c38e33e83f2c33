"""``main``: parse, configure, run the agent on a fresh event loop, report."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import TYPE_CHECKING

from ._checks import make_log_dir
from ._client import VERBS
from ._config import LaunchConfig, config_from_args
from ._parser import parse_args

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..agent import RunResult

__all__ = ["main"]

log = logging.getLogger("aiolaunch.cli")


async def _launch(cfg: LaunchConfig) -> RunResult:
    from .._errors import SignalException
    from ..agent import LocalElasticAgent

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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in VERBS:
        # `aiolaunch status|stacks|top`: talk to a running job's control
        # socket (a script named "status" still runs as `aiolaunch ./status`).
        return VERBS[argv[0]](argv[1:])
    args = parse_args(argv)
    _setup_logging()
    try:
        cfg = config_from_args(args, check_program=True)
        make_log_dir(cfg.log_root)
    except (ValueError, TypeError, ImportError, OSError) as exc:
        # Bad options, or a program that cannot start (a missing script:
        # python and torchrun's workers exit 2 too): nothing was started.
        print(f"aiolaunch: error: {exc}", file=sys.stderr)
        return 2
    for warning in cfg.warnings:
        log.warning(warning)
    from .._errors import ChildFailedError, SignalException
    from ..agent._numa import NumaBindingError

    # The supervisor reads its signal lists from the environment (as torch's
    # PContext does); set for the run, restored after it for in-process callers.
    saved = {key: os.environ.get(key) for key in cfg.environ}
    os.environ.update(cfg.environ)
    try:
        result = asyncio.run(_launch(cfg))
    except NumaBindingError as exc:
        # torchrun fails the same way (a traceback, exit 1) where it cannot bind
        print(f"aiolaunch: error: {exc}", file=sys.stderr)
        return 1
    except SignalException as exc:
        from .._signames import describe_signal

        name = describe_signal(exc.sigval)
        print(f"aiolaunch: received {name}; all workers were stopped", file=sys.stderr)
        return 1
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if result.is_failed():
        err = ChildFailedError(cfg.entrypoint_name, result.failures)
        print(err.format_msg(), file=sys.stderr)
        return 1
    return 0
