"""The verdict from the collectives and the record files, pure (no processes):
torch's Flight Recorder dumps in the shape gloo writes them (torch 2.13)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolaunch._hangs._collective import VERDICTS, CollectiveVerdict, RankView, judge
from aiolaunch._hangs._collectives import Look
from aiolaunch._hangs._records import members, parse_record, torch_dump, write_dumps
from aiolaunch._hangs._stall import Stall
from aiolaunch._hangs._waits import weigh

if TYPE_CHECKING:
    from pathlib import Path

    from aiolaunch._hangs._records import Record

DEFAULT = ("0", "default_pg")
PAIR = ("1", "pair01")


def entry(
    seq: int, *, pg: tuple[str, str] = DEFAULT, op: str = "all_reduce",
    sizes: list[list[int]] | None = None, t: int = 0, done: bool = True, backend: str = "gloo",
) -> dict[str, Any]:  # fmt: skip
    """One entry as torch 2.13's gloo dump writes it."""
    sizes = [[4]] if sizes is None else sizes
    return {
        "collective_seq_id": seq, "input_dtypes": ["Float"], "input_sizes": sizes,
        "is_p2p": False, "op_id": seq, "output_dtypes": ["Float"], "output_sizes": sizes,
        "p2p_seq_id": 0, "pg_id": int(pg[0]), "process_group": list(pg),
        "profiling_name": f"{backend}:{op}", "record_id": seq - 1, "retired": done,
        "state": "scheduled", "thread_id": "1", "thread_name": "python3",
        "time_created_ns": 1_000_000_000 + t, "time_discovered_completed_ns": 0,
        "time_discovered_started_ns": 0, "timeout_ms": 1800000,
    }  # fmt: skip


def dump(*entries: dict[str, Any]) -> bytes:
    """A whole dump, with gloo's broken ``pg_config``."""
    data: dict[str, Any] = {
        "comm_lib_version": "", "nccl_comm_state": {}, "version": "2.10",
        "pg_config": {"": {"desc": "", "name": "", "ranks": "[]"}},
        "pg_status": {"0": {"last_completed_collective": "4", "last_enqueued_collective": "5",
                            "last_started_collective": "-1"}},
    }  # fmt: skip
    if entries:  # torch leaves the key out of an empty record
        data["entries"] = list(entries)
    return json.dumps(data).encode()


def steps(n: int, *, pg: tuple[str, str] = DEFAULT) -> list[dict[str, Any]]:
    return [entry(i, pg=pg, t=i * 1000) for i in range(1, n + 1)]


def records(dumps: dict[int, bytes]) -> dict[int, Record]:
    return {r: parse_record(r, [raw]) for r, raw in dumps.items()}


def alive(n: int, **kw: Any) -> dict[int, RankView]:
    return {r: RankView(**kw) for r in range(n)}


def waiting_at_5(rank: int) -> bytes:
    return dump(*steps(4), entry(5, done=False, t=9000 + rank))


def test_a_rank_that_skipped_is_missing() -> None:
    recs = records({**{r: waiting_at_5(r) for r in range(3)}, 3: dump(*steps(4))})
    v = judge(recs, alive(4), 4)
    assert (v.verdict, v.ranks, v.waiting) == ("missing", (3,), (0, 1, 2))
    assert (v.pg, v.seq, v.op, v.shapes, v.members) == (
        "default_pg",
        5,
        "all_reduce",
        [[4]],
        (0, 1, 2, 3),
    )
    assert v.text == "rank 3 never entered all_reduce #5 of default_pg, in which ranks 0-2 wait"
    assert v.role(3) == "missing: all_reduce #5 of default_pg"
    assert v.role(1) == "waits in all_reduce #5 of default_pg"
    assert v.role(7) is None
    assert set(v.to_json()) >= {"verdict", "ranks", "waiting", "pg", "seq", "op", "shapes", "dumps"}


def test_a_rank_computing_outside_any_collective_is_in_compute() -> None:
    recs = records({**{r: waiting_at_5(r) for r in range(3)}, 3: dump(*steps(4))})
    views = {**alive(3), 3: RankView(busy=True)}
    v = judge(recs, views, 4)
    assert (v.verdict, v.ranks, v.seq) == ("in_compute", (3,), 5)
    assert "rank 3 computes outside any collective while ranks 0-2 wait" in v.text


