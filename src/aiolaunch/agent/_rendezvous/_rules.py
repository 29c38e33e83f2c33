"""The rules of aiolaunch's rounds, as pure functions over torch's rendezvous state.

torch's dynamic rendezvous keeps one state per job (``_RendezvousState``:
``round``, ``complete``, ``closed``, ``participants``, ``wait_list``,
``redundancy_list``, ``last_heartbeats``, ``deadline``) in its backend (the
c10d store, etcd) and moves it by compare-and-swap. aiolaunch keeps that state
and its meaning - a torchrun agent can still read it - and decides the next
step of an agent by these rules instead of torch's join operation:

- **Spares.** An agent that finds the round complete and full waits in the
  redundancy list (a hot spare); it never counts as "waiting" (no restart of
  the running round), and an agent left in the wait list of a full round moves
  there too (torch leaves it waiting, and every later round restarts for it).
  When a round forms, the agents of the wait list (the last round's
  survivors) join first and spares fill what is left.
- **Leaving a round.** The first agent whose attempt ended dissolves the
  round in one step: every participant moves to the wait list and the next
  round begins (the others' watch sees it and restarts). One write instead
  of one per agent, and every live agent of the job is in one of the three
  lists while the next round forms.
- **Dead agents** (their liveness beacon stopped, :mod:`._liveness`) are
  removed from every list at once, not after torch's keep-alive expiry.
- **Closing a round.** The first round closes as torch's does (the maximum,
  or the minimum plus the last call). A later round closes as soon as every
  live, admissible agent of the job is in it, or it is full: no fixed last
  call after a failure; the join that brings the last one in closes it.
- **Admission.** An agent joins a forming round only once its health check
  passed (``ADMIT``), and never while its host is quarantined.

Each function reads ``state`` and a :class:`Facts` and returns an
:class:`Action`; :func:`apply` makes the change. Neither imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

__all__ = [
    "Action",
    "Facts",
    "Settings",
    "State",
    "all_in",
    "apply",
    "completes",
    "join_action",
    "leave_action",
    "restart_reason",
    "waiting_nodes",
]


class State(Protocol):
    """The fields of torch's ``_RendezvousState`` the rules read and change."""

    round: int
    complete: bool
    deadline: datetime | None
    closed: bool
    participants: dict[Any, int]
    wait_list: set[Any]
    redundancy_list: set[Any]
    last_heartbeats: dict[Any, datetime]


class Settings(Protocol):
    """What the rules read of torch's ``RendezvousSettings``."""

    @property
    def min_nodes(self) -> int: ...

    @property
    def max_nodes(self) -> int: ...

    @property
    def keep_alive_interval(self) -> timedelta: ...


class Action(Enum):
    """The next step of one agent."""

    FINISH = "finish"  # done: in the complete round (join), or out of it (leave)
    WAIT = "wait"  # nothing to do until the state changes
    CLOSED = "closed"  # the job is over
    QUARANTINED = "quarantined"  # this agent's host may not take part
    ADMIT = "admit"  # run the health check before joining
    NOT_ADMITTED = "not_admitted"  # the check failed: leave every list
    REMOVE_DEAD = "remove_dead"
    ADD_TO_WAIT_LIST = "add_to_wait_list"
    BECOME_SPARE = "become_spare"
    JOIN = "join"
    COMPLETE = "complete"
    DISSOLVE = "dissolve"  # end the running round: everyone to the wait list
    LEAVE = "leave"  # leave every list (the agent goes)
    KEEP_ALIVE = "keep_alive"


#: the actions that change who is where (the others at most a heartbeat)
MEMBERSHIP = frozenset(
    {
        Action.REMOVE_DEAD,
        Action.ADD_TO_WAIT_LIST,
        Action.BECOME_SPARE,
        Action.JOIN,
        Action.COMPLETE,
        Action.DISSOLVE,
        Action.LEAVE,
        Action.NOT_ADMITTED,
    }
)


