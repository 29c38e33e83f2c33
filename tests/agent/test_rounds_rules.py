"""The rules of aiolaunch's rounds (agent/_rendezvous/_rules.py), as pure functions.

The state is a plain object with torch's ``_RendezvousState`` fields; nodes
are strings ``"host/i"``. No torch, no store: each test pins one rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from aiolaunch.agent._rendezvous._rules import (
    Action,
    Facts,
    all_in,
    apply,
    completes,
    join_action,
    leave_action,
    restart_reason,
    waiting_nodes,
)

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


@dataclass
class State:
    round: int = 0
    complete: bool = False
    deadline: datetime | None = None
    closed: bool = False
    participants: dict[Any, int] = field(default_factory=dict)
    wait_list: set[Any] = field(default_factory=set)
    redundancy_list: set[Any] = field(default_factory=set)
    last_heartbeats: dict[Any, datetime] = field(default_factory=dict)


@dataclass(frozen=True)
class Settings:
    min_nodes: int = 2
    max_nodes: int = 2
    keep_alive_interval: timedelta = timedelta(seconds=5)


def host(node: Any) -> str:
    return str(node).split("/")[0]


def facts(me: str, **kw: Any) -> Facts:
    return Facts(me=me, host=host, now=NOW, **kw)


def running(*nodes: str, round_: int = 0) -> State:
    """A complete round of ``nodes`` (ranks in order), fresh heartbeats."""
    s = State(round=round_, complete=True)
    s.participants = {n: i for i, n in enumerate(sorted(nodes))}
    s.last_heartbeats = dict.fromkeys(nodes, NOW)
    return s


def step(state: State, settings: Settings, f: Facts) -> Action:
    """Decide and apply, as the driver does."""
    action = join_action(state, settings, f)
    apply(action, state, settings, f)
    return action


def test_a_spare_waits_without_disturbing_a_full_round() -> None:
    s, st = running("a/0", "b/0"), Settings()
    assert step(s, st, facts("c/0")) == Action.BECOME_SPARE
    assert s.redundancy_list == {"c/0"} and not s.wait_list
    assert join_action(s, st, facts("c/0")) == Action.WAIT
    # no restart of the running round for a spare
    assert restart_reason(s, st, facts("a/0"), 0, ["a/0", "b/0"]) is None
    assert waiting_nodes(s, st, facts("a/0")) == []


def test_a_waiting_agent_of_a_full_round_becomes_a_spare() -> None:
    """torch leaves it in the wait list, where every later round restarts for it."""
    s, st = running("a/0", "b/0"), Settings()
    s.wait_list.add("c/0")
    assert join_action(s, st, facts("c/0")) == Action.BECOME_SPARE
    assert waiting_nodes(s, st, facts("a/0")) == []  # and never counts as waiting


def test_the_first_agent_out_dissolves_the_round_for_everyone() -> None:
    s, st = running("a/0", "b/0", "c/0"), Settings(max_nodes=3)
    assert leave_action(s, st, facts("a/0"), 0) == Action.DISSOLVE
    apply(Action.DISSOLVE, s, st, facts("a/0"))
    assert (s.round, s.complete, s.participants) == (1, False, {})
    assert s.wait_list == {"a/0", "b/0", "c/0"}
    # the others find it done: nothing to leave, and their watch says why
    assert leave_action(s, st, facts("b/0"), 0) == Action.FINISH
    assert restart_reason(s, st, facts("b/0"), 0, ["a/0", "b/0", "c/0"]) is not None


def test_a_re_forming_round_closes_once_every_live_agent_is_in() -> None:
    """Not after torch's last call: the join of the last live agent closes it."""
    s, st = running("a/0", "b/0", "c/0"), Settings(min_nodes=2, max_nodes=3)
    apply(Action.DISSOLVE, s, st, facts("a/0"))
    dead = {"c/0"}  # its beacon stopped
    assert join_action(s, st, facts("a/0", dead=dead)) == Action.REMOVE_DEAD
    apply(Action.REMOVE_DEAD, s, st, facts("a/0", dead=dead))
    assert s.wait_list == {"a/0", "b/0"}
    assert step(s, st, facts("a/0")) == Action.JOIN
    assert not s.complete  # b is alive and on its way
    assert join_action(s, st, facts("a/0")) == Action.WAIT
    assert completes(Action.JOIN, s, st, facts("b/0"))
    assert step(s, st, facts("b/0")) == Action.JOIN
    assert s.complete and s.participants == {"a/0": 0, "b/0": 1}


def test_the_first_round_waits_for_torchs_last_call() -> None:
    """At the start agents are still arriving: min reached is not enough."""
    s, st = State(), Settings(min_nodes=1, max_nodes=3)
    assert step(s, st, facts("a/0")) == Action.JOIN
    assert s.deadline == NOW + timedelta(seconds=30) and not s.complete
    assert not all_in(s, st, facts("a/0"))
    assert join_action(s, st, facts("a/0")) == Action.WAIT
    later = Facts(me="a/0", host=host, now=NOW + timedelta(seconds=31))
    assert join_action(s, st, later) == Action.COMPLETE


