"""The loop that moves one agent through torch's rendezvous state by the rules of :mod:`._rules`.

torch's executor reads the state, asks its operation for an action, writes
the change by compare-and-swap and, when there is nothing to do, sleeps a
second. :class:`RoundDriver` does the same with aiolaunch's rules, and
between steps it waits on the :class:`~._liveness.Bell` (woken by the next
change) for at most ``tick`` seconds - the pace at which it re-reads the
liveness beacons of the agents it waits for. A change of who is where
rings the bell once written.

It needs only a state holder (``sync()``, ``state``, ``mark_dirty()``:
torch's ``_BackendRendezvousStateHolder``), so it imports no torch and a
test can drive it over a plain object. All calls block: run them in a
worker thread.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ._rules import (
    MEMBERSHIP,
    Action,
    Facts,
    apply,
    completes,
    join_action,
    leave_action,
    restart_reason,
)

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable, Collection
    from datetime import timedelta

    from ._liveness import Bell, Liveness
    from ._rules import Settings, State

__all__ = ["RoundDriver", "RoundTimeout"]

log = logging.getLogger("aiolaunch.agent")

#: the outcomes of a loop (the others go round again)
_DONE = frozenset({Action.FINISH, Action.CLOSED, Action.QUARANTINED})
_EXITS = frozenset({Action.NOT_ADMITTED, Action.LEAVE})
#: the watch re-reads the state at least this often, rung or not (seconds)
_RESYNC = 2.0


class RoundTimeout(Exception):
    """The round did not complete before the join deadline."""


class RoundDriver:
    """One agent's moves (see the module docstring).

    :param holder: torch's state holder for this agent.
    :param lock: taken around every read-decide-write step (torch's
        heartbeat thread shares the holder).
    :param host: a node's host (its address), for quarantine and messages.
    :param quarantined: the hosts out now.
    :param charge: ``charge(round)``: charge a failed round to its host,
        before the next round may complete (idempotent).
    :param on_dead: ``on_dead(round, complete, nodes)``: ``nodes`` were found
        dead and are about to be removed from the state of round ``round``
        (``complete``: running, else forming).
    :param tick: seconds between liveness reads while waiting.
    """

    def __init__(
        self,
        holder: Any,
        lock: threading.Lock,
        settings: Settings,
        node: Any,
        *,
        bell: Bell,
        liveness: Liveness,
        host: Callable[[Any], str],
        quarantined: Callable[[], Collection[str]],
        charge: Callable[[int], object],
        on_dead: Callable[[int, bool, list[Any]], object],
        last_call: timedelta,
        tick: float,
    ) -> None:
        self._holder = holder
        self._lock = lock
        self._settings = settings
        self.node = node
        self._bell = bell
        self._liveness = liveness
        self._host = host
        self._quarantined = quarantined
        self._charge = charge
        self._on_dead = on_dead
        self._last_call = last_call
        self._tick = tick
        self._charged: set[int] = set()
        #: why the last ``admit()`` refused, or ``None``
        self.refusal: str | None = None
        #: steps taken and writes that lost a race, since :meth:`stats` was last read
        self._steps = self._lost = 0
        self._dead: set[Any] = set()
        self._observed: set[Any] = set()
        self._observed_at = -1.0

    def _facts(self, dead: Collection[Any], admitted: bool | None = True) -> Facts:
        return Facts(
            me=self.node,
            host=self._host,
            dead=dead,
            quarantined=self._quarantined(),
            admitted=admitted,
            last_call=self._last_call,
            now=datetime.now(timezone.utc),
        )

    def join(self, deadline: float, admit: Callable[[], str | None] | None = None) -> Action:
        """Into the next complete round: ``FINISH`` (in it), ``CLOSED``,
        ``QUARANTINED`` or ``NOT_ADMITTED`` (out of every list: ``admit()``,
        run before joining a forming round, gave a reason, kept in :attr:`refusal`).

        :raises RoundTimeout: past ``deadline`` (monotonic) while not a spare
            (a spare waits as long as the job runs, as in torch).
        """
        return self._loop(join_action, deadline, admit)

    def leave_round(self, round_: int) -> Action:
        """Out of round ``round_``, into the wait list (``FINISH``), or ``CLOSED``."""
        return self._loop(
            lambda state, settings, facts: leave_action(state, settings, facts, round_), None
        )

    def leave_job(self) -> None:
        """Out of every list: this agent goes (a signal, a failed health check)."""
        self._loop(
            lambda state, settings, facts: (
                Action.FINISH if facts.me not in _listed(state) or state.closed else Action.LEAVE
            ),
            None,
        )

    def stats(self) -> tuple[int, int]:
        """``(steps, writes that lost a race)`` since the last call."""
        out = (self._steps, self._lost)
        self._steps = self._lost = 0
        return out

    def wait_round_after(self, round_: int) -> bool:
        """Block until a round after ``round_`` forms (``True``) or the
        rendezvous closes (``False``): when an agent that was not admitted
        tries again."""
        while True:
            seen = self._bell.count
            with self._lock:
                state = self._sync()
            if state.closed:
                return False
            if state.round > round_:
                return True
            self._bell.wait(seen, max(self._tick, 1.0))

    def current_round(self) -> int:
        """The round number of the state as last read."""
        with self._lock:
            return int(self._sync().round)

    def _loop(
        self,
        decide: Callable[[State, Settings, Facts], Action],
        deadline: float | None,
        admit: Callable[[], str | None] | None = None,
    ) -> Action:
        admitted: bool | None = None if admit is not None else True
        while True:
            self._steps += 1
            seen = self._bell.count
            charge = None
            with self._lock:
                state = self._sync()
                facts = self._facts(self._dead_among(state), admitted)
                action = decide(state, self._settings, facts)
                if (
                    state.round > 0
                    and state.round - 1 not in self._charged
                    and completes(action, state, self._settings, facts)
                ):
                    # The last round's failure is charged to its host before
                    # this one closes (a host it quarantines stays out): every
                    # live agent of it has reported by now (each reports before
                    # it joins), the dead were reported as they were removed.
                    charge = state.round - 1
                    written = False
                elif action in _DONE or action in (Action.ADMIT, Action.WAIT):
                    written = False
                else:
                    written = self._write(action, state, facts)
            if charge is not None:
                self._charge(charge)  # may wait for another's charge: not under the lock
                self._charged.add(charge)
                continue
            if action in _DONE:
                return action
            if action == Action.ADMIT:
                assert admit is not None
                self.refusal = admit()
                admitted = self.refusal is None
            elif action == Action.WAIT:
                late = deadline is not None and time.monotonic() > deadline
                if late and self.node not in state.redundancy_list:
                    raise RoundTimeout(f"round {state.round} did not complete in time")
                self._bell.wait(seen, self._tick)
            elif written and action in _EXITS:
                return action
            elif written and action == Action.BECOME_SPARE and admit is not None:
                admitted = None  # a spare checks again when it is called in

    def _sync(self) -> State:
        self._holder.sync()
        state: State = self._holder.state
        return state

    def _dead_among(self, state: State) -> set[Any]:
        """The listed agents whose beacons stopped, read at most once a tick
        (a step does not re-read every beacon of a large job)."""
        now = time.monotonic()
        listed = _listed(state) - {self.node}
        if now - self._observed_at >= self._tick or not listed <= self._observed:
            self._dead = self._liveness.observe(listed)
            self._observed, self._observed_at = listed, now
        return self._dead & listed

    def _write(self, action: Action, state: State, facts: Facts) -> bool:
        """Apply ``action`` to ``state`` and write it; whether it landed (else the
        holder has the newer state and the caller decides again)."""
        if action == Action.REMOVE_DEAD:
            removed = sorted((set(facts.dead) & _listed(state)) - {self.node})
            log.warning(
                "round %d: %s stopped answering; removed from the rendezvous",
                state.round,
                ", ".join(sorted(self._host(n) for n in removed)),
            )
            # Reported before the removal lands: the round that charges the
            # failure cannot close in between.
            self._on_dead(state.round, state.complete, removed)
        closes = completes(action, state, self._settings, facts)
        apply(action, state, self._settings, facts)
        self._holder.mark_dirty()
        landed = bool(self._holder.sync())
        if not landed:
            self._lost += 1
            return False
        if action == Action.REMOVE_DEAD:
            self._liveness.forget(facts.dead)
        if action in MEMBERSHIP and (action != Action.JOIN or closes or not state.wait_list):
            # A join wakes the others only when it closes the round, or when
            # the wait list is empty (the spares' turn): fewer wake-ups of
            # every agent for every join of a large job.
            self._ring()
        return True

    def _ring(self) -> None:
        try:
            self._bell.ring()
        except Exception as exc:  # the others still see it at their next tick
            log.info("could not ring the rendezvous bell: %s", exc)

    def watch(self, round_: int, members: list[Any], stop: Callable[[], bool]) -> str | None:
        """While round ``round_`` (``members``, in rank order) runs: why it must
        re-form, or ``None`` once ``stop()``.

        Reads the beacons of the next two members after this one (each agent
        watches its successors, so every member is watched by two others at
        O(1) cost each) and re-reads the state when the bell rang.
        """
        me = self.node
        i = members.index(me) if me in members else 0
        successors = [members[(i + k) % len(members)] for k in (1, 2)]
        watched = list(dict.fromkeys(n for n in successors if n != me))
        synced_at = -1.0
        synced_bell = -1
        while not stop():
            seen = self._bell.count
            with self._lock:
                if seen != synced_bell or time.monotonic() - synced_at > _RESYNC:
                    state = self._sync()
                    synced_bell, synced_at = seen, time.monotonic()
                else:
                    state = self._holder.state
                if state.closed:
                    reason = None
                else:
                    alive = [n for n in watched if n in state.participants]
                    dead = self._liveness.observe(alive + sorted(state.wait_list))
                    facts = self._facts(dead)
                    if dead & set(alive) and self._write(Action.REMOVE_DEAD, state, facts):
                        return "a host of the round stopped answering"
                    reason = restart_reason(state, self._settings, facts, round_, members)
            if reason is not None:
                return reason
            self._bell.wait(seen, self._tick, stop)
        return None


def _listed(state: State) -> set[Any]:
    return set(state.participants) | state.wait_list | state.redundancy_list
