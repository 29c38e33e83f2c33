"""The control socket's commands: a table of handlers, one per command.

A request is one JSON object with ``"cmd"``; a handler gets the group's
narrow control face (:class:`ControlTarget`) and the request, and gives back
one answer (a dict) or, for a streaming command, an async iterator of
answers. Every answer carries ``"ok"`` and the protocol version ``"v"``
(:data:`PROTOCOL_VERSION`); a failed request gets ``{"ok": false,
"error": ...}``. A command's docstring is its help (``{"cmd": "help"}``),
as circus's ``commands/`` do.

Adding a command is one handler decorated with :func:`command`. A command
that turns the connection into something else (``attach``: a byte pipe to a
rank's debugger) ends its answers with a :class:`~aiolaunch._live._control.Takeover`:
the server then hands the connection to it, and it writes its own (versioned)
answer first.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .._hangs._dumper import check_dump_timeout
from .._hangs._stacks import StackReport
from .._sections import sections
from ._control import Takeover, encode
from ._event_json import event_to_json

if TYPE_CHECKING:
    import asyncio
    from collections.abc import AsyncIterator, Callable, Mapping, Sequence
    from contextlib import AbstractAsyncContextManager

    from .._events import Event
    from .._hangs._dumper import Dump
    from ._attach import Session
    from ._status import WorkerStatus

__all__ = [
    "COMMANDS",
    "PROTOCOL_VERSION",
    "Command",
    "ControlTarget",
    "Takeover",
    "command",
    "dispatch",
    "status_answer",
]

#: The version of the control protocol, in every answer. Bumped when an
#: answer changes incompatibly; new commands and new fields do not bump it.
PROTOCOL_VERSION = 1

Answer = dict[str, Any]


class ControlTarget(Protocol):
    """What a command may see of a running group (and nothing else)."""

    @property
    def name(self) -> str:
        """The group's name."""

    @property
    def log_dir(self) -> str:
        """The folder holding its rank folders and ``control.sock``."""

    def status(self) -> list[WorkerStatus]:
        """Every rank's state now."""

    async def dump(self, ranks: Sequence[int] | None, timeout: float) -> Dump:
        """A round of stack dumps of ``ranks`` (all: ``None``)."""

    @property
    def started(self) -> float:
        """When the group started (Unix time)."""

    @property
    def metrics_url(self) -> str | None:
        """Where its Prometheus metrics are served (``None``: nowhere)."""

    def events(self) -> AsyncIterator[Event]:
        """Its lifecycle events, history first, until it stops."""

    @property
    def earlier(self) -> Sequence[Event]:
        """The lifecycle events of the job's earlier attempts (agent's groups)."""

    def attach(self, rank: int, timeout: float) -> AbstractAsyncContextManager[Session]:
        """A pdb session with ``rank``'s process for the ``async with`` block."""


class RequestError(ValueError):
    """A request the command cannot take; its message is the answer's ``error``."""


@dataclass(frozen=True)
class Command:
    """One control command: its name and handler; the handler's docstring is its help."""

    name: str
    handler: Callable[[ControlTarget, Mapping[str, Any]], Any]

    @property
    def help(self) -> str:
        """The first paragraph of the handler's docstring."""
        return (inspect.getdoc(self.handler) or "").split("\n\n")[0].replace("\n", " ")


#: every command, by name
COMMANDS: dict[str, Command] = {}


