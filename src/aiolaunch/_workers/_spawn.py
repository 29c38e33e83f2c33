"""Start a program as ``subprocess.Popen`` would, without Popen's Python.

:func:`spawn` is ``Popen(argv, env=env, stdout=, stderr=, close_fds=True,
start_new_session=)``'s fork and exec and nothing else: no ``Popen`` object, no
``returncode`` bookkeeping, no ``__del__`` warning. The caller owns the pid
(reaps it, usually through a pidfd).

How: CPython's own C core of ``Popen``, ``_posixsubprocess.fork_exec``, called
directly - ``vfork``, ``close_range`` for ``close_fds`` (in the child, so the
parent lists no fds), ``setsid``, SIGPIPE and SIGXFSZ back to their default,
the ``PATH`` search in the child, an exec failure sent back over a
close-on-exec pipe. Measured from the call to the exec, one worker, caches
cold as in the interleaved benchmark (median of 40, 2-core host): glibc's
``posix_spawn`` with the ``/proc/self/fd`` listing that ``close_fds`` needs
there, 465 us; ``fork_exec``, 294 us.

``fork_exec`` is private and its arguments changed between Python versions
(21 on 3.10; 22 on early 3.11, with the process group; 23 from 3.11.x on, with
``allow_vfork``). The convention is read once from the ``TypeError`` that a
call with no arguments raises, before any process exists; where it is not
one of the three, :func:`spawn` uses ``os.posix_spawn`` with the same
semantics instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["spawn"]

#: What ``Popen(restore_signals=True)`` sets back to the default in the child
#: (CPython ignores them).
_DEFAULT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, name)
)

#: os.fsencode's codec, without its per-call Python (a third of the time for
#: an environment of 50 variables).
_FS_ENCODING = sys.getfilesystemencoding()
_FS_ERRORS = sys.getfilesystemencodeerrors()

_UNREAD = -2
#: fork_exec's argument count, or None: use posix_spawn (not yet read: _UNREAD).
_fork_exec_arity: int | None = _UNREAD


def _arity() -> int | None:
    global _fork_exec_arity
    if _fork_exec_arity == _UNREAD:
        _fork_exec_arity = _read_arity()
    return _fork_exec_arity


def _read_arity() -> int | None:
    try:
        import _posixsubprocess

        _posixsubprocess.fork_exec()  # type: ignore[call-arg]
    except TypeError as e:
        # 3.10/3.11: "takes exactly 23 arguments (0 given)";
        # 3.12+: "fork_exec expected 23 arguments, got 0"
        found = re.search(r"(?:exactly|expected) (\d+) arguments", str(e))
        n = int(found.group(1)) if found else 0
    except Exception:  # anything else: not a fork_exec we know
        return None
    else:  # pragma: no cover - a fork_exec that takes no arguments
        return None
    if n == 21 and sys.version_info < (3, 11):
        return n
    if n in (22, 23) and sys.version_info >= (3, 11):
        return n
    return None


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    stdout: int | None = None,
    stderr: int | None = None,
    new_session: bool = False,
) -> int:
    """Start ``argv`` with exactly the environment ``env``; return its pid.

    ``stdout``/``stderr``: an fd the child gets as its fd 1/2, or ``None`` to
    inherit ours; stdin is inherited. Every other fd is closed in the child
    (``close_fds``). ``new_session``: the child calls ``setsid()`` (a session
    and process group of its own, no controlling terminal). SIGPIPE and
    SIGXFSZ are at their default in the child. ``argv[0]`` without a ``/`` is
    looked for on ``env["PATH"]`` (``os.defpath`` without one), as Popen does.

    Runs no Python in the child, so it is safe with threads.

    :raises OSError: the program could not be started (the errno of the
        ``exec``, e.g. ``FileNotFoundError``, with ``argv[0]`` as its
        filename); no process is left behind.
    :raises ValueError: a name in ``env`` holds ``=``, or a NUL byte in ``argv``
        or ``env``.
    """
    n = _arity()
    if n is None:
        return _posix_spawn(argv, env, stdout, stderr, new_session)
    import _posixsubprocess

    if any("=" in k for k in env):
        raise ValueError(f"illegal environment variable name in {sorted(env)!r}")
    env_list = [f"{k}={v}".encode(_FS_ENCODING, _FS_ERRORS) for k, v in env.items()]
    exe = os.fsencode(argv[0])
    if b"/" in exe:
        executables: tuple[bytes, ...] = (exe,)
    else:
        executables = tuple(os.path.join(os.fsencode(d), exe) for d in os.get_exec_path(env))
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        out, err = (-1 if fd is None else fd for fd in (stdout, stderr))
        # (args, executable_list, close_fds, pass_fds, cwd, env,
        #  p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
        #  errpipe_read, errpipe_write, restore_signals, call_setsid)
        args: list[Any] = [list(argv), executables, True, (err_w,), None, env_list]
        args += [-1, -1, -1, out, -1, err, err_r, err_w, True, new_session]
        if n >= 22:
            args.append(-1)  # pgid_to_set: none (setsid makes the group)
        args += [None, None, None, -1, None]  # gid, extra_groups, uid, child_umask, preexec_fn
        if n == 23:
            args.append(True)  # allow_vfork
        pid: int = _posixsubprocess.fork_exec(*args)
    except BaseException:
        os.close(err_r)
        raise
    finally:
        os.close(err_w)
    try:
        # EOF at once: the child exec'd (the pipe is close-on-exec) or died
        # (with vfork, fork_exec returns only then).
        report = _read_all(err_r)
    finally:
        os.close(err_r)
    if report:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise _child_error(report, argv[0])
    return pid


def _read_all(fd: int) -> bytes:
    data = b""
    while part := os.read(fd, 50_000):
        data += part
        if len(data) > 50_000:
            break
    return data


def _child_error(report: bytes, program: str) -> Exception:
    """The exception ``fork_exec``'s child reported (``Popen``'s format:
    ``b"OSError:<hex errno>:<noexec or empty>"``)."""
    name, _, rest = report.partition(b":")
    hex_errno, _, detail = rest.partition(b":")
    if name == b"OSError":
        with contextlib.suppress(ValueError):
            errno = int(hex_errno, 16)
            if detail.startswith(b"noexec"):  # failed before the exec (a dup2, setsid)
                return OSError(errno, os.strerror(errno))
            return OSError(errno, os.strerror(errno), program)
    return OSError(f"could not start {program!r}: {report.decode(errors='replace')}")


def _posix_spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    stdout: int | None,
    stderr: int | None,
    new_session: bool,
) -> int:
    """:func:`spawn` through glibc's ``posix_spawn`` (also the vfork path)."""
    actions: list[tuple[Any, ...]] = []
    if stdout is not None:
        actions.append((os.POSIX_SPAWN_DUP2, stdout, 1))
    if stderr is not None:
        actions.append((os.POSIX_SPAWN_DUP2, stderr, 2))
    actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable_fds() if fd > 2]
    return os.posix_spawn(
        _executable(argv[0], env.get("PATH")),
        list(argv),
        env,
        file_actions=actions,
        setsid=new_session,
        setsigdef=_DEFAULT_SIGNALS,
    )


def _executable(name: str, path: str | None) -> str:
    """``name`` as ``Popen`` finds it: as given when it holds a ``/``, else the
    first executable file of that name on ``path``.

    :raises FileNotFoundError: none there.
    """
    if os.sep in name:
        return name
    for folder in os.get_exec_path({"PATH": path} if path is not None else {}):
        candidate = os.path.join(folder, name)
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(2, os.strerror(2), name)


def _inheritable_fds() -> list[int]:
    """This process's inheritable fds (``close_fds`` closes them in the
    child; every other fd is close-on-exec)."""
    from ._proc import open_fds

    fds = open_fds()
    found = []
    for fd in range(3, 256) if fds is None else fds:  # no procfs: the low numbers
        with contextlib.suppress(OSError):  # the listing's own fd is closed by now
            if os.get_inheritable(fd):
                found.append(fd)
    return found
