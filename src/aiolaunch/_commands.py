"""The control socket's commands: a table of handlers, one per command.

A request is one JSON object with ``"cmd"``; a handler gets the group's
narrow control face (:class:`ControlTarget`) and the request, and gives back
one answer (a dict) or, for a streaming command, an async iterator of
answers. Every answer carries ``"ok"`` and the protocol version ``"v"``
(:data:`PROTOCOL_VERSION`); a failed request gets ``{"ok": false,
"error": ...}``. A command's docstring is its help (``{"cmd": "help"}``),
as circus's ``commands/`` do.

Adding a command is one handler decorated with :func:`command`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ._dumper import check_dump_timeout
from ._stacks import StackReport

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping, Sequence

    from ._dumper import Dump
    from ._status import WorkerStatus

__all__ = ["COMMANDS", "PROTOCOL_VERSION", "Command", "ControlTarget", "command", "dispatch"]

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


async def dispatch(target: ControlTarget, request: object) -> AsyncIterator[Answer]:
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
            yield {"ok": True, "v": PROTOCOL_VERSION, **answer}
    except Exception as exc:  # a bad request must not kill the server
        error = str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"
        yield {"ok": False, "v": PROTOCOL_VERSION, "error": error}


@command("help")
async def _help(target: ControlTarget, request: Mapping[str, Any]) -> Answer:
    """The commands and what each does."""
    return {"commands": {name: c.help for name, c in sorted(COMMANDS.items())}}


@command("status")
async def _status(target: ControlTarget, request: Mapping[str, Any]) -> Answer:
    """Every rank's state now: pid, state, restarts, seconds since output, CPU %, RSS."""
    return {
        "name": target.name,
        "log_dir": target.log_dir,
        "workers": [s.to_json() for s in target.status()],
    }


@command("stacks")
async def _stacks(target: ControlTarget, request: Mapping[str, Any]) -> Answer:
    """Dump every rank's stacks (``"timeout"``: seconds per rank, default 5) and the verdict."""
    try:
        timeout = check_dump_timeout('"timeout"', request.get("timeout", 5.0))
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    dump = await target.dump(None, timeout)
    report = StackReport.from_dumps(dump.stacks)
    return {
        "stacks": {str(r): t for r, t in dump.stacks.items()},
        "files": {str(r): p for r, p in dump.files.items()},
        "verdict": str(report),
        "report": report.to_json(),
    }