@pytest.mark.parametrize(
    ("op", "sizes"), [("all_gather", [[4]]), ("all_reduce", [[8]])], ids=["op", "shapes"]
)
def test_another_op_or_other_shapes_at_the_same_number_is_a_mismatch(
    op: str, sizes: list[list[int]]
) -> None:
    odd = dump(*steps(4), entry(5, op=op, sizes=sizes, done=False))
    recs = records({**{r: waiting_at_5(r) for r in range(3)}, 3: odd})
    v = judge(recs, alive(4), 4)
    assert (v.verdict, v.ranks, v.waiting, v.op, v.seq) == (
        "mismatch", (3,), (0, 1, 2), "all_reduce", 5,
    )  # fmt: skip
    assert f"rank 3 entered {op} {sizes} as #5 of default_pg" in v.text
    assert (
        v.role(3)
        == f"mismatch: entered {op} {sizes} where others wait in all_reduce #5 of default_pg"
    )


def test_other_sizes_that_gloo_aborts_at_once_are_a_mismatch_not_an_exit() -> None:
    # gloo aborts an all_reduce of other sizes at once: every member's entry
    # reads done, and they die of it, the odd one not necessarily first.
    odd = dump(*steps(4), entry(5, sizes=[[8]], t=4000))
    recs = records({**{r: dump(*steps(5)) for r in range(3)}, 3: odd})
    views = {r: RankView(exited=True, exit_order=3 - r, exitcode=1) for r in range(4)}
    v = judge(recs, views, 4)
    assert (v.verdict, v.ranks, v.waiting, v.op, v.seq, v.shapes) == (
        "mismatch", (3,), (0, 1, 2), "all_reduce", 5, [[4]],
    )  # fmt: skip
    assert v.text == (
        "rank 3 entered all_reduce [[8]] as #5 of default_pg, where ranks 0-2 entered "
        "all_reduce [[4]]: they can never match"
    )
    # The others still wait in it, the odd one died: its last words say what it entered.
    recs = records({**{r: waiting_at_5(r) for r in range(3)}, 3: odd})
    views = {**alive(3), 3: RankView(exited=True, exitcode=1)}
    v = judge(recs, views, 4)
    assert (v.verdict, v.ranks, v.waiting, v.seq) == ("mismatch", (3,), (0, 1, 2), 5)
    # The same sizes everywhere: the first to die, inside it (as before).
    recs = records({r: dump(*steps(5)) for r in range(4)})
    assert judge(recs, views, 4).verdict == "exited"


def test_a_dead_rank_the_others_wait_for_exited() -> None:
    recs = records({r: waiting_at_5(r) for r in range(3)})
    views = {**alive(3), 3: RankView(exited=True, exitcode=0)}
    v = judge(recs, views, 4)
    assert (v.verdict, v.ranks, v.waiting, v.seq) == ("exited", (3,), (0, 1, 2), 5)
    assert (
        v.text
        == "rank 3 exited (exit code 0) before all_reduce #5 of default_pg, in which ranks 0-2 wait"
    )


def test_gloo_fails_the_others_collective_at_once_the_one_that_left_is_named() -> None:
    # A peer's exit fails gloo's collective on the others at once: it reads
    # done, and they all die within a second, in any order. Their last
    # words (the record each wrote as it exited) say who never entered it.
    errored = dump(*steps(5))
    recs = records({0: errored, 1: errored, 2: errored, 3: dump(*steps(4))})
    views = {
        0: RankView(exited=True, exit_order=0, exitcode=1),
        1: RankView(exited=True, exit_order=1, exitcode=1),
        2: RankView(), 3: RankView(exited=True, exit_order=3, exitcode=0),
    }  # fmt: skip
    v = judge(recs, views, 4)
    assert (v.verdict, v.ranks, v.waiting, v.seq, v.op) == (
        "exited", (3,), (0, 1, 2), 5, "all_reduce",
    )  # fmt: skip
    assert v.text == (
        "rank 3 exited (exit code 0) before all_reduce #5 of default_pg, which ranks 0-2 entered"
    )
    # Rank 1 still waits, ranks 0 and 2 died inside (their last words): the
    # one that left first is named, not those that died of it.
    died = {**views, 1: RankView(), 2: RankView(exited=True, exit_order=2, exitcode=1)}
    pending = records({0: errored, 1: waiting_at_5(1), 2: errored, 3: dump(*steps(4))})
    v = judge(pending, died, 4)
    assert (v.verdict, v.ranks, v.waiting, v.seq) == ("exited", (3,), (0, 1, 2), 5), v
    # Without last words, every dead member that cannot be shown inside is named.
    del recs[0], recs[3]
    assert judge(recs, views, 4).ranks == (0, 3)
    # Every dead member entered it: the first to die, inside.
    recs = records({r: errored for r in range(4)})
    v = judge(recs, views, 4)
    assert (v.verdict, v.ranks) == ("exited", (0,))
    assert v.text.startswith("rank 0 exited (exit code 1) in all_reduce #5 of default_pg")


