"""PID 1 (a container without an init): reap orphans, forward signals.

A process that is PID 1 of its PID namespace (a Kubernetes pod or a
``docker run`` without ``--init``, ``unshare -p -f``) inherits every orphan of
the namespace: a worker's child whose parent died is re-parented to it, and
when it exits it stays a zombie until PID 1 reaps it. The supervisor itself
cannot reap "any child": its workers are its children too, and their exit
statuses belong to the pidfd readers, ``subprocess.Popen`` and
``multiprocessing`` that wait for them by pid (a ``waitpid(-1)`` would steal
them; ``waitid(WNOWAIT)`` keeps returning the same unreaped worker).

So, as tini and dumb-init do, PID 1 forks at once, before any thread or
event loop exists: the child runs aiolaunch as usual (its workers remain its
own children, waited for as everywhere else); PID 1 stays a tiny init that

- reaps every child it is handed (``waitpid(-1, WNOHANG)`` on each SIGCHLD),
- forwards HUP, INT, QUIT, USR1, USR2, TERM, WINCH and CONT to the child -
  except those the terminal sent (``SI_KERNEL``: the child, in the same
  foreground process group, got them already; a doubled SIGINT would be a
  second stop signal and skip the grace period),
- and exits with the child's status (``128 + N`` when signal ``N`` killed it).

Everything waits in ``sigwaitinfo``: no handler runs, nothing polls. A signal
that was ignored on entry stays ignored and is not forwarded.
``AIOLAUNCH_INIT=0`` turns this off. When PID 1 exits, the kernel kills what
is left in the namespace.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["FORWARDED", "run_as_init"]

#: the signals PID 1 passes on to aiolaunch
FORWARDED = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGTERM,
    signal.SIGWINCH,
    signal.SIGCONT,
)
#: ``si_code`` of a signal the kernel sent (the terminal's ^C, ^\\)
_SI_KERNEL = 0x80


def run_as_init(environ: dict[str, str] | None = None) -> int | None:
    """If this process is PID 1, fork: the child returns ``None`` and goes on
    as aiolaunch; PID 1 reaps and forwards until the child exits, then returns
    its exit status. Elsewhere (the usual case) returns ``None`` at once."""
    env = os.environ if environ is None else environ
    if os.getpid() != 1 or env.get("AIOLAUNCH_INIT", "1") == "0":
        return None
    if not hasattr(signal, "sigwaitinfo"):  # pragma: no cover - not Linux
        return None
    forwarded = [s for s in FORWARDED if signal.getsignal(s) is not signal.SIG_IGN]
    waited = {*forwarded, signal.SIGCHLD}
    # Blocked before the fork: a signal sent meanwhile stays pending for PID 1
    # (pending signals are not inherited), and is forwarded once it waits.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return None
    # A handler (never run: the signals stay blocked and sigwaitinfo takes
    # them) makes sure the kernel queues signals that a namespace's init with
    # the default action would otherwise drop.
    for s in waited:
        signal.signal(s, _never_called)
    return _supervise(child, waited)


def _never_called(signum: int, frame: object) -> None:  # pragma: no cover - blocked
    """The signals are blocked and taken by ``sigwaitinfo``."""


def _supervise(child: int, waited: set[signal.Signals]) -> int:
    """Reap and forward until ``child`` exits; its status, in the shell's terms."""
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo != signal.SIGCHLD:
            if info.si_code != _SI_KERNEL:
                try:
                    os.kill(child, info.si_signo)
                except ProcessLookupError:
                    pass
            continue
        status = _reap_all(child)
        if status is not None:
            _reap_all(child)  # what else already exited
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


def _reap_all(child: int) -> int | None:
    """Reap every exited child (SIGCHLDs merge); ``child``'s wait status if it was one."""
    found: int | None = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == child:
            found = status