@dataclass
class Facts:
    """What one agent knows beyond the state, when it decides.

    :param me: this agent's node (torch's ``_NodeDesc``).
    :param host: the host of a node (its address).
    :param dead: nodes whose liveness beacon stopped.
    :param quarantined: hosts that may not take part now.
    :param admitted: this agent's health check for the forming round:
        ``None`` not run yet, else whether it passed.
    :param last_call: torch's ``last_call_timeout`` (the first round only).
    :param now: the time (UTC) of the decision.
    """

    me: Any
    host: Callable[[Any], str]
    dead: Collection[Any] = ()
    quarantined: Collection[str] = ()
    admitted: bool | None = True
    last_call: timedelta = timedelta(seconds=30)
    now: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


def _known(state: State) -> set[Any]:
    return set(state.participants) | state.wait_list | state.redundancy_list


def _keep_alive_due(state: State, settings: Settings, facts: Facts) -> bool:
    last = state.last_heartbeats.get(facts.me)
    return last is None or last <= facts.now - settings.keep_alive_interval


def _wait(state: State, settings: Settings, facts: Facts) -> Action:
    listed = facts.me in _known(state)
    return Action.KEEP_ALIVE if listed and _keep_alive_due(state, settings, facts) else Action.WAIT


def join_action(state: State, settings: Settings, facts: Facts) -> Action:
    """The next step of an agent that wants to be in the next complete round."""
    me = facts.me
    if state.closed:
        return Action.CLOSED
    if facts.host(me) in facts.quarantined:
        return Action.QUARANTINED
    if (set(facts.dead) & _known(state)) - {me}:
        return Action.REMOVE_DEAD
    participants = state.participants
    full = len(participants) >= settings.max_nodes
    listed = me in state.wait_list or me in state.redundancy_list
    if me not in participants:
        forming = not state.complete and not full
        if forming and me in state.redundancy_list and _waiting_first(state, facts):
            return _wait(state, settings, facts)  # the last round's hosts first
        # Into the job's lists (a spare too) and into a forming round only
        # with a passing health check.
        if forming or not listed:
            if facts.admitted is None:
                return Action.ADMIT
            if not facts.admitted:
                return Action.NOT_ADMITTED
        if forming:
            return Action.JOIN
        if full:
            return (
                _wait(state, settings, facts)
                if me in state.redundancy_list
                else (Action.BECOME_SPARE)
            )
        return _wait(state, settings, facts) if me in state.wait_list else Action.ADD_TO_WAIT_LIST
    if state.complete:
        return Action.FINISH
    if any(facts.host(n) in facts.quarantined for n in participants):
        return _wait(state, settings, facts)  # it leaves by itself
    if all_in(state, settings, facts):
        return Action.COMPLETE
    # The first round: agents are still starting; torch's last call.
    last_call = state.deadline is not None and state.deadline <= facts.now
    if state.round == 0 and len(participants) >= settings.min_nodes and last_call:
        if _blocked(state, facts):
            return _wait(state, settings, facts)
        return Action.COMPLETE
    return _wait(state, settings, facts)


def _blocked(state: State, facts: Facts) -> bool:
    """A quarantined host is among the participants: it leaves by itself, and
    the round must not close with it."""
    return facts.host(facts.me) in facts.quarantined or any(
        facts.host(n) in facts.quarantined for n in state.participants
    )


def all_in(state: State, settings: Settings, facts: Facts) -> bool:
    """Whether the forming round may close now: full, or (after the first round)
    at least the minimum with every live, admissible agent of the job in it."""
    participants = state.participants
    if _blocked(state, facts):
        return False
    if len(participants) >= settings.max_nodes:
        return True
    if state.round == 0 or len(participants) < settings.min_nodes:
        return False
    dead = set(facts.dead)
    return not [
        n
        for n in (state.wait_list | state.redundancy_list)
        if n not in participants and n not in dead and facts.host(n) not in facts.quarantined
    ]


def completes(action: Action, state: State, settings: Settings, facts: Facts) -> bool:
    """Whether writing ``action`` closes the forming round (:func:`apply`'s rule)."""
    if action == Action.COMPLETE:
        return True
    if action != Action.JOIN or _blocked(state, facts):
        return False
    after = len(state.participants) + (facts.me not in state.participants)
    if after >= settings.max_nodes:
        return True
    if state.round == 0 or after < settings.min_nodes:
        return False
    dead = set(facts.dead)
    return not [
        n
        for n in (state.wait_list | state.redundancy_list)
        if n != facts.me
        and n not in state.participants
        and n not in dead
        and facts.host(n) not in facts.quarantined
    ]