def test_nothing_in_flight_is_none() -> None:
    recs = records({r: dump(*steps(4)) for r in range(4)})
    v = judge(recs, alive(4), 4)
    assert v == CollectiveVerdict("none") and v.text == "no collective in flight"
    assert judge(records({r: dump() for r in range(2)}), alive(2), 2).verdict == "none"


def test_every_member_inside_is_none_with_its_waiters() -> None:
    recs = records({r: waiting_at_5(r) for r in range(4)})
    v = judge(recs, alive(4), 4)
    assert (v.verdict, v.ranks, v.waiting, v.seq) == ("none", (), (0, 1, 2, 3), 5)
    assert "which every member entered" in v.text


def _subgroup(rank1_pending_in_world: bool) -> dict[int, Record]:
    # pair01 = {0, 1} ran one collective; rank 0 waits in its second, which
    # rank 1 skipped; ranks 2 and 3 (not members) wait in the world's next one.
    past = [*steps(3), entry(1, pg=PAIR, t=3500)]
    world = entry(4, done=False, t=9000)
    rank1 = [*past, world] if rank1_pending_in_world else past
    return records({
        0: dump(*past, entry(2, pg=PAIR, done=False, t=8000)),
        1: dump(*rank1),
        2: dump(*steps(3), world),
        3: dump(*steps(3), world),
    })  # fmt: skip


def test_a_rank_that_missed_a_subgroups_collective_is_named_with_the_subgroup() -> None:
    v = judge(_subgroup(False), alive(4), 4)
    assert (v.verdict, v.ranks, v.waiting) == ("missing", (1,), (0,))
    assert (v.pg, v.seq, v.members) == ("pair01", 2, (0, 1))
    assert v.text == "rank 1 never entered all_reduce #2 of pair01, in which rank 0 waits"


def test_a_cycle_of_waits_names_the_subgroups_absent_member() -> None:
    # Rank 1 skipped pair01's collective and went on to the world's: each of
    # ranks 0 and 1 waits in a collective the other is not in.
    v = judge(_subgroup(True), alive(4), 4)
    assert (v.verdict, v.ranks, v.waiting, v.pg, v.seq) == ("missing", (1,), (0,), "pair01", 2)
    assert "rank 1 waits in all_reduce #4 of default_pg: a cycle of waits" in v.text


def test_ranks_on_another_host_are_unseen_not_dead() -> None:
    recs = records({r: waiting_at_5(r) for r in range(2)})
    v = judge(recs, alive(2), 4)  # ranks 2 and 3 run elsewhere
    assert (v.verdict, v.ranks) == ("missing", (2, 3))
    assert "rank 2: not on this host" in v.text


def test_members_default_group_is_the_world_subgroups_are_inferred() -> None:
    recs = _subgroup(False)
    groups = members(recs, 4)
    assert groups[("gloo", "0")] == frozenset(range(4))
    assert groups[("gloo", "1")] == frozenset({0, 1})
    # A dump that names a group's members (NCCL's pg_config) is believed.
    raw = json.loads(dump(entry(1, pg=("5", "tp"), backend="nccl", done=False)))
    raw["pg_config"] = {"5": {"name": "5", "desc": "tp", "ranks": "[0, 2]"}}
    recs = {0: parse_record(0, [json.dumps(raw).encode()])}
    assert members(recs, 4)[("nccl", "5")] == frozenset({0, 2})


def test_gloo_and_nccl_of_one_process_group_count_apart() -> None:
    gloo = dump(*steps(2))
    nccl = json.dumps(json.loads(dump(entry(1, backend="nccl", done=False)))).encode()
    rec = parse_record(0, [gloo, nccl])
    assert [e.key for e in rec.entries] == [("gloo", "0", 1), ("gloo", "0", 2), ("nccl", "0", 1)]
    assert rec.pending() is not None and rec.pending().backend == "nccl"  # type: ignore[union-attr]


