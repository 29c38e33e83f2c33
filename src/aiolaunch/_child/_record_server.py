"""The worker side of collective forensics: each rank's collective record, reachable from outside.

torch records every collective of a process (its *Flight Recorder*: gloo's
since torch 2.8, NCCL's through its own recorder) and can serve the record
on a per-rank control socket of its own (``torch._C._distributed_c10d.
_WorkerServer``: a C++ HTTP server on a unix socket, whose ``fr_trace_json``
handler - and ``dump_nccl_trace_json`` on builds with NCCL - dumps the record
without the GIL, so a rank blocked in a collective, or computing in Python,
answers in about a millisecond). Nothing in the script asks for it: when the
supervisor sets :data:`COLLECTIVES_ENV` (a group with a watchdog), the
bootstraps call :func:`watch`, which arms the server once ``torch`` is
imported - at once if it is already (a worker forked from a zygote that
preloaded it), else from an import hook that runs right after ``import
torch`` finished (``import torch`` imports ``torch.distributed`` too).

Arming (:func:`arm`), in this order:

1. torch older than 2.8, or built without ``torch.distributed``: no record
   to read; ``fr-<pid>.off`` says why (the supervisor says it once, and
   judges that rank by its stacks, as before).
2. Recording: where the user set neither ``TORCH_FR_BUFFER_SIZE`` nor
   ``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_FR_BUFFER_SIZE`` is set to
   :data:`RECORD_ENTRIES` (it enables recording where torch's default is off,
   and bounds what every pull costs where torch keeps 2000 entries). torch
   reads it when the first process group is made, which is after this. Every
   other ``TORCH_FR_*``/``TORCH_NCCL_*`` variable is left alone.
3. The server on ``{stacks dir}/fr-<pid>.sock`` (through ``/proc/self/fd``
   when that path is too long for a unix socket). torch logs a warning line
   when it starts and when it stops; both are kept out of the rank's stderr
   by raising c10's log level for those few calls.
4. ``fr-<pid>.json``, written atomically last: pid, process start time, the
   socket, the rank and world size the launcher gave (``RANK``,
   ``WORLD_SIZE``), torch's version, whether NCCL is built in.

Its lifetime: at exit (``atexit``, before torch's own handlers) the rank
writes its record one last time to ``fr-<pid>.last`` (its *last words*: gloo
fails the others' collective the moment a peer exits, and they all die
within a second, before anyone could ask), then the server is shut down - a
request in flight finishes first - so nothing is dumped while the
interpreter tears torch down. A child forked from the rank (a DataLoader
worker) closes its copy of the listening socket and never touches the
server's C++ object, which it shares with the rank: a rank that dies leaves
no socket that accepts and never answers.

Standard library only at module level (everything under ``_child`` must be
cheap to import); torch is touched only once the program imported it.
"""

from __future__ import annotations

import os
import sys

from ._dump_handler import STACKS_DIR_ENV
from ._proc import fd_path, fd_target, open_fds, start_time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

__all__ = [
    "BUFFER_VARIABLES",
    "COLLECTIVES_ENV",
    "INFO_SUFFIX",
    "LAST_SUFFIX",
    "NO_COLLECTIVES_ENV",
    "OFF_SUFFIX",
    "RECORD_ENTRIES",
    "arm",
    "info_path",
    "socket_name",
    "watch",
]

#: Set to ``"1"`` by the supervisor (a group with a watchdog): arm the server.
COLLECTIVES_ENV = "AIOLAUNCH_COLLECTIVES"
#: Set to ``"1"`` by the user (the rank's environment): never arm - its hangs
#: and stragglers are judged by its stacks, as without torch.
NO_COLLECTIVES_ENV = "AIOLAUNCH_NO_COLLECTIVES"
#: The entries torch keeps where the user did not say (see the module docstring).
RECORD_ENTRIES = 64
#: The variables that size the record; one set by the user is left alone.
BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: ``fr-<pid>`` + this: the rank's record is served (JSON: what the supervisor needs).
INFO_SUFFIX = ".json"
#: ``fr-<pid>`` + this: the rank has no record (text: why).
OFF_SUFFIX = ".off"
#: ``fr-<pid>`` + this: its record as it exited (its dumps, NUL-separated).
LAST_SUFFIX = ".last"
#: The first torch whose gloo process groups record their collectives.
MIN_TORCH = (2, 8)
#: The longest path a unix socket takes (``sun_path`` less its NUL).
_MAX_SOCKET_PATH = 107
#: c10's log level while the server starts and stops (ERROR: its warnings go).
_QUIET_LEVEL = 2


