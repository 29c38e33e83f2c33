"""Which signals a group handles, and how: :class:`SignalPlan`.

Built by ``start_processes`` from ``signals_to_handle`` / ``forward_signals``
(or torch's ``TORCHELASTIC_SIGNALS_TO_HANDLE`` and ``AIOLAUNCH_FORWARD_SIGNALS``):
its *stop* set ends the group (``wait()`` forwards the signal, waits out the
grace, raises ``SignalException``), its *forward* set is only passed on to
the workers. The race itself is ``_signals.watch_signals``.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING

from ._watch import SignalWatch, forward_signal, watch_signals

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Callable, Iterable

    from .._workers._handle import WorkerHandle

__all__ = [
    "DEFAULT_SIGNALS_TO_HANDLE",
    "FORWARD_SIGNALS_ENV",
    "SIGNALS_TO_HANDLE_ENV",
    "SignalPlan",
    "parse_signals",
    "resolve_signals",
]

logger = logging.getLogger("aiolaunch")

#: torch's default for ``TORCHELASTIC_SIGNALS_TO_HANDLE``.
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
FORWARD_SIGNALS_ENV = "AIOLAUNCH_FORWARD_SIGNALS"

# Cannot be caught (KILL, STOP), or asyncio reaps children with it (CHLD).
_UNHANDLED = frozenset({signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD})


def _one_signal(item: object) -> signal.Signals:
    if isinstance(item, bool):
        raise TypeError(f"{item!r} is not a signal")
    if isinstance(item, int):
        return signal.Signals(item)  # ValueError for a number that is no signal
    if isinstance(item, str):
        name = item.strip().upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"{item!r} is not a signal name") from None
    raise TypeError(f"{item!r} is not a signal (a name like 'SIGUSR1', or a number)")


def parse_signals(spec: object, *, what: str, strict: bool) -> frozenset[signal.Signals]:
    """Read a set of signals: ``"SIGTERM,SIGUSR1"`` (torch's form), names or numbers.

    Names may omit ``SIG`` and any case is accepted; empty items are skipped.
    ``strict`` (a keyword argument): a bad item raises ``ValueError`` or
    ``TypeError`` naming ``what``; otherwise (an environment variable, as
    torch reads it) it is skipped with a warning. SIGKILL and SIGSTOP cannot
    be handled, and SIGCHLD belongs to asyncio: they are refused the same way.
    """
    if isinstance(spec, str):
        items: list[object] = [part for part in spec.split(",") if part.strip()]
    elif isinstance(spec, int):
        items = [spec]
    else:
        try:
            items = list(spec)  # type: ignore[call-overload]
        except TypeError:
            raise TypeError(
                f"{what}={spec!r} must be a comma-separated str like 'SIGTERM,SIGUSR1' "
                "or a list of signal names or numbers"
            ) from None
    found: set[signal.Signals] = set()
    for item in items:
        try:
            sig = _one_signal(item)
            if sig in _UNHANDLED:
                raise ValueError(f"{sig.name} cannot be handled by the supervisor")
        except (TypeError, ValueError) as exc:
            if strict:
                raise type(exc)(
                    f"{what}: {exc}; pass names like 'SIGTERM,SIGUSR1' "
                    "(SIGKILL, SIGSTOP and SIGCHLD excluded)"
                ) from None
            logger.warning("aiolaunch: %s: %s; skipped", what, exc)
            continue
        found.add(sig)
    return frozenset(found)


def resolve_signals(
    keyword: object, *, what: str, env: str, default: str, strict_env: bool = False
) -> frozenset[signal.Signals]:
    """The keyword's signals, or (keyword ``None``) those of ``$env``, or ``default``.

    ``strict_env``: a bad name in ``$env`` raises too (aiolaunch's own
    variables); otherwise it is skipped with a warning, as torch reads its own.
    """
    if keyword is not None:
        return parse_signals(keyword, what=what, strict=True)
    value = os.environ.get(env)
    if value is None:
        # The usual case, on every start: parsed once (~10 us).
        found = _DEFAULTS.get(default)
        if found is None:
            found = _DEFAULTS[default] = parse_signals(default, what=what, strict=True)
        return found
    return parse_signals(value, what=f"${env}", strict=strict_env)


#: the parsed default of :func:`resolve_signals` (immutable sets, by default string)
_DEFAULTS: dict[str, frozenset[signal.Signals]] = {}


class SignalPlan:
    """One group's signals: which stop it, which are only forwarded, and the grace.

    :param stop: signals that stop the group (forwarded, grace, SIGKILL).
    :param forward: signals only passed on to the workers.
    :param shutdown_timeout: the grace between the death signal and SIGKILL.
    """

    def __init__(
        self,
        stop: frozenset[signal.Signals],
        forward: frozenset[signal.Signals],
        shutdown_timeout: float,
    ) -> None:
        self.forward = forward
        # A signal in both sets is only forwarded (the explicit opt-in wins).
        self.stop = stop - forward
        self.shutdown_timeout = shutdown_timeout

    def watch(
        self,
        wake: Callable[[], None],
        escalate: Callable[[str], None],
        workers: Callable[[], Iterable[WorkerHandle]],
        name: str,
    ) -> contextlib.AbstractContextManager[SignalWatch]:
        """:func:`watch_signals` for one group's ``wait()``: a stop signal calls
        ``wake()``, a second one ``escalate(why)``; a forwarded signal goes to
        every worker of ``workers()``."""
        return watch_signals(
            lambda sig: wake(),
            stop=self.stop,
            forward=self.forward,
            on_repeat=lambda sig: escalate(f"second {sig.name}"),
            on_forward=lambda sig: forward_signal(workers(), sig, name),
        )