def _waiting_first(state: State, facts: Facts) -> bool:
    """Whether agents of the wait list (live, admissible) are still to join."""
    dead = set(facts.dead)
    return any(
        n not in state.participants and n not in dead and facts.host(n) not in facts.quarantined
        for n in state.wait_list
    )


def leave_action(state: State, settings: Settings, facts: Facts, round_: int) -> Action:
    """The next step of an agent whose attempt of round ``round_`` ended: that
    round dissolved (by this agent, or another one first); :func:`join_action`
    goes on."""
    if state.closed:
        return Action.CLOSED
    if facts.me in state.participants and state.complete and state.round == round_:
        return Action.DISSOLVE
    return Action.FINISH


def restart_reason(
    state: State, settings: Settings, facts: Facts, round_: int, members: Collection[Any]
) -> str | None:
    """Why the running round ``round_`` (with ``members``) must re-form, or ``None``.

    Never once the rendezvous is closed (the job is ending).
    """
    if state.closed:
        return None
    if state.round != round_ or facts.me not in state.participants:
        return "this host is no longer in the running round"
    gone = [n for n in members if n not in state.participants]
    if gone:
        return f"{', '.join(sorted(facts.host(n) for n in gone))} left the round"
    waiting = waiting_nodes(state, settings, facts)
    if waiting:
        return f"{len(waiting)} new host(s) can join the round"
    return None


def waiting_nodes(state: State, settings: Settings, facts: Facts) -> list[Any]:
    """Agents that a restart would add to the round: live, admissible agents in
    the wait list while the round is complete and not full (never spares)."""
    if not state.complete or len(state.participants) >= settings.max_nodes:
        return []
    dead = set(facts.dead)
    return [
        n
        for n in state.wait_list
        if n not in dead and n not in state.participants and facts.host(n) not in facts.quarantined
    ]


def _epilogue(state: State, settings: Settings) -> None:
    """torch's ``_remove_participant_epilogue``: the last participant out of a
    complete round starts the next one."""
    if state.complete:
        if not state.participants:
            state.complete = False
            state.round += 1
    elif len(state.participants) < settings.min_nodes:
        state.deadline = None


def apply(action: Action, state: State, settings: Settings, facts: Facts) -> None:
    """Make ``action``'s change to ``state`` (a no-op for the others)."""
    me, now = facts.me, facts.now
    if action == Action.REMOVE_DEAD:
        removed = False
        for node in (set(facts.dead) & _known(state)) - {me}:
            removed = state.participants.pop(node, None) is not None or removed
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
            state.last_heartbeats.pop(node, None)
        if removed:
            _epilogue(state, settings)
    elif action == Action.ADD_TO_WAIT_LIST:
        state.redundancy_list.discard(me)
        state.wait_list.add(me)
        state.last_heartbeats[me] = now
    elif action == Action.BECOME_SPARE:
        state.wait_list.discard(me)
        state.redundancy_list.add(me)
        state.last_heartbeats[me] = now
    elif action == Action.JOIN:
        closes = completes(action, state, settings, facts)
        state.wait_list.discard(me)
        state.redundancy_list.discard(me)
        state.participants[me] = 0
        state.last_heartbeats[me] = now
        if len(state.participants) == settings.min_nodes:
            state.deadline = now + facts.last_call
        if closes:
            _complete(state)
    elif action == Action.COMPLETE:
        _complete(state)
    elif action == Action.DISSOLVE:
        state.wait_list |= set(state.participants)
        state.participants.clear()
        state.last_heartbeats[me] = now
        state.complete = False
        state.deadline = None
        state.round += 1
    elif action in (Action.LEAVE, Action.NOT_ADMITTED):
        was_in = state.participants.pop(me, None) is not None
        state.wait_list.discard(me)
        state.redundancy_list.discard(me)
        state.last_heartbeats.pop(me, None)
        if was_in:
            _epilogue(state, settings)
    elif action == Action.KEEP_ALIVE:
        state.last_heartbeats[me] = now


def _complete(state: State) -> None:
    """torch's ``_mark_rendezvous_complete``: ranks in the order of the nodes."""
    state.complete = True
    state.deadline = None
    for rank, node in enumerate(sorted(state.participants)):
        state.participants[node] = rank
