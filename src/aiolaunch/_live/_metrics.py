"""Prometheus metrics of one group: the text exposition format, served over HTTP on the loop.

``start_processes(..., metrics_port=PORT)`` (CLI ``--metrics-port``) serves
``GET /metrics`` on ``127.0.0.1:PORT`` (``metrics_host`` / ``--metrics-host``
widens it) for as long as the group runs. The exposition is written by hand
(format 0.0.4, what every Prometheus scrapes; the tests parse it with
``prometheus_client``'s own parser): no dependency, and no exporter thread -
a scrape is one status snapshot taken on the loop, like ``aiolaunch status``.

Per rank, labelled ``rank`` (see :data:`WORKER_METRICS`); per group and for
the supervisor process itself, see :data:`GROUP_METRICS`. A sample that is
unknown (the output age before the first sample, the step rate without
``--progress-regex``, the exit code of a running rank) is left out rather
than written as NaN.

The HTTP side is the least a scraper needs: HTTP/1.1 ``GET``/``HEAD``,
keep-alive, a 16 KiB request head, 60 s of idleness per connection. Anything
else is answered 404/405/400 and the connection closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from .._sections import section_metrics, sections

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

__all__ = [
    "CONTENT_TYPE",
    "GROUP_METRICS",
    "STATES",
    "WORKER_METRICS",
    "MetricsBindError",
    "MetricsEndpoint",
    "MetricsServer",
    "bind_metrics",
    "closed_on_error",
    "metrics_binder",
    "render_metrics",
    "render_sections",
    "url_of",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: every state a rank can be in (``aiolaunch_worker_state`` has one sample each)
STATES = (
    "starting",
    "running",
    "sleeping",
    "disk-sleep",
    "stopped",
    "stalled",
    "restarting",
    "exited",
)

#: name, type, help, the status field it reads (per rank)
WORKER_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("aiolaunch_worker_up", "gauge", "1 while the rank's process runs, else 0.", "up"),
    ("aiolaunch_worker_state", "gauge", "1 for the rank's state, 0 for the others.", "state"),
    ("aiolaunch_worker_pid", "gauge", "Process id of the rank's current incarnation.", "pid"),
    ("aiolaunch_worker_restarts_total", "counter", "Times the rank was restarted.", "restarts"),
    (
        "aiolaunch_worker_last_output_age_seconds",
        "gauge",
        "Seconds since the rank last wrote output.",
        "last_output_s",
    ),
    ("aiolaunch_worker_stalls_total", "counter", "Stalls flagged on the rank.", "stalls"),
    ("aiolaunch_worker_straggling", "gauge", "1 while the rank straggles.", "straggling"),
    (
        "aiolaunch_worker_lateness_seconds",
        "gauge",
        "Median lateness of the rank's arrivals at collectives, against the earliest rank.",
        "lateness_s",
    ),
    ("aiolaunch_worker_cpu_seconds_total", "counter", "CPU time (user+system).", "cpu_s"),
    ("aiolaunch_worker_resident_memory_bytes", "gauge", "Resident memory.", "rss"),
    (
        "aiolaunch_worker_progress_lines_total",
        "counter",
        "Output lines matching --progress-regex (steps).",
        "steps",
    ),
    (
        "aiolaunch_worker_steps_per_second",
        "gauge",
        "Lines matching --progress-regex per second, over the last minute.",
        "step_rate",
    ),
    (
        "aiolaunch_worker_exit_code",
        "gauge",
        "Exit status of an exited rank (-N: killed by signal N).",
        "exitcode",
    ),
)

#: name, type, help (per group, and the supervisor process)
GROUP_METRICS: tuple[tuple[str, str, str], ...] = (
    ("aiolaunch_group_info", "gauge", "The group's name and log folder (value 1)."),
    ("aiolaunch_group_workers", "gauge", "Ranks in the group."),
    ("aiolaunch_group_workers_in_state", "gauge", "Ranks in each state."),
    ("aiolaunch_group_restarts_total", "counter", "Rank restarts, all ranks together."),
    ("aiolaunch_group_stalls_total", "counter", "Stalls flagged, all ranks together."),
    ("aiolaunch_group_start_time_seconds", "gauge", "When the group started (Unix time)."),
    ("process_cpu_seconds_total", "counter", "CPU time of the supervisor process."),
    ("process_resident_memory_bytes", "gauge", "Resident memory of the supervisor process."),
    ("process_open_fds", "gauge", "Open file descriptors of the supervisor process."),
    ("process_start_time_seconds", "gauge", "When the supervisor process started (Unix time)."),
)

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _label(value: object) -> str:
    text = str(value)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))  # shortest round-trip form; NaN/inf never reach here


def _worker_value(w: Mapping[str, Any], field: str) -> float | None:
    if field == "up":
        return int(w.get("state") not in ("exited", "restarting", "starting"))
    value = w.get(field)
    if value is None or isinstance(value, str):
        return None
    if field == "pid" and not value:
        return None
    return value  # type: ignore[no-any-return]


def render_metrics(snapshot: Mapping[str, Any]) -> str:
    """The exposition of a status snapshot (``{"name", "log_dir", "workers", ...}``)."""
    workers: Sequence[Mapping[str, Any]] = snapshot.get("workers", ())
    out: list[str] = []
    for name, kind, help_, field in WORKER_METRICS:
        lines: list[str] = []
        for w in workers:
            rank = w["rank"]
            if field == "state":
                now = w.get("state")
                lines.extend(f'{name}{{rank="{rank}",state="{s}"}} {int(s == now)}' for s in STATES)
                continue
            value = _worker_value(w, field)
            if value is not None:
                lines.append(f'{name}{{rank="{rank}"}} {_number(value)}')
        if lines:
            out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}")
            out.extend(lines)
    out.extend(_group_lines(snapshot, workers))
    out.extend(section_metrics(dict(snapshot)))  # the job's sections (its hosts)
    return "\n".join(out) + "\n"


def render_sections() -> str:
    """The job's own samples (its sections: an agent's hosts), without a
    group's: what the job's endpoint serves between two attempts."""
    lines = section_metrics(sections())
    return "\n".join(lines) + "\n" if lines else ""


def _group_lines(snapshot: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> list[str]:
    counts = dict.fromkeys(STATES, 0)
    for w in workers:
        state = w.get("state", "")
        counts[state] = counts.get(state, 0) + 1
    name = _label(snapshot.get("name", ""))
    log_dir = _label(snapshot.get("log_dir", ""))
    values: dict[str, Iterable[tuple[str, float]]] = {
        "aiolaunch_group_info": [(f'{{group="{name}",log_dir="{log_dir}"}}', 1)],
        "aiolaunch_group_workers": [("", len(workers))],
        "aiolaunch_group_workers_in_state": [
            (f'{{state="{_label(s)}"}}', n) for s, n in counts.items()
        ],
        "aiolaunch_group_restarts_total": [("", sum(w.get("restarts", 0) for w in workers))],
        "aiolaunch_group_stalls_total": [("", sum(w.get("stalls", 0) for w in workers))],
    }
    if snapshot.get("start_time") is not None:
        values["aiolaunch_group_start_time_seconds"] = [("", snapshot["start_time"])]
    values.update(_process_values())
    out: list[str] = []
    for name, kind, help_ in GROUP_METRICS:
        samples = list(values.get(name, ()))
        if samples:
            out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {_number(v)}" for labels, v in samples)
    return out


def _process_values() -> dict[str, list[tuple[str, float]]]:
    """The supervisor's own ``process_*`` samples (Linux ``/proc``; none elsewhere)."""
    from .._workers._proc import boot_time, open_fds, read_stat

    stat, btime, fds = read_stat("self"), boot_time(), open_fds()
    if stat is None or btime is None or fds is None:
        return {}
    return {
        "process_cpu_seconds_total": [("", (stat.utime + stat.stime) / _CLK_TCK)],
        "process_resident_memory_bytes": [("", stat.rss_pages * _PAGE)],
        "process_open_fds": [("", len(fds))],
        "process_start_time_seconds": [("", btime + stat.starttime / _CLK_TCK)],
    }