def command(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated handler as command ``name``."""

    def register(handler: Callable[..., Any]) -> Callable[..., Any]:
        COMMANDS[name] = Command(name, handler)
        return handler

    return register


async def dispatch(target: ControlTarget, request: object) -> AsyncIterator[Answer | Takeover]:
    """The answers to one request: one, or several for a streaming command.

    Never raises for a bad request or a failing handler: the answer says why.
    """
    try:
        if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
            raise RequestError('a request is a JSON object with "cmd", e.g. {"cmd": "status"}')
        cmd = COMMANDS.get(request["cmd"])
        if cmd is None:
            known = ", ".join(sorted(COMMANDS))
            raise RequestError(f"unknown command {request['cmd']!r} ({known})")
        out = cmd.handler(target, request)
        if inspect.isawaitable(out):
            yield {"ok": True, "v": PROTOCOL_VERSION, **(await out)}
            return
        async for answer in out:
            if isinstance(answer, Takeover):
                yield answer
                return
            yield {"ok": True, "v": PROTOCOL_VERSION, **answer}
    except Exception as exc:  # a bad request must not kill the server
        error = str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"
        yield {"ok": False, "v": PROTOCOL_VERSION, "error": error}


@command("help")
async def _help(target: ControlTarget, request: Mapping[str, Any]) -> Answer:
    """The commands and what each does."""
    return {"commands": {name: c.help for name, c in sorted(COMMANDS.items())}}


def status_answer(target: ControlTarget) -> Answer:
    """The ``status`` answer (without ``ok``/``v``): also what the metrics show."""
    return {
        "name": target.name,
        "log_dir": target.log_dir,
        "supervisor_pid": os.getpid(),
        "start_time": target.started,
        "metrics": target.metrics_url,
        "workers": [s.to_json() for s in target.status()],
        **sections(),  # the job's: its hosts (an agent's rounds)
    }


@command("status")
async def _status(target: ControlTarget, request: Mapping[str, Any]) -> Answer:
    """Every rank's state now: pid, state, restarts, seconds since output, CPU %, RSS,
    CPU seconds, stalls, steps and step rate (with a progress regex), marks."""
    return status_answer(target)


@command("stacks")
async def _stacks(target: ControlTarget, request: Mapping[str, Any]) -> Answer:
    """Dump every rank's stacks (``"ranks"``: only these; ``"timeout"``: seconds per
    rank, default 5) and the verdict."""
    try:
        timeout = check_dump_timeout('"timeout"', request.get("timeout", 5.0))
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    ranks = request.get("ranks")
    if ranks is not None:
        nprocs = len(target.status())
        if not isinstance(ranks, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < nprocs for r in ranks
        ):
            raise RequestError(f'"ranks"={ranks!r} must be a list of local ranks 0..{nprocs - 1}')
    dump = await target.dump(ranks, timeout)
    report = StackReport.from_dumps(dump.stacks)
    return {
        "stacks": {str(r): t for r, t in dump.stacks.items()},
        "files": {str(r): p for r, p in dump.files.items()},
        "verdict": str(report),
        "report": report.to_json(),
    }


@command("events")
async def _events(target: ControlTarget, request: Mapping[str, Any]) -> AsyncIterator[Answer]:
    """Stream the group's lifecycle events: a header answer, then one answer per event
    (history first) until ``group_stopped``; ``_event_json.py`` has their fields.

    A group that is one attempt of an agent's job first replays the earlier
    attempts' events; the header's ``"earlier"`` says how many (a follower
    that saw them already skips them, and prints those it missed).
    """
    earlier = target.earlier
    yield {
        "stream": "events",
        "name": target.name,
        "supervisor_pid": os.getpid(),
        "earlier": len(earlier),
    }
    for event in earlier:
        yield event_to_json(event, version=PROTOCOL_VERSION, group=target.name)
    async for event in target.events():
        yield event_to_json(event, version=PROTOCOL_VERSION, group=target.name)


@command("attach")
async def _attach(
    target: ControlTarget, request: Mapping[str, Any]
) -> AsyncIterator[Answer | Takeover]:
    """Open a pdb session in rank ``"rank"`` (``"timeout"``: seconds it has to take the
    signal, default 10); after the answer the connection carries the session."""
    rank = request.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise RequestError(f'"rank"={rank!r} must be a local rank (an int)')
    try:
        timeout = check_dump_timeout('"timeout"', request.get("timeout", 10.0))
    except ValueError as exc:
        raise RequestError(str(exc)) from None

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from ._attach import AttachError, peer_uid, relay

        def answer(**fields: Any) -> None:
            writer.write(encode({"v": PROTOCOL_VERSION, **fields}))

        uid = peer_uid(writer)
        if uid is not None and uid != os.geteuid():
            # The socket is 0600 already; root can connect anyway, and a job's
            # ranks belong to its user: only that user gets a prompt in them.
            answer(ok=False, error=f"uid {uid} may not attach: only the job's user can")
            return
        try:
            async with target.attach(rank, timeout) as s:
                answer(ok=True, rank=rank, pid=s.pid, name=target.name)
                await writer.drain()
                await relay((reader, writer), (s.reader, s.writer))
        except AttachError as exc:
            answer(ok=False, error=f"rank {rank}: {exc}")

    yield Takeover(session)