def test_a_damaged_entry_is_skipped_a_damaged_dump_raises() -> None:
    bad = json.loads(dump(*steps(2)))
    del bad["entries"][0]["process_group"]
    rec = parse_record(0, [json.dumps(bad).encode()])
    assert [e.seq for e in rec.entries] == [2]
    with pytest.raises(ValueError, match="a JSON object"):
        parse_record(0, [b"[1, 2]"])


def test_torch_dump_fills_pg_config_for_every_group(tmp_path: Path) -> None:
    recs = _subgroup(False)
    groups = members(recs, 4)
    d = torch_dump(recs[0], groups)
    assert d["pg_config"] == {
        "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
        "1": {"name": "1", "desc": "pair01", "ranks": "[0, 1]"},
    }
    assert len(d["entries"]) == len(recs[0].entries)
    write_dumps(str(tmp_path / "fr"), recs, groups)
    files = sorted(p.name for p in (tmp_path / "fr").iterdir())
    assert files == ["rank_0", "rank_1", "rank_2", "rank_3"]
    back = pickle.loads((tmp_path / "fr" / "rank_2").read_bytes())
    assert back["pg_config"]["0"]["ranks"] == "[0, 1, 2, 3]"


def test_torchfrtrace_reads_the_dumps_and_finds_the_missing_rank(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    recs = records({**{r: waiting_at_5(r) for r in range(3)}, 3: dump(*steps(4))})
    write_dumps(str(tmp_path / "fr"), recs, members(recs, 4))
    seen = torchfrtrace(tmp_path / "fr")
    assert "collective: gloo:all_reduce" in seen and "missing ranks: {3}" in seen


def torchfrtrace(folder: Path) -> str:
    """What torch's analyzer prints of ``folder`` (its own process: its
    logger keeps the first stream it was given)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # gloo's own dumps: KeyError ('0', 3)
    text = proc.stdout + proc.stderr
    assert "collective: gloo:" in text, text  # it found the collective that went wrong
    return text


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(2, 16),
    data=st.data(),
)
def test_whoever_skips_is_the_one_named(world: int, data: st.DataObject) -> None:
    culprit = data.draw(st.integers(0, world - 1))
    done = data.draw(st.integers(1, 6))
    busy = data.draw(st.booleans())
    dumps = {
        r: dump(*steps(done)) if r == culprit
        else dump(*steps(done), entry(done + 1, done=False, t=r))
        for r in range(world)
    }  # fmt: skip
    views = {r: RankView(busy=busy if r == culprit else False) for r in range(world)}
    v = judge(records(dumps), views, world)
    assert v.verdict == ("in_compute" if busy else "missing")
    assert v.ranks == (culprit,) and v.seq == done + 1
    assert v.waiting == tuple(r for r in range(world) if r != culprit)
    assert v.verdict in VERDICTS


# -- waits versus work (the stall rule's flags, weighed against the records) ----------


def _look(recs: dict[int, Record], views: dict[int, RankView], world: int) -> Look:
    groups = members(recs, world)
    return Look(judge(recs, views, world, groups), recs, {g: g for g in views}, groups)


def _stall(rank: int) -> Stall:
    return Stall(rank, 100 + rank, 5.0, "no output and no CPU for 5.0s (stall_after=5s)")


def test_a_wait_on_a_working_rank_is_no_stall_a_wait_on_an_idle_one_is() -> None:
    # Ranks 1-3 wait in all_reduce #5 (entered 6 s ago); rank 0 is elsewhere.
    recs = records({0: dump(*steps(4)), **{r: waiting_at_5(r) for r in (1, 2, 3)}})
    look = _look(recs, alive(4), 4)
    stalls = [_stall(r) for r in (1, 2, 3)]
    wall = 1.0 + 6.0 + 0.009  # entries were made at 1 s (+9 us)
    w = weigh(stalls, look, working={0}.__contains__, busy={0}.__contains__, wall=wall,
              stall_after=5.0)  # fmt: skip
    assert (w.stalls, w.excused) == ([], [1, 2, 3])
    assert w.waits == {"all_reduce #5 of default_pg for rank 0": [1, 2, 3]}
    assert w.roles[2] == "waits in all_reduce #5 of default_pg for rank 0 (working)"
    # Rank 0 idle (no CPU): the stall stands, its reason names the verdict.
    w = weigh(stalls, look, working=lambda r: False, busy=lambda r: False, wall=wall,
              stall_after=5.0)  # fmt: skip
    assert w.excused == [] and [s.rank for s in w.stalls] == [1, 2, 3]
    assert w.stalls[0].reason.endswith(
        "; collectives: rank 0 never entered all_reduce #5 of default_pg, in which ranks 1-3 wait"
    )


def test_computing_between_collectives_is_no_stall_until_peers_waited_the_stall_time() -> None:
    recs = records({0: dump(*steps(4)), **{r: waiting_at_5(r) for r in (1, 2, 3)}})
    look = _look(recs, {**alive(4), 0: RankView(busy=True)}, 4)
    spin = [_stall(0)]  # rank 0 spins at the same frames: flagged by the rule
    early = weigh(spin, look, working=lambda r: False, busy={0}.__contains__, wall=1.0 + 2.0,
                  stall_after=5.0)  # fmt: skip
    assert (early.stalls, early.excused) == ([], [0])
    late = weigh(spin, look, working=lambda r: False, busy={0}.__contains__, wall=1.0 + 6.0,
                 stall_after=5.0)  # fmt: skip
    assert [s.rank for s in late.stalls] == [0] and late.excused == []
    assert "rank 0 computes outside any collective" in late.stalls[0].reason
    # Nobody waits: working between collectives, whatever its frames; idle stands.
    quiet = records({r: dump(*steps(4)) for r in range(4)})
    look = _look(quiet, alive(4), 4)
    busy = weigh(spin, look, working=lambda r: False, busy={0}.__contains__, wall=100.0,
                 stall_after=5.0)  # fmt: skip
    assert busy.excused == [0] and busy.roles == {0: None}
    idle = weigh(spin, look, working=lambda r: False, busy=lambda r: False, wall=100.0,
                 stall_after=5.0)  # fmt: skip
    assert [s.rank for s in idle.stalls] == [0]


def test_a_rank_without_a_record_keeps_the_rule() -> None:
    recs = records({r: waiting_at_5(r) for r in (1, 2, 3)})
    look = _look(recs, alive(4), 4)
    s = _stall(0)
    w = weigh([s], look, working=lambda r: True, busy=lambda r: True, wall=100.0, stall_after=5.0)
    assert w.stalls == [s]


def test_status_and_top_show_what_the_records_say() -> None:
    from aiolaunch._cli._client import format_status
    from aiolaunch._cli._top_view import TopState, screen

    base = {"pid": 7, "restarts": 0, "last_output_s": 1.0, "cpu_percent": 0.0, "rss": 1 << 20}
    workers = [
        {**base, "rank": 0, "state": "sleeping", "collective": "waits in all_reduce #5 of default_pg"},
        {**base, "rank": 1, "state": "straggling", "straggling": True, "lateness_s": 0.102},
    ]  # fmt: skip
    text = format_status(workers)
    assert "rank 0: waits in all_reduce #5 of default_pg" in text
    assert "rank 1: 0.102s late at collectives (median)" in text
    lines = [line for line, _ in screen({"name": "g", "workers": workers}, TopState(), 160, 10)]
    assert any("STRAGGLING +0.102s" in line for line in lines), lines
    assert any("waits in all_reduce #5 of default_pg" in line for line in lines), lines


async def test_ranks_without_a_record_are_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from aiolaunch._group import GroupState
    from aiolaunch._hangs._collectives import Collectives
    from aiolaunch._workers._handle import WorkerHandle

    state = GroupState("old", 2)
    for rank in range(2):
        h = WorkerHandle(rank)
        h.pid = os.getpid()  # alive, and its description names this process
        state.started(h)
    why = "torch 2.7.1 keeps no collective record for gloo (torch 2.8 does)"
    (tmp_path / f"fr-{os.getpid()}.off").write_text(why)
    c = Collectives(state, str(tmp_path), str(tmp_path))
    with caplog.at_level("WARNING", logger="aiolaunch"):
        assert not c.armed() and not c.armed()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"aiolaunch: no collective record for ranks 0-1 of 'old' ({why}): hangs there are "
        "judged by their stacks only"
    ]
    assert await c.look(lambda r: False) is None  # nothing to judge: the stack rule alone
