"""The front door: :func:`start_processes`, :func:`launch`, :func:`free_port`."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ._errors import MainProcessError, SignalException, WorkerError
from ._hangs._watchdog import Watchdog
from ._kinds import MultiprocessContext, SubprocessContext
from ._live._metrics import closed_on_error, metrics_binder
from ._logs import LogWiring
from ._logs._filters import check_filters
from ._logs._specs import LogsDest, LogsSpecs, make_temp_dir, plain_logs_dest, prune_empty_dirs
from ._ready import ReadinessProbe
from ._restart import RestartPolicy
from ._results import root_cause
from ._signals._plan import (
    DEFAULT_SIGNALS_TO_HANDLE,
    FORWARD_SIGNALS_ENV,
    SIGNALS_TO_HANDLE_ENV,
    SignalPlan,
    resolve_signals,
)
from ._types import Std
from ._validate import check_port, check_start_inputs, log_dir_error, pickle_payloads

if TYPE_CHECKING:
    from types import TracebackType

    from ._context import PContext

__all__ = ["free_port", "launch", "start_processes"]

T = TypeVar("T")


class _Starting:
    """What :func:`start_processes` returns: await it, or use it with ``async with``.

    Nothing starts until then. Using it as if it were the context (a
    forgotten ``await``) raises an ``AttributeError`` that says to await it;
    one that is dropped without ever being awaited warns (``RuntimeWarning``,
    as a never-awaited coroutine does).
    """

    def __init__(self, make: Callable[[], PContext], name: str) -> None:
        self._make = make
        self._name = name
        self._ctx: PContext | None = None
        self._used = False

    async def _start(self) -> PContext:
        _require_asyncio()  # before the log folder, pipes or any process exist
        ctx = self._make()
        await ctx.start()
        return ctx

    def __await__(self) -> Generator[Any, None, PContext]:
        self._used = True
        return self._start().__await__()

    async def __aenter__(self) -> PContext:
        self._used = True
        self._ctx = await self._start()
        return self._ctx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._ctx is not None
        await self._ctx.__aexit__(exc_type, exc, tb)

    def __getattr__(self, attr: str) -> Any:
        # Only called for names the class lacks: private and dunder lookups
        # (pickle, copy, hasattr probes) get the plain error.
        if attr.startswith("_"):
            raise AttributeError(attr)
        # Any public name - a method (wait, pids) or an attribute (nprocs,
        # stdouts) - means the caller took this for the context.
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {attr!r}: "
            f"start_processes(name={self._name!r}, ...) returned an awaitable, not the "
            f"context, and nothing has started yet. Await it before using .{attr}: "
            "`ctx = await aiolaunch.start_processes(...)` or "
            "`async with aiolaunch.start_processes(...) as ctx:`"
        )

    def __del__(self) -> None:
        if not getattr(self, "_used", True):
            warnings.warn(
                f"start_processes(name={getattr(self, '_name', '?')!r}, ...) was never "
                "awaited, so no worker started; use `ctx = await start_processes(...)` "
                "or `async with start_processes(...) as ctx:`",
                RuntimeWarning,
                stacklevel=2,
            )


def _require_asyncio() -> None:
    """Fail clearly where there is no asyncio loop (trio, or no loop at all).

    aiolaunch is built on asyncio (subprocess transports, ``loop.add_reader``,
    ``loop.add_signal_handler``); under another event loop it would fail
    half-way, deep in asyncio, after creating the log folder.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return
    found = "no asyncio event loop"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            found = "trio"
        except RuntimeError:
            pass
    raise RuntimeError(
        f"aiolaunch needs an asyncio event loop, but it is running under {found}: "
        "use asyncio.run(), anyio.run(..., backend='asyncio'), or a trio-asyncio loop"
    )


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    log_dir: str | os.PathLike[str] | LogsSpecs | None = None,
    start_method: str = "spawn",
    redirects: Std | dict[int, Std] = Std.NONE,
    tee: Std | dict[int, Std] = Std.NONE,
    *,
    logs_specs: Any = None,
    log_line_prefixes: dict[int, str] | None = None,
    shutdown_timeout: float = 30.0,
    ready: ReadinessProbe | Mapping[int, ReadinessProbe] | None = None,
    restart: RestartPolicy | Mapping[int, RestartPolicy] | None = None,
    console_dedup: float | None = None,
    console_strip_ansi: bool = False,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
    watchdog: Watchdog | None = None,
    signals_to_handle: str | Iterable[str | int] | None = None,
    forward_signals: str | Iterable[str | int] | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    preload: bool | list[str] | tuple[str, ...] | None = None,
) -> _Starting:
    """Start ``len(args)`` copies of ``entrypoint``; await the call or use ``async with``.

    ``ctx = await start_processes(...)`` returns a started :class:`PContext`;
    ``async with start_processes(...) as ctx:`` also closes it on leaving.

    :param name: prefixes console lines (``[{name}{rank}]:``).
    :param entrypoint: a callable (``def`` or ``async def``; function workers in
        multiprocessing children) or a str naming a binary (asyncio subprocesses,
        ``args`` cast with ``str()``).
    :param args: ``{local_rank: tuple}``, keys exactly ``0..n-1``.
    :param envs: ``{local_rank: {str: str}}``, same keys; applied on top of the
        parent's environment (functions: before the entrypoint is unpickled).
    :param log_dir: folder for ``{rank}/stdout.log|stderr.log|error.json``;
        must be empty or missing; ``None``: a fresh temporary folder, whose
        empty parts (it too) go when the group ends; log files are kept even
        when empty; a rank without any has ``error-{rank}.json``, no folder.
        (torch's positional ``logs_specs`` is accepted here too.)
    :param start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"`` (function
        workers; checked for binaries too).
    :param redirects: streams written to log files (``Std`` or ``{rank: Std}``).
    :param tee: streams also shown on the console, prefixed; implies redirect.
    :param logs_specs: a :class:`LogsSpecs` (or torch's) instead of
        ``log_dir``/``redirects``/``tee``; torch's layout.
    :param log_line_prefixes: ``{rank: prefix}`` replacing ``[{name}{rank}]:``.
    :param shutdown_timeout: seconds between the death signal and SIGKILL when
        ``wait()`` fails fast or forwards a signal.
    :param ready: a readiness probe for every rank, or ``{rank: probe}``
        (:class:`ReadyLine`, :class:`ReadyPort`, :class:`ReadyFile`); see
        :meth:`PContext.wait_ready`.
    :param restart: a :class:`RestartPolicy` for every rank, or
        ``{rank: policy}``: such a worker is started again on its own when it
        exits, within the policy's budget, instead of failing the group.
    :param console_dedup: off by default; a window in seconds within which a
        tee'd line printed by several ranks is shown once, as
        ``[{name}0-3]:line`` (ranks with a custom prefix are never merged).
    :param console_strip_ansi: remove ANSI escape sequences (colors, cursor
        moves, window titles) from tee'd lines on the console; log files keep
        every byte.
    :param duplicate_stdout_filters: torch 2.9+: lines of tee'd stdouts that
        contain any of these substrings are also written, prefixed, to one
        ``filtered_stdout.log`` (in ``log_dir``, or the attempt folder of
        ``logs_specs``); ``ctx.filtered_stdout`` is that open file (``None``
        without filters). An empty list makes no file.
    :param duplicate_stderr_filters: the same for stderr (``filtered_stderr.log``).
    :param watchdog: a :class:`Watchdog`: detect stalled workers (no output,
        no CPU), dump every rank's stacks, then observe, fail or restart.
    :param signals_to_handle: the signals that, sent to the supervisor while
        ``wait()`` runs, are forwarded to the workers and stop the group
        (``wait()`` raises :class:`SignalException`), as torch's
        ``TORCHELASTIC_SIGNALS_TO_HANDLE``: ``"SIGTERM,SIGUSR1"`` or a list of
        names or numbers. ``None``: ``$TORCHELASTIC_SIGNALS_TO_HANDLE``, else
        SIGTERM, SIGINT, SIGHUP and SIGQUIT.
    :param forward_signals: beyond torch, a preemption protocol: signals that
        are only passed on to each worker process (not its children) while
        ``wait()`` runs; the group keeps running (e.g. Slurm's
        ``--signal=USR1@90`` as "checkpoint now"). Wins over
        ``signals_to_handle`` for a signal in both. ``None``:
        ``$AIOLAUNCH_FORWARD_SIGNALS``, else none. Every worker gets
        ``AIOLAUNCH_SHUTDOWN_TIMEOUT`` (seconds from the death signal to
        SIGKILL when ``wait()`` stops the group) and
        ``AIOLAUNCH_STOP_DEADLINE_FILE``: empty while the group runs; once it
        is being stopped, the Unix time at which survivors get SIGKILL.
    :param metrics_port: Prometheus metrics at ``http://metrics_host:PORT/metrics``, bound
        before any worker starts (else ``OSError``); ``0``: any port (``ctx.metrics_url``).
    :param metrics_host: where to serve them (``0.0.0.0``: every interface).
    :param preload: warm start (Linux): Python workers - function workers, and
        binaries that are this interpreter running a script or ``-m`` module -
        are forked from a *zygote*, a process that imported these modules once
        (``True``: ``["torch"]``), instead of starting afresh (``start_method``
        is then moot). One zygote per supervisor process and preload list,
        kept for later calls. ``None``/``False`` (default): off. A worker the
        zygote cannot fork faithfully starts the ordinary way, with a one-line
        warning. See README "Warm start" for what a preloaded module must not do.
    Every argument is checked before anything starts or any folder is made;
    each message names the argument and the fix.

    :raises ValueError: bad key sets, an empty ``args``, an unknown start
        method, a non-empty ``log_dir``, an env name that is empty or holds
        ``=``, a NUL byte in an env value or a binary's argument, a ``name``
        with ``/`` when ``log_dir=None``, a ``Std`` outside 0-3.
    :raises TypeError: a bad entrypoint, env key or value, or an unpicklable
        function or argument.
    :raises FileNotFoundError: a binary not on ``PATH`` (or a command line
        given as ``entrypoint``: its arguments go in ``args``).
    :raises IsADirectoryError: an ``entrypoint`` path that is a directory.
    :raises NotADirectoryError: a ``log_dir`` that is a file or lies under one.
    :raises PermissionError: a ``log_dir`` that cannot be created or written
        (at the ``await`` where only the attempt can tell, e.g. as root).
    :raises RuntimeError: not running in an asyncio event loop (e.g. trio).
    :raises ImportError: a ``preload`` module failed to import in the zygote
        (at the ``await``, before any worker started).
    """
    if isinstance(log_dir, LogsSpecs) or (
        log_dir is not None
        and not isinstance(log_dir, str | os.PathLike)
        and callable(getattr(log_dir, "reify", None))
    ):
        if logs_specs is not None:
            raise ValueError("logs_specs was given twice (positionally and by keyword)")
        logs_specs, log_dir = log_dir, None
    check_start_inputs(
        name=name,
        entrypoint=entrypoint,
        args=args,
        envs=envs,
        start_method=start_method,
        log_dir=log_dir,
        redirects=redirects,
        tee=tee,
        logs_specs=logs_specs,
        log_line_prefixes=log_line_prefixes,
        shutdown_timeout=shutdown_timeout,
        console_dedup=console_dedup,
    )
    dup_out = check_filters("duplicate_stdout_filters", duplicate_stdout_filters)
    dup_err = check_filters("duplicate_stderr_filters", duplicate_stderr_filters)
    if watchdog is not None and not isinstance(watchdog, Watchdog):
        raise TypeError(f"watchdog={watchdog!r} must be an aiolaunch.Watchdog or None")
    bind_metrics_port = metrics_binder(metrics_port, metrics_host)  # checked now, bound later
    stop_signals = resolve_signals(
        signals_to_handle,
        what="signals_to_handle",
        env=SIGNALS_TO_HANDLE_ENV,
        default=DEFAULT_SIGNALS_TO_HANDLE,
    )
    only_forwarded = resolve_signals(
        forward_signals,
        what="forward_signals",
        env=FORWARD_SIGNALS_ENV,
        default="",
        strict_env=True,  # a typo would let the preemption signal kill the supervisor
    )
    warm = None
    if preload is not None and preload is not False:
        from ._warm._preload import resolve_preload, workers_folder

        warm = resolve_preload(preload, folder=workers_folder(entrypoint, args[0]))
    nprocs = len(args)
    probes = _per_rank("ready", ready, ReadinessProbe, nprocs)
    policies = _per_rank("restart", restart, RestartPolicy, nprocs)
    args_ = {rank: tuple(args[rank]) for rank in range(nprocs)}
    envs_ = {rank: dict(envs[rank]) for rank in range(nprocs)}
    fn_bytes: bytes = b""
    args_bytes: dict[int, bytes] = {}
    if not isinstance(entrypoint, str):
        fn_bytes, args_bytes = pickle_payloads(entrypoint, args_)
    else:
        args_ = {rank: tuple(str(a) for a in a_) for rank, a_ in args_.items()}

    def make() -> PContext:  # the port first: in use, it fails before any folder or worker
        with closed_on_error(bind_metrics_port()) as metrics:
            return build(metrics)

    def build(metrics: socket.socket | None) -> PContext:
        if logs_specs is not None:
            dest = LogsDest.of(logs_specs.reify(envs_))
        elif log_dir is None:
            folder = make_temp_dir(f"aiolaunch_{name}_")  # the guardian knows it too
            try:
                dest = plain_logs_dest(folder, envs_, redirects, tee, flat_errors=True)
            except BaseException:
                prune_empty_dirs([folder])
                raise
            dest.temp_dirs = [folder]
        else:
            folder = os.fspath(log_dir)
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                # e.g. a read-only or virtual filesystem that access() misses (root)
                raise log_dir_error("log_dir", folder, exc) from exc
            dest = plain_logs_dest(folder, envs_, redirects, tee)
        common: dict[str, Any] = {
            "name": name,
            "entrypoint": entrypoint,
            "args": args_,
            "envs": envs_,
            "logs": LogWiring(
                name=name,
                dest=dest,
                prefixes=log_line_prefixes,
                dedup_window=console_dedup,
                strip_ansi=bool(console_strip_ansi),
                stdout_filters=dup_out,
                stderr_filters=dup_err,
            ),
            "start_method": start_method,
            "ready": probes,
            "restart": {r: p for r, p in policies.items() if p.mode != "never"},
            "watchdog": watchdog,
            "signal_plan": SignalPlan(stop_signals, only_forwarded, float(shutdown_timeout)),
            "metrics": metrics,
            "zygote": None,
        }
        if warm is not None:
            from ._warm._preload import shared_load_env
            from ._warm._zygote import zygote_for

            common["zygote"] = zygote_for(warm, shared_load_env(envs_), spares=nprocs)
        if isinstance(entrypoint, str):
            return SubprocessContext(**common)
        return MultiprocessContext(fn_bytes=fn_bytes, args_bytes=args_bytes, **common)

    return _Starting(make, name)