# -- the HTTP server ---------------------------------------------------------------

_MAX_HEAD = 16 * 1024
_IDLE_S = 60.0


def metrics_binder(port: int | None, host: str) -> Callable[[], socket.socket | None]:
    """Check ``metrics_port``/``metrics_host`` now (at ``start_processes``); the
    function returned binds the socket (``None`` without a port).

    :raises TypeError: a port that is not an int, a host that is not a str.
    :raises ValueError: a port outside 0..65535.
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"metrics_host={host!r} must be a host name or address (a str)")
    if port is None:
        return _no_metrics  # the usual case, on every start: nothing to import or make
    from .._validate import check_port

    check_port("metrics_port", port, zero=True)
    return lambda: bind_metrics(host, port)


def _no_metrics() -> None:
    return None


@contextlib.contextmanager
def closed_on_error(sock: socket.socket | None) -> Iterator[socket.socket | None]:
    """``sock`` for the block; closed if the block raises (it was not handed over)."""
    try:
        yield sock
    except BaseException:
        if sock is not None:
            sock.close()
        raise


class MetricsBindError(OSError):
    """The metrics address cannot be bound; the message names it and the fix."""


def bind_metrics(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: any free port).

    :raises MetricsBindError: it cannot be bound; the message names the address and the fix.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise MetricsBindError(
            f"metrics_host={host!r} is not an address of this machine: {exc}"
        ) from exc
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(64)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise MetricsBindError(
            exc.errno,
            f"cannot serve metrics on {host}:{port}: {exc.strerror}; pick another "
            "metrics_port (--metrics-port), or 0 for any free port",
        ) from exc
    return sock


def _url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def url_of(sock: socket.socket) -> str:
    """``http://host:port/metrics`` of a socket from :func:`bind_metrics`."""
    host, port = sock.getsockname()[:2]
    return _url(host, port)


