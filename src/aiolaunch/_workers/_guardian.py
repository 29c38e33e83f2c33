"""The guardian: kills binary workers' process groups if the supervisor dies.

One tiny ``/bin/sh`` process per supervisor process, started on first use in a
session of its own. It reads ``+PGID`` / ``-PGID`` lines from a pipe whose
only writer is the supervisor; when the supervisor dies - even by SIGKILL - the
pipe reaches EOF and the guardian SIGKILLs every process group still
registered. Because it kills *groups*, a worker's own children in its group
die too (``PR_SET_PDEATHSIG`` would reach the worker alone), and because it
needs no code in the child between fork and exec, binary workers are spawned
on CPython's fast ``vfork`` path.

Workers spawned but not yet registered, and descendants that left their
worker's group (``setsid()``), are found by the token every worker carries in
``AIOLAUNCH_GUARDIAN``: at EOF the guardian also scans ``/proc/*/environ``.

Folders and files the supervisor made for a group (its stacks folder, the
control socket, temporary log folders) are registered too (``cN KIND PATH`` /
``xN``): a supervisor killed before its cleanup - SIGKILL, or a signal it does
not handle - would leave them behind. After the kills the guardian removes
them as the supervisor would have: the stacks and socket folders and files,
then the *empty* folders of temporary log roots (logs are kept). Paths travel
octal-escaped (any byte but NUL), and only names aiolaunch gives are removed.

Limits: a descendant that both leaves the group and scrubs its environment
is not found; without ``/proc`` (macOS) only registered groups are killed; a
process the supervisor forks without exec (``os.fork``) inherits the pipe's
write end and so delays the guardian until that process exits too.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import itertools
import os
import re
import threading
from typing import TYPE_CHECKING

from .._types import PerProcess

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "GUARDIAN_ENV",
    "GUARDIAN_NAME",
    "Guardian",
    "clean_up_after",
    "current_guardian",
    "guardian",
]

#: Environment variable carrying the guardian's token into binary workers.
GUARDIAN_ENV = "AIOLAUNCH_GUARDIAN"

GUARDIAN_NAME = "aiolaunch-guardian"

#: Seconds a registration waits to be sent (see Guardian._queue).
WATCH_DELAY = 0.02

_SCRIPT = r"""
trap '' INT HUP QUIT TERM
# One variable per registered group (g_PGID), so +/- cost O(1): removing a
# word from one list string with ${g%% $p *} was quadratic per line in dash
# (256 groups: 0.14 s of CPU, 1024: 8 s, competing with the supervisor). $g
# lists every group ever added; it is compacted once it is over twice the
# live count, so it stays O(live) and each line stays O(1) amortized.
g="" n=0 live=0 cl="" cn=0 clive=0
while read -r l; do
  case $l in
    c*)  # cN KIND PATH: clean PATH up after the supervisor (see clean below)
      r=${l#c}; k=${r%% *}
      case $k in ''|*[!0-9]*) continue ;; esac
      eval "c_$k=\${r#* }"; cl="$cl $k"; cn=$((cn+1)); clive=$((clive+1))
      if [ "$cn" -gt $((2*clive+64)) ]; then
        h=""
        for k in $cl; do eval "r=\${c_$k-}"; [ -n "$r" ] && h="$h $k"; done
        cl=$h cn=$clive
      fi
      continue ;;
    x*)  # xN: the supervisor cleaned N up itself
      k=${l#x}
      case $k in ''|*[!0-9]*) continue ;; esac
      eval "r=\${c_$k-}"
      if [ -n "$r" ]; then unset "c_$k"; clive=$((clive-1)); fi
      continue ;;
  esac
  p=${l#?}
  case $p in ''|*[!0-9]*) continue ;; esac
  eval "r=\${g_$p-}"
  case $l in
    +*) if [ -z "$r" ]; then eval "g_$p=1"; g="$g $p"; n=$((n+1)); live=$((live+1)); fi ;;
    -*) if [ -n "$r" ]; then unset "g_$p"; live=$((live-1)); fi ;;
  esac
  if [ "$n" -gt $((2*live+64)) ]; then
    h=""
    for p in $g; do
      eval "r=\${g_$p-}"
      if [ "$r" = 1 ]; then eval "g_$p=2"; h="$h $p"; fi
    done
    for p in $h; do eval "g_$p=1"; done
    g=$h n=$live
  fi
done
for p in $g; do
  eval "r=\${g_$p-}"
  if [ -n "$r" ]; then kill -s KILL -- "-$p" 2>/dev/null; fi