def socket_name(pid: int) -> str:
    """The file name of ``pid``'s socket in the stacks folder."""
    return f"fr-{pid}.sock"


def info_path(directory: str, pid: int, suffix: str = INFO_SUFFIX) -> str:
    """``{directory}/fr-<pid>`` + ``suffix``."""
    return os.path.join(directory, f"fr-{pid}{suffix}")


class _Server:
    """The armed server of this process (one per process)."""

    server: Any = None
    pid = 0
    directory = ""
    listener_fd = -1
    closed = False


_armed = _Server()


def watch() -> None:
    """Arm once ``torch`` is imported, when the supervisor asks (:data:`COLLECTIVES_ENV`)
    and the user did not say no (:data:`NO_COLLECTIVES_ENV`).

    Called by the bootstraps before the program runs; cheap (an import hook at
    most). Never raises.
    """
    if os.environ.get(COLLECTIVES_ENV) != "1" or os.environ.get(NO_COLLECTIVES_ENV) == "1":
        return
    directory = os.environ.get(STACKS_DIR_ENV)
    if not directory:
        return
    if "torch" in sys.modules:  # forked from a zygote that preloaded it: complete
        arm(directory)
    elif not any(isinstance(f, _TorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImport(directory))


class _TorchImport:
    """A meta path finder that only watches for ``torch``: the other finders
    find it; its loader is wrapped so that :func:`arm` runs once it ran."""

    def __init__(self, directory: str) -> None:
        self._directory = directory

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        # One import only, and none of ours while the others look.
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ArmAfter(spec.loader, self._directory)
        return spec

    def invalidate_caches(self) -> None:
        """Nothing cached."""


class _ArmAfter:
    """torch's own loader, and :func:`arm` once ``torch`` finished importing."""

    def __init__(self, loader: Any, directory: str) -> None:
        self._loader = loader
        self._directory = directory

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # torch sees its own loader (importlib.resources, linecache read it).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        arm(self._directory)


def arm(directory: str) -> bool:
    """Serve this rank's collective record (see the module docstring); ``False``
    where it cannot (``fr-<pid>.off`` says why). Never raises: a rank must run
    whatever happens here."""
    if _armed.server is not None and _armed.pid == os.getpid():
        return True
    try:
        reason = _arm(directory)
    except Exception as exc:  # an unknown torch: stacks only, never a broken rank
        reason = f"arming the record server failed: {type(exc).__name__}: {exc}"
    if reason is None:
        return True
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        _write(info_path(directory, os.getpid(), OFF_SUFFIX), reason)
    except OSError:
        pass
    return False


def _arm(directory: str) -> str | None:
    torch: Any = sys.modules["torch"]
    version = str(getattr(torch, "__version__", "?"))
    if _version(version) < MIN_TORCH:
        return f"torch {version} keeps no collective record for gloo (torch 2.8 does)"
    try:
        from torch._C._distributed_c10d import _WorkerServer
    except ImportError:
        return f"torch {version} has no torch.distributed control socket"
    if not any(name in os.environ for name in BUFFER_VARIABLES):
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(RECORD_ENTRIES)
    pid = os.getpid()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, socket_name(pid))
    try:
        os.unlink(path)  # a stale one of a recycled pid
    except FileNotFoundError:
        pass
    dir_fd = -1
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        bind = os.path.join(fd_path(dir_fd), socket_name(pid))
    else:
        bind = path
    before = set(open_fds())
    try:
        with _Quiet():
            server = _WorkerServer(bind)
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
    _armed.server, _armed.pid, _armed.closed = server, pid, False
    _armed.directory = directory
    _armed.listener_fd = _listener(set(open_fds()) - before, bind)
    import atexit

    atexit.register(_close)
    os.register_at_fork(after_in_child=_forget_in_child)
    nccl = False
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            nccl = bool(dist.is_nccl_available())
        except Exception:
            nccl = False
    import json

    try:
        started = start_time()
    except (OSError, IndexError):
        started = ""
    info = {
        "pid": pid,
        "started": started,
        "socket": socket_name(pid),
        "rank": _int_env("RANK"),
        "world_size": _int_env("WORLD_SIZE"),
        "torch": version,
        "nccl": nccl,
        "entries": os.environ.get("TORCH_FR_BUFFER_SIZE")
        or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"),
    }
    _write(info_path(directory, pid), json.dumps(info))
    return None


