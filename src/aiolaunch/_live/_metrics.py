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
import os
import socket
from typing import TYPE_CHECKING, Any

from ._sections import section_metrics

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

__all__ = [
    "CONTENT_TYPE",
    "GROUP_METRICS",
    "STATES",
    "WORKER_METRICS",
    "MetricsServer",
    "bind_metrics",
    "closed_on_error",
    "metrics_binder",
    "render_metrics",
    "url_of",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: every state a rank can be in (``aiolaunch_worker_state`` has one sample each)
STATES = (
    "starting", "running", "sleeping", "disk-sleep", "stopped", "stalled", "restarting", "exited",
)  # fmt: skip

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
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        fds = len(os.listdir("/proc/self/fd"))
    except (OSError, StopIteration, IndexError, ValueError):
        return {}
    # fields[0] is the state (field 3): utime is field 14, starttime 22, rss 24
    cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return {
        "process_cpu_seconds_total": [("", cpu)],
        "process_resident_memory_bytes": [("", int(fields[21]) * _PAGE)],
        "process_open_fds": [("", fds)],
        "process_start_time_seconds": [("", btime + int(fields[19]) / _CLK_TCK)],
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


def bind_metrics(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: any free port).

    :raises OSError: it cannot be bound; the message names the address and the fix.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"metrics_host={host!r} is not an address of this machine: {exc}") from exc
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(64)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(
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
        conns: set[asyncio.Task[None]],
    ) -> None:
        self._server = server
        host, port = sock.getsockname()[:2]
        self.address: tuple[str, int] = (host, port)
        # The connection tasks, added and removed by serve() (see start()).
        self._conns = conns

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        return _url(*self.address)

    @classmethod
    async def start(cls, sock: socket.socket, collect: Callable[[], str]) -> MetricsServer:
        """Serve on ``sock`` (from :func:`bind_metrics`; the server owns it from here)."""
        conns: set[asyncio.Task[None]] = set()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            conns.add(task)
            try:
                await _http(reader, writer, collect)
            finally:
                conns.discard(task)
                writer.close()

        try:
            server = await asyncio.start_server(serve, sock=sock, limit=_MAX_HEAD)
        except BaseException:
            sock.close()
            raise
        return cls(server, sock, conns)

    def close(self) -> None:
        """Stop listening and end open connections. Idempotent."""
        self._server.close()
        for task in self._conns:
            task.cancel()

    async def aclose(self) -> None:
        """:meth:`close`, then wait for the connections' tasks to end."""
        self.close()
        conns = list(self._conns)
        if conns:
            await asyncio.gather(*conns, return_exceptions=True)


async def _http(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, collect: Callable[[], str]
) -> None:
    with contextlib.suppress(
        ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
        asyncio.TimeoutError, TimeoutError, ValueError,
    ):  # fmt: skip
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