class MetricsServer:
    """``GET /metrics`` on a bound socket until :meth:`aclose`; ``collect()`` gives the text."""

    def __init__(
        self,
        server: asyncio.AbstractServer,
        sock: socket.socket,
        conns: dict[asyncio.Task[None], asyncio.StreamWriter],
    ) -> None:
        self._server = server
        host, port = sock.getsockname()[:2]
        self.address: tuple[str, int] = (host, port)
        # The connections (task, writer), added and removed by serve() (see start()).
        self._conns = conns

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        return _url(*self.address)

    @classmethod
    async def start(cls, sock: socket.socket, collect: Callable[[], str]) -> MetricsServer:
        """Serve on ``sock`` (from :func:`bind_metrics`; the server owns it from here)."""
        conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            conns[task] = writer
            try:
                await _http(reader, writer, collect)
            finally:
                conns.pop(task, None)
                writer.close()

        try:
            server = await asyncio.start_server(serve, sock=sock, limit=_MAX_HEAD)
        except BaseException:
            sock.close()
            raise
        return cls(server, sock, conns)

    def close(self) -> None:
        """Stop listening and end open connections. Idempotent.

        A connection ends by its transport's abort: its task sees the stream
        end and returns. Not by cancelling the task: asyncio's server (3.10,
        3.11) asks a cancelled connection task for its exception, and the
        loop then logs a traceback to stderr for every connection open at
        the end of a group (every keep-alive scraper, at every restart).
        """
        self._server.close()
        for writer in self._conns.values():
            writer.transport.abort()

    async def aclose(self) -> None:
        """:meth:`close`, then wait for the connections' tasks to end."""
        self.close()
        conns = list(self._conns)
        if conns:
            await asyncio.gather(*conns, return_exceptions=True)