def _per_rank(what: str, value: Any, cls: type[T], nprocs: int) -> dict[int, T]:
    if value is None:
        return {}
    if isinstance(value, cls):
        return dict.fromkeys(range(nprocs), value)
    if isinstance(value, Mapping):
        for rank, item in value.items():
            if not isinstance(rank, int) or not 0 <= rank < nprocs:
                raise ValueError(f"{what} has rank {rank!r}, but local ranks are 0..{nprocs - 1}")
            if not isinstance(item, cls):
                raise TypeError(f"{what}[{rank}] must be a {cls.__name__}, got {item!r}")
        return dict(value)
    raise TypeError(f"{what}={value!r} must be a {cls.__name__} or a {{rank: {cls.__name__}}} dict")


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it back).

    The socket closes before a worker binds it, so another process could take
    it in between; a fresh port per attempt keeps that window (and TIME_WAIT
    leftovers of a crashed attempt) out of the way. ``SO_REUSEADDR`` lets a
    worker bind the port while the probe's socket is still in TIME_WAIT.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def launch(
    func: Callable[..., Any],
    args: Any,
    nprocs: int,
    master_addr: str = "localhost",
    master_port: int | None = None,
) -> dict[int, Any]:
    """Run ``func(args)`` in ``nprocs`` function workers; return ``{rank: value}``.

    Each worker gets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``
    and ``MASTER_PORT`` (``master_port=None`` picks a free one), ready for
    ``torch.distributed.init_process_group()``.

    :raises WorkerError: a worker failed (the first one); the others were stopped.
    :raises MainProcessError: the supervisor got SIGINT/SIGTERM; workers were stopped.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be an int >= 1 (the number of workers)")
    if not isinstance(master_addr, str) or not master_addr:
        raise TypeError(
            f"master_addr={master_addr!r} must be a non-empty str host, e.g. 'localhost'"
        )
    if master_port is not None:
        check_port("master_port", master_port)
    port = master_port if master_port is not None else free_port()
    envs = {
        rank: {
            "WORLD_SIZE": str(nprocs),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
        }
        for rank in range(nprocs)
    }
    name = getattr(func, "__name__", "worker")
    async with start_processes(
        name=name,
        entrypoint=func,
        args={rank: (args,) for rank in range(nprocs)},
        envs=envs,
    ) as ctx:
        try:
            result = await ctx.wait()
        except SignalException as exc:
            raise MainProcessError(exc.sigval) from exc
        assert result is not None
        if result.is_failed():
            rank, failure = root_cause(result.failures)
            raise WorkerError(failure.exitcode, rank, failure)
        return dict(result.return_values)