def test_survivors_join_before_spares() -> None:
    s, st = running("a/0", "b/0"), Settings()
    s.redundancy_list = {"c/0", "d/0"}
    s.last_heartbeats.update({"c/0": NOW, "d/0": NOW})
    apply(Action.DISSOLVE, s, st, facts("a/0"))
    assert join_action(s, st, facts("c/0")) == Action.WAIT  # a, b first
    apply(Action.REMOVE_DEAD, s, st, facts("a/0", dead={"b/0"}))
    step(s, st, facts("a/0"))
    assert step(s, st, facts("c/0")) == Action.JOIN  # b is gone: a spare fills in
    assert s.complete and set(s.participants) == {"a/0", "c/0"}
    assert join_action(s, st, facts("d/0")) == Action.WAIT  # still a spare
    assert restart_reason(s, st, facts("a/0"), 1, ["a/0", "c/0"]) is None


def test_a_health_check_runs_before_joining_and_a_refusal_leaves_every_list() -> None:
    s, st = running("a/0", "b/0"), Settings()
    apply(Action.DISSOLVE, s, st, facts("a/0"))
    assert join_action(s, st, facts("b/0", admitted=None)) == Action.ADMIT
    assert step(s, st, facts("b/0", admitted=False)) == Action.NOT_ADMITTED
    assert "b/0" not in s.wait_list and "b/0" not in s.last_heartbeats


def test_a_quarantined_host_does_not_join_and_blocks_no_round() -> None:
    s, st = running("a/0", "b/0"), Settings(min_nodes=1)
    apply(Action.DISSOLVE, s, st, facts("a/0"))
    q = {"b"}
    assert join_action(s, st, facts("b/0", quarantined=q)) == Action.QUARANTINED
    assert step(s, st, facts("a/0", quarantined=q)) == Action.JOIN
    assert s.complete  # b is no candidate: a alone (min 1) closes the round


def test_new_hosts_below_the_maximum_restart_the_round_once() -> None:
    s, st = running("a/0", "b/0"), Settings(min_nodes=2, max_nodes=3)
    assert step(s, st, facts("c/0")) == Action.ADD_TO_WAIT_LIST
    assert restart_reason(s, st, facts("a/0"), 0, ["a/0", "b/0"]) == (
        "1 new host(s) can join the round"
    )
    assert waiting_nodes(s, st, facts("a/0", dead={"c/0"})) == []  # not a dead one


def test_a_member_gone_makes_the_running_round_re_form() -> None:
    s, st = running("a/0", "b/0"), Settings()
    apply(Action.REMOVE_DEAD, s, st, facts("a/0", dead={"b/0"}))
    assert restart_reason(s, st, facts("a/0"), 0, ["a/0", "b/0"]) == "b left the round"


def test_a_closed_rendezvous_never_restarts_a_round() -> None:
    s, st = running("a/0", "b/0"), Settings()
    s.closed = True
    s.wait_list.add("c/0")
    assert restart_reason(s, st, facts("a/0"), 0, ["a/0", "b/0", "x/0"]) is None
    assert join_action(s, st, facts("c/0")) == Action.CLOSED


def test_keep_alive_only_when_due() -> None:
    s, st = running("a/0", "b/0"), Settings()
    s.redundancy_list.add("c/0")
    s.last_heartbeats["c/0"] = NOW
    assert join_action(s, st, facts("c/0")) == Action.WAIT
    s.last_heartbeats["c/0"] = NOW - timedelta(seconds=6)
    assert step(s, st, facts("c/0")) == Action.KEEP_ALIVE
    assert s.last_heartbeats["c/0"] == NOW


def test_the_last_participant_out_of_a_complete_round_starts_the_next() -> None:
    """torch's epilogue, kept for an agent that leaves for good."""
    s, st = running("a/0"), Settings(min_nodes=1, max_nodes=2)
    apply(Action.LEAVE, s, st, facts("a/0"))
    assert (s.round, s.complete) == (1, False)


def test_a_round_never_closes_with_a_quarantined_participant() -> None:
    """b joined before the charge of the last round quarantined it: the join
    that fills the round must not close it (b leaves by itself)."""
    s, st = running("a/0", "b/0"), Settings()
    apply(Action.DISSOLVE, s, st, facts("a/0"))
    step(s, st, facts("b/0"))
    q = {"b"}
    assert not completes(Action.JOIN, s, st, facts("a/0", quarantined=q))
    assert step(s, st, facts("a/0", quarantined=q)) == Action.JOIN
    assert not s.complete
    assert join_action(s, st, facts("a/0", quarantined=q)) == Action.WAIT
    assert step(s, st, facts("b/0", quarantined=q)) == Action.QUARANTINED


def test_a_newcomer_checks_its_health_before_it_waits_as_a_spare() -> None:
    s, st = running("a/0", "b/0"), Settings()
    assert join_action(s, st, facts("c/0", admitted=None)) == Action.ADMIT
    assert step(s, st, facts("c/0", admitted=False)) == Action.NOT_ADMITTED
    assert "c/0" not in s.redundancy_list | s.wait_list
    assert step(s, st, facts("c/0", admitted=True)) == Action.BECOME_SPARE