class MetricsEndpoint:
    """A ``/metrics`` address that may outlive the groups it shows.

    The bound socket, served from the first time :meth:`serve` is awaited
    (on that loop) until :meth:`aclose`; a scrape renders what :meth:`show`
    set last, or ``idle()`` while nothing is shown. A group started with
    ``start_processes(metrics_port=)`` owns one and closes it with itself;
    the elastic agent owns one for its whole run, so that the address a
    scraper is pointed at lives as long as the job: each attempt's group
    shows itself while it runs, and between attempts the job's own samples
    are served (a port taken by someone else between two attempts can no
    longer end the job).

    :param sock: a socket from :func:`bind_metrics`; owned from here on.
    :param idle: the text while no group is shown (default: no sample).
    """

    def __init__(self, sock: socket.socket, idle: Callable[[], str] = lambda: "") -> None:
        self._sock: socket.socket | None = sock
        #: ``http://host:port/metrics``
        self.url = url_of(sock)
        self._idle = idle
        self._render = idle
        self._server: MetricsServer | None = None

    @property
    def serving(self) -> bool:
        """Whether scrapes are answered now."""
        return self._server is not None

    async def serve(self) -> None:
        """Answer scrapes from now on (idempotent). A failure is logged, never
        raised: a metrics endpoint must never stop a job."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            self._server = await MetricsServer.start(sock, lambda: self._render())
        except OSError as exc:
            logging.getLogger("aiolaunch").warning("aiolaunch: no metrics server: %s", exc)

    def show(self, render: Callable[[], str]) -> Callable[[], None]:
        """Serve ``render()`` until the returned call (idempotent) takes it back."""
        self._render = render

        def unshow() -> None:
            if self._render is render:
                self._render = self._idle

        return unshow

    def close(self) -> None:
        """Stop listening and end open scrapes (also an endpoint never served). Idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._server is not None:
            self._server.close()

    async def aclose(self) -> None:
        """:meth:`close`, then wait for the scrapes' tasks to end."""
        self.close()
        server, self._server = self._server, None
        if server is not None:
            await server.aclose()


async def _http(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, collect: Callable[[], str]
) -> None:
    with contextlib.suppress(
        ConnectionError,
        asyncio.IncompleteReadError,
        asyncio.LimitOverrunError,
        asyncio.TimeoutError,
        TimeoutError,
        ValueError,
    ):
        while True:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IDLE_S)
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                await _respond(writer, 400, "text/plain", b"bad request\n", keep=False)
                return
            method, target, version = parts
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            conn = headers.get("connection", "").lower()
            keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
            if "content-length" in headers or "transfer-encoding" in headers:
                keep = False  # we never read request bodies: don't reuse the stream
            if method not in ("GET", "HEAD"):
                await _respond(writer, 405, "text/plain", b"only GET\n", keep=False)
                return
            path = target.split("?", 1)[0]
            if path == "/metrics":
                body = collect().encode()
                status, ctype = 200, CONTENT_TYPE
            elif path == "/":
                body = b"aiolaunch: the metrics are at /metrics\n"
                status, ctype = 200, "text/plain; charset=utf-8"
            else:
                body, status, ctype = b"not found: try /metrics\n", 404, "text/plain"
            await _respond(writer, status, ctype, body, keep=keep, head_only=method == "HEAD")
            if not keep:
                return


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


async def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    ctype: str,
    body: bytes,
    *,
    keep: bool,
    head_only: bool = False,
) -> None:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n"
        + ("Allow: GET, HEAD\r\n" if status == 405 else "")
        + "\r\n"
    )
    writer.write(head.encode() + (b"" if head_only else body))
    await writer.drain()