def _version(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # atomic: the supervisor never reads half of it


def _listener(new_fds: set[int], bound: str) -> int:
    """The listening socket bound to ``bound`` among the fds the server's start
    opened (-1: not found)."""
    import socket

    for fd in sorted(new_fds):
        try:
            if not (fd_target(fd) or "").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.family == socket.AF_UNIX and s.getsockname() == bound:
                    return fd
        except OSError:
            continue
    return -1


class _Quiet:
    """c10's log level raised to ERROR for a moment: the server's start and
    stop each log a warning line, which is not the program's output. Another
    thread's C++ warning in that moment is lost with it; where c10's level
    cannot be found, the lines stay."""

    def __init__(self) -> None:
        self._flag: Any = None
        self._old = 0

    def __enter__(self) -> None:
        self._flag = _log_level()
        if self._flag is not None:
            self._old = self._flag.value
            self._flag.value = max(self._old, _QUIET_LEVEL)

    def __exit__(self, *exc: object) -> None:
        if self._flag is not None:
            self._flag.value = self._old


def _log_level() -> Any:
    """c10's ``FLAGS_caffe2_log_level`` (a C int), or ``None``."""
    torch = sys.modules.get("torch")
    where = getattr(torch, "__file__", None)
    if not where:
        return None
    try:
        import ctypes

        lib = os.path.join(os.path.dirname(where), "lib", "libc10.so")
        handle = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return ctypes.c_int.in_dll(handle, "FLAGS_caffe2_log_level")
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _close() -> None:
    # atexit: before torch's own handlers (registered earlier, run later).
    # torch's shutdown() stops the server only once its thread listens, and
    # waits for it: a ping first proves it listens (a process that exits right
    # after importing torch would otherwise hang in shutdown for ever).
    server = _armed.server
    if server is None or _armed.closed or _armed.pid != os.getpid():
        return
    _armed.closed = True
    directory = _armed.directory
    _last_words(directory, _armed.pid)
    if _ping(os.path.join(directory, socket_name(_armed.pid))):
        with _Quiet():
            server.shutdown()
    else:  # never listened: never destroyed either (its destructor would wait the same)
        _keep_forever(server)
    _armed.server = None


def _last_words(directory: str, pid: int) -> None:
    """The record as the rank exits, to ``fr-<pid>.last`` (from the main thread,
    before torch's own exit handlers: its record is whole)."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        return
    dumps: list[bytes] = []
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            dumps.append(bytes(dump()))
        except Exception:  # a rank's exit must not fail here
            continue
    if not dumps:
        return
    path = info_path(directory, pid, LAST_SUFFIX)
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(b"\0".join(dumps))  # JSON text never holds a NUL byte
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _ping(path: str) -> bool:
    import socket

    dir_fd = -1
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        try:
            dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return False
        path = os.path.join(fd_path(dir_fd), os.path.basename(path))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(path)
            s.sendall(
                b"POST /handler/ping HTTP/1.1\r\nHost: rank\r\n"
                b"Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
            return s.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)


def _forget_in_child() -> None:
    # A forked child shares the server's C++ object with the rank but not its
    # thread: destroying it would shut the rank's listening socket down and
    # join a thread that is not there. It is kept for ever, and the child's
    # copy of the listening socket is closed.
    server = _armed.server
    if server is None:
        return
    _keep_forever(server)
    if _armed.listener_fd >= 0:
        try:
            os.close(_armed.listener_fd)
        except OSError:
            pass
    _armed.server, _armed.listener_fd = None, -1


def _keep_forever(obj: object) -> None:
    try:
        import ctypes

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    except (ImportError, AttributeError, OSError):
        _leaked.append(obj)


_leaked: list[object] = []
