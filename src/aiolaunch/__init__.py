"""aiolaunch: an asyncio-native process supervisor.

Launch ``n`` copies of a worker (a Python function or a binary), carry their
output into per-rank log files and a prefixed console, and ``await`` their
exits the moment they happen. The async re-imagining of
``torch.distributed.elastic.multiprocessing`` and ``torchrun``.

``import aiolaunch`` is cheap (about a millisecond, and never imports torch):
public names are loaded on first use. That keeps function workers, which
import this package in every child, fast to start.
"""

from __future__ import annotations

import importlib

from ._version import __version__ as __version__

# Not `from typing import TYPE_CHECKING`: importing typing costs milliseconds
# in every function worker; type checkers treat this name specially.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ._api import free_port as free_port
    from ._api import launch as launch
    from ._api import start_processes as start_processes
    from ._child._error_file import record as record
    from ._context import PContext as PContext
    from ._errors import ChildFailedError as ChildFailedError
    from ._errors import MainProcessError as MainProcessError
    from ._errors import SignalException as SignalException
    from ._errors import WorkerError as WorkerError
    from ._events import Event as Event
    from ._events import EventsDropped as EventsDropped
    from ._events import GroupStopped as GroupStopped
    from ._events import LogLine as LogLine
    from ._events import WorkerExited as WorkerExited
    from ._events import WorkerReady as WorkerReady
    from ._events import WorkerRestarting as WorkerRestarting
    from ._events import WorkerStalled as WorkerStalled
    from ._events import WorkerStarted as WorkerStarted
    from ._events import WorkerStraggling as WorkerStraggling
    from ._hangs._stacks import StackReport as StackReport
    from ._hangs._watchdog import Watchdog as Watchdog
    from ._kinds import MultiprocessContext as MultiprocessContext
    from ._kinds import SubprocessContext as SubprocessContext
    from ._live._status import WorkerStatus as WorkerStatus
    from ._logs import set_console_hook as set_console_hook
    from ._logs._specs import DefaultLogsSpecs as DefaultLogsSpecs
    from ._logs._specs import LogsDest as LogsDest
    from ._logs._specs import LogsSpecs as LogsSpecs
    from ._ready import ReadinessProbe as ReadinessProbe
    from ._ready import ReadyFile as ReadyFile
    from ._ready import ReadyLine as ReadyLine
    from ._ready import ReadyPort as ReadyPort
    from ._restart import RestartPolicy as RestartPolicy
    from ._results import ProcessFailure as ProcessFailure
    from ._results import RunProcsResult as RunProcsResult
    from ._types import Std as Std
    from ._types import to_map as to_map

# public name -> private module that defines it
_EXPORTS: dict[str, str] = {
    "ChildFailedError": "._errors",
    "DefaultLogsSpecs": "._logs._specs",
    "Event": "._events",
    "EventsDropped": "._events",
    "GroupStopped": "._events",
    "LogLine": "._events",
    "LogsDest": "._logs._specs",
    "LogsSpecs": "._logs._specs",
    "MainProcessError": "._errors",
    "MultiprocessContext": "._kinds",
    "PContext": "._context",
    "ProcessFailure": "._results",
    "ReadinessProbe": "._ready",
    "ReadyFile": "._ready",
    "ReadyLine": "._ready",
    "ReadyPort": "._ready",
    "RestartPolicy": "._restart",
    "RunProcsResult": "._results",
    "SignalException": "._errors",
    "StackReport": "._hangs._stacks",
    "Std": "._types",
    "SubprocessContext": "._kinds",
    "Watchdog": "._hangs._watchdog",
    "WorkerError": "._errors",
    "WorkerExited": "._events",
    "WorkerReady": "._events",
    "WorkerRestarting": "._events",
    "WorkerStalled": "._events",
    "WorkerStarted": "._events",
    "WorkerStatus": "._live._status",
    "WorkerStraggling": "._events",
    "free_port": "._api",
    "launch": "._api",
    "record": "._child._error_file",
    "set_console_hook": "._logs",
    "start_processes": "._api",
    "to_map": "._types",
}

__all__ = [
    "ChildFailedError",
    "DefaultLogsSpecs",
    "Event",
    "EventsDropped",
    "GroupStopped",
    "LogLine",
    "LogsDest",
    "LogsSpecs",
    "MainProcessError",
    "MultiprocessContext",
    "PContext",
    "ProcessFailure",
    "ReadinessProbe",
    "ReadyFile",
    "ReadyLine",
    "ReadyPort",
    "RestartPolicy",
    "RunProcsResult",
    "SignalException",
    "StackReport",
    "Std",
    "SubprocessContext",
    "Watchdog",
    "WorkerError",
    "WorkerExited",
    "WorkerReady",
    "WorkerRestarting",
    "WorkerStalled",
    "WorkerStarted",
    "WorkerStatus",
    "WorkerStraggling",
    "__version__",
    "free_port",
    "launch",
    "record",
    "set_console_hook",
    "start_processes",
    "to_map",
]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'aiolaunch' has no attribute {name!r}")
    obj = getattr(importlib.import_module(module_name, __name__), name)
    # Public objects report ``aiolaunch`` as their module, so tracebacks and
    # pickles name the public path and survive internal moves (as trio does).
    if getattr(obj, "__module__", "").startswith("aiolaunch."):
        try:
            obj.__module__ = "aiolaunch"
        except (AttributeError, TypeError):  # pragma: no cover - builtins
            pass
    globals()[name] = obj
    return obj


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