done
# What the supervisor made and did not clean up: trees and files first (the
# stacks folder, the control socket), then empty folders of temporary log
# roots. Only aiolaunch's own names are removed, whatever the path says.
clean() {
  x='[a-z0-9_]'  # the socket's private folder: "." and mkdtemp's 8 characters
  for pass in 1 2; do
    for k in $cl; do
      eval "r=\${c_$k-}"
      [ -n "$r" ] || continue
      f=$(printf '%bx' "${r#? }"); f=${f%x}
      case $pass${r%% *}:${f##*/} in
        1T:.aiolaunch-stacks|1T:aiolaunch_stacks_*|1T:.$x$x$x$x$x$x$x$x) rm -rf -- "$f" ;;
        1F:control.sock|1F:.aiolaunch-stop_deadline|1F:[0-9]*-[0-9]*) rm -f -- "$f" ;;
        2P:*) find "$f" -depth -type d -exec rmdir -- {} + 2>/dev/null ;;
      esac
    done
  done
}
# Workers spawned but not yet registered, and descendants that left their
# group (setsid), carry our token in their environment: find them in /proc.
[ -d /proc/self ] || { clean; exit 0; }
kill_path() { p=${1#/proc/}; kill -s KILL "${p%/environ}" 2>/dev/null; }
# A worker spawned as the supervisor died shows our token only once its exec
# completed (before, /proc has its parent's environment): look again later.
for wait in 0 0.1 0.5; do
  sleep $wait
  if printf 'x\0' | grep -qzx x 2>/dev/null; then
    # One grep for all processes (NUL-separated entries: -z): a fork+exec of
    # tr and grep per process took seconds on a busy host.
    for f in $(grep -lsxzF "AIOLAUNCH_GUARDIAN=$1" /proc/[0-9]*/environ); do kill_path "$f"; done
  else
    for f in /proc/[0-9]*/environ; do
      if tr '\0' '\n' < "$f" 2>/dev/null | grep -qx "AIOLAUNCH_GUARDIAN=$1"; then
        kill_path "$f"
      fi
    done
  fi
done
clean
"""


class Guardian:
    """Handle on the guardian process of this supervisor."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        #: put in every binary worker's environment (GUARDIAN_ENV)
        self.token = f"{os.getpid()}-{os.urandom(8).hex()}"
        self.groups: set[int] = set()
        # The write end of the guardian's pipe: owned by this object alone,
        # never closed while the supervisor lives (its EOF *is* the signal);
        # closed and replaced only after the guardian died (_send).
        self.fd = -1
        self.pid = 0
        self._pending: list[str] = []
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        self._flush: asyncio.Handle | None = None
        self._flush_timed = False
        #: what to clean up after the supervisor: id -> its ``c`` line
        self._cleanups: dict[int, str] = {}
        self._ids = itertools.count()
        # Cleanups are forgotten from worker threads (the group's file cleanup
        # runs in one): the queue and the pipe are shared.
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        r, w = os.pipe()
        try:
            # posix_spawn, not Popen: a Popen alive at interpreter exit warns.
            self.pid = os.posix_spawn(
                "/bin/sh",
                ["/bin/sh", "-c", _SCRIPT, GUARDIAN_NAME, self.token],
                dict(os.environ),
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, r, 0),
                    (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                ],
                setsid=True,  # not killed by signals aimed at our group or terminal
            )
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self.fd = w
        if self.groups or self._cleanups:  # a restarted guardian takes over the live registrations
            self._send("".join(f"+{g}\n" for g in self.groups) + "".join(self._cleanups.values()))

    def _send(self, text: str) -> None:
        try:
            os.write(self.fd, text.encode())
        except BrokenPipeError:
            # The guardian was killed: start another one.
            with contextlib.suppress(OSError):
                os.close(self.fd)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)  # it is gone: reap it
            self._start()

    def watch(self, pgid: int) -> None:
        """Kill process group ``pgid`` if the supervisor dies."""
        self.groups.add(pgid)
        self._queue(f"+{pgid}\n", WATCH_DELAY)

    def unwatch(self, pgid: int) -> None:
        """Forget ``pgid`` (its processes are gone)."""
        if pgid in self.groups:
            self.groups.discard(pgid)
            # As late as a registration (see _queue): not on the path of the
            # close() that reaped the group (the write and the shell's wake-up
            # were ~0.14 ms of its ~2 on a 2-core host).
            self._queue(f"-{pgid}\n", WATCH_DELAY)

    def clean_up_after(self, kind: str, path: str, delay: float = 0.0) -> int:
        """Remove ``path`` if the supervisor dies before :meth:`forget` (its id).
        Sent with the next loop iteration, or ``delay`` seconds later (a
        temporary log root, made just before the spawns: see :meth:`_queue`).

        ``kind``: ``"T"`` a tree (the stacks folder ``.aiolaunch-stacks`` or
        ``aiolaunch_stacks_*``, the socket's private folder ``.XXXXXXXX``), ``"F"`` a file
        (``control.sock``, a registry entry ``PID-N``, the stop-deadline file
        ``.aiolaunch-stop_deadline``), ``"P"`` a temporary
        log root, of which only the empty folders go. Other names are never
        removed (the guardian checks them).
        """
        n = next(self._ids)
        line = f"c{n} {kind} {_escape(os.path.abspath(path))}\n"
        with self._lock:
            self._cleanups[n] = line
        self._queue(line, delay)
        return n

    def forget(self, n: int) -> None:
        """The supervisor cleaned ``n`` up itself (any thread). Idempotent."""
        if os.getpid() != self.owner:
            return  # a forked child: the pipe is its parent's
        with self._lock:
            known = self._cleanups.pop(n, None) is not None
        if known:
            # Not urgent: should the supervisor die before this is sent, the
            # guardian removes what is gone already (nothing; names are
            # unique). Sent with the next batch, not on close()'s path.
            self._queue(f"x{n}\n", WATCH_DELAY)

    def _queue(self, line: str, delay: float) -> None:
        # On an event loop, lines are sent in batches: starting 256 workers is
        # one write (and one wake-up of the shell, which would otherwise
        # preempt the supervisor between spawns), not 256. Registrations wait
        # ``delay`` more: the shell then runs once the workers just spawned
        # got going, not beside them on a small host's CPUs. Safe: a worker not
        # yet registered carries the token in its environment and is found by
        # the guardian's /proc scan if the supervisor dies now. Removals wait
        # as long: a stale group number would be killed only if the supervisor
        # died in that window *and* the number was handed out again, which
        # takes the pid counter round pid_max (>= 32768 forks) first.
        with self._lock:
            self._pending.append(line)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()  # no loop here (e.g. a worker thread): send now
            return
        if self._flush_loop is not None and self._flush_loop is not loop:
            if self._flush_loop.is_running():
                # Scheduled on another thread's loop: send now.
                self.flush()
                return
            # On a loop that ended (an earlier asyncio.run()) before it sent
            # them: the lines go with this one's batch, not now - a write
            # (and the shell's wake-up) on the path of the start that queues
            # this line. As soon as the earliest of them needs.
            if self._flush is not None:
                self._flush.cancel()
            delay = delay if self._flush_timed else 0.0
            self._flush = self._flush_loop = None
        if self._flush is not None:
            if delay or not self._flush_timed:
                return  # already scheduled, as soon as this one needs
            self._flush.cancel()  # a timed flush pending: sooner now
        self._flush_loop = loop
        self._flush_timed = bool(delay)
        self._flush = loop.call_later(delay, self.flush) if delay else loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send the queued registrations now (any thread)."""
        handle, loop, self._flush, self._flush_loop = self._flush, self._flush_loop, None, None
        if handle is not None and _running_loop() is loop:
            handle.cancel()  # (from another thread it runs later, finding nothing)
        with self._lock:
            if self._pending:
                text, self._pending = "".join(self._pending), []
                self._send(text)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _escape(path: str) -> str:
    """``path`` for one line of the guardian's pipe: every byte but ``[A-Za-z0-9/._-]``
    as ``\\0NNN`` (what ``printf %b`` reads back)."""
    if _SAFE_PATH.fullmatch(path):
        return path  # the common case, without a Python step per byte
    safe = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-"
    return "".join(chr(b) if b in safe else f"\\0{b:03o}" for b in os.fsencode(path))


_SAFE_PATH = re.compile(r"[A-Za-z0-9/._-]*")


def clean_up_after(kind: str, path: str, delay: float = 0.0) -> Callable[[], None]:
    """Register ``path`` with this process's guardian (see
    :meth:`Guardian.clean_up_after`); returns the call that forgets it (idempotent).
    Without a guardian (no /bin/sh) nothing happens."""
    g = guardian()
    if g is None:
        return lambda: None
    n = g.clean_up_after(kind, path, delay)
    return functools.partial(g.forget, n)


def _start() -> Guardian | None:
    if not os.path.exists("/bin/sh"):  # pragma: no cover - not POSIX
        return None
    g = Guardian()
    # Lines still queued when the process exits (its last loop ended within
    # WATCH_DELAY of them) go before the pipe's EOF: the guardian then kills
    # only what is still registered.
    atexit.register(_flush_at_exit, g)
    return g


def _flush_at_exit(g: Guardian) -> None:
    if os.getpid() == g.owner:  # not in a forked child (it inherits atexit's list)
        with contextlib.suppress(OSError):
            g.flush()


_GUARDIAN: PerProcess[Guardian | None] = PerProcess(_start)


def guardian() -> Guardian | None:
    """The guardian of this process, started on first use; ``None`` without /bin/sh."""
    return _GUARDIAN.get()


def current_guardian() -> Guardian | None:
    """The guardian of this process if it was started; starts nothing."""
    return _GUARDIAN.peek()
