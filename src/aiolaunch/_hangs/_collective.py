"""The verdict from the collectives: who holds the others up, in which collective. Pure.

A function of every rank's record (:class:`~aiolaunch._hangs._records.Record`)
and of what the supervisor knows besides (:class:`RankView`: exited, busy,
no record), unit-tested without processes. The ranks that wait are the ones
with a pending entry (:meth:`Record.pending`); ranks pending at the same
``(group, sequence number)`` wait in the same collective, and a member of
that group who is not there holds it up. In order:

1. ``mismatch``: ranks that entered the same sequence number of a group
   with another op or other sizes than the majority there - pending, or in
   the last words of a rank that died of it - (or ranks pending at another
   sequence number of that group): the collective can never complete;
2. for each collective ranks wait in, its *absent* members: dead
   (``exited``), outside any collective (working: ``in_compute``; idle or
   unseen: ``missing``), or waiting in another collective. The verdict is
   the collective whose absent members all hold it up themselves (none of
   them waits elsewhere) - the root of the chain of waits - with the most
   waiters; its absent members are the culprits. Absent members that all
   wait elsewhere form a cycle (two ranks each in a collective the other
   skipped): the smallest group's absent members are named, ``missing``;
3. nobody pending, or members that died inside the collective the others
   wait in (gloo fails it for some at once when a peer exits: their last
   words show it done, while others still wait): ``mismatch`` if the
   members entered the collective entered last with other ops or sizes
   (gloo fails an all_reduce of other sizes at once, or lets some return);
   ``exited`` if a rank died, naming the dead members that never entered
   it, else the first to die, and the collective the members of its groups
   entered last; else ``none``.

The culprits and waiters are global ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._culprits import ranks_text
from ._records import members as group_members

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from ._records import Entry, Group, Record

__all__ = ["VERDICTS", "CollectiveVerdict", "RankView", "judge"]

#: The verdict kinds (``report.json``'s ``"collective"["verdict"]``).
VERDICTS = ("missing", "mismatch", "in_compute", "exited", "none")


@dataclass(frozen=True)
class RankView:
    """What the supervisor knows of a rank besides its record.

    :param exited: its process is gone.
    :param exit_order: when it exited among the group's exits (0: first).
    :param exitcode: its exit status, if known.
    :param busy: its main thread used the CPU lately (working, or spinning).
    :param note: why it has no record, if it has none.
    """

    exited: bool = False
    exit_order: int = 0
    exitcode: int | None = None
    busy: bool = False
    note: str = ""


@dataclass(frozen=True)
class CollectiveVerdict:
    """The collectives' verdict (``report.json``'s ``"collective"``).

    :param verdict: one of :data:`VERDICTS`.
    :param ranks: the culprits (global ranks).
    :param waiting: the ranks blocked in the collective (or that entered it).
    :param pg: the process group (its description, else its name).
    :param seq: the collective's sequence number in its group.
    :param op: the operation the waiting ranks entered.
    :param shapes: their input sizes.
    :param members: the group's members (global ranks), as far as known.
    :param text: the verdict as one sentence.
    :param dumps: the folder of the ranks' raw records (filled by the caller).
    """

    verdict: str
    ranks: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    pg: str | None = None
    seq: int | None = None
    op: str | None = None
    shapes: list[list[int]] = field(default_factory=list)
    members: tuple[int, ...] = ()
    text: str = "no collective in flight"
    dumps: str = ""
    #: the entry the culprits entered instead (a mismatch), for their status
    other: str = ""

    def to_json(self) -> dict[str, Any]:
        """``report.json``'s ``"collective"``."""
        return {
            "verdict": self.verdict,
            "ranks": list(self.ranks),
            "waiting": list(self.waiting),
            "pg": self.pg,
            "seq": self.seq,
            "op": self.op,
            "shapes": self.shapes,
            "members": list(self.members),
            "text": self.text,
            "dumps": self.dumps,
        }

    def role(self, rank: int) -> str | None:
        """What ``rank`` (global) does in this verdict, for its status row."""
        where = f"{self.op} #{self.seq} of {self.pg}" if self.op is not None else ""
        if rank in self.ranks:
            if self.verdict == "mismatch":
                return f"mismatch: entered {self.other} where others wait in {where}"
            return f"{self.verdict}: {where}" if where else self.verdict
        if rank in self.waiting:
            return f"waits in {where}"
        return None


def _shape_text(entry: Entry) -> str:
    return f"{entry.op} {entry.shapes}"


def judge(
    records: Mapping[int, Record],
    views: Mapping[int, RankView],
    world_size: int,
    groups: Mapping[Group, frozenset[int]] | None = None,
) -> CollectiveVerdict:
    """The verdict (see the module docstring).

    :param records: the records pulled, by global rank.
    :param views: every rank known to the supervisor, by global rank (ranks
        without a view are on another host: unseen).
    :param world_size: ranks in the default group.
    :param groups: every group's members; inferred from ``records`` if ``None``.
    """
    if groups is None:
        groups = group_members(records, world_size)
    pending: dict[int, Entry] = {}
    for rank, rec in records.items():
        e = rec.pending()
        if e is not None and not views.get(rank, RankView()).exited:
            pending[rank] = e
    at: dict[tuple[str, str, int], list[int]] = {}
    for rank, e in sorted(pending.items()):
        at.setdefault(e.key, []).append(rank)
    if not at:
        return _after_exit(records, views, groups)
    by_group: dict[Group, list[int]] = {}
    for rank, e in pending.items():
        by_group.setdefault(e.group, []).append(rank)
    mismatch = _mismatch(pending, at, by_group, records, groups)
    if mismatch is not None:
        return mismatch
    if any(
        views.get(r, RankView()).exited for key in at for r in _entries_at(records, key)
    ):  # members died inside it: a peer's exit failed it for them, not for all yet
        return _after_exit(records, views, groups)
    # The absent members of each collective ranks wait in, and what they do.
    candidates: list[tuple[tuple[str, str, int], list[int], list[int]]] = []
    for key, waiters in at.items():
        group = key[:2]
        absent = sorted(groups.get(group, frozenset(waiters)) - set(waiters))
        if absent:
            candidates.append((key, waiters, absent))
    if not candidates:
        key, waiters = max(at.items(), key=lambda kv: (len(kv[1]), kv[0]))
        entry = pending[waiters[0]]
        return _verdict(
            "none",
            (),
            waiters,
            entry,
            groups,
            f"{_wait(waiters)} in {entry.label}, which every member entered: "
            "it does not complete (the transport, or a rank blocked inside it)",
        )
    roots = [c for c in candidates if not any(r in pending for r in c[2])]
    if roots:
        key, waiters, absent = max(roots, key=lambda c: (len(c[1]), -_oldest(pending, c[1]), c[0]))
        return _absent(key, waiters, absent, pending, records, views, groups)
    # A cycle: every absent member waits in another collective.
    key, waiters, absent = min(
        candidates, key=lambda c: (len(groups.get(c[0][:2], ())), -len(c[1]), c[0])
    )
    entry = pending[waiters[0]]
    elsewhere = "; ".join(f"rank {r} waits in {pending[r].label}" for r in absent)
    return _verdict(
        "missing",
        absent,
        waiters,
        entry,
        groups,
        f"{ranks_text(absent)} never entered {entry.label}, in which {_wait(waiters)} "
        f"({elsewhere}: a cycle of waits)",
    )


def _wait(ranks: list[int]) -> str:
    """``rank 0 waits`` / ``ranks 0-2 wait``."""
    return f"{ranks_text(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"


def _oldest(pending: Mapping[int, Entry], ranks: Iterable[int]) -> int:
    return min(pending[r].created_ns for r in ranks)


def _verdict(
    kind: str,
    culprits: Iterable[int],
    waiting: Iterable[int],
    entry: Entry | None,
    groups: Mapping[Group, frozenset[int]],
    text: str,
    other: str = "",
) -> CollectiveVerdict:
    return CollectiveVerdict(
        verdict=kind,
        ranks=tuple(sorted(culprits)),
        waiting=tuple(sorted(waiting)),
        pg=None if entry is None else entry.pg_label,
        seq=None if entry is None else entry.seq,
        op=None if entry is None else entry.op,
        shapes=[] if entry is None else entry.shapes,
        members=() if entry is None else tuple(sorted(groups.get(entry.group, ()))),
        text=text,
        other=other,
    )


def _mismatch(
    pending: Mapping[int, Entry],
    at: Mapping[tuple[str, str, int], list[int]],
    by_group: Mapping[Group, list[int]],
    records: Mapping[int, Record],
    groups: Mapping[Group, frozenset[int]],
) -> CollectiveVerdict | None:
    # Another op or other sizes at one sequence number of a group: among the
    # ranks pending there, and any other rank whose record has that entry (a
    # rank that died of the mismatch left it in its last words).
    for key, waiters in sorted(at.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        entered = {**_entries_at(records, key), **{r: pending[r] for r in waiters}}
        found = _other_sizes(entered, groups, waiting=waiters)
        if found is not None:
            return found
    # Ranks of one group pending at different sequence numbers.
    for _group, ranks in sorted(by_group.items()):
        seqs = Counter(pending[r].seq for r in ranks)
        if len(seqs) < 2:
            continue
        top_seq = max(seqs.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        majority = [r for r in ranks if pending[r].seq == top_seq]
        odd = sorted(r for r in ranks if r not in majority)
        entry, their = pending[majority[0]], pending[odd[0]]
        return _verdict(
            "mismatch",
            odd,
            majority,
            entry,
            groups,
            f"{ranks_text(odd)} wait in {their.label} while {ranks_text(majority)} wait in "
            f"{entry.label}: their counts of {entry.pg_label}'s collectives differ",
            other=their.label,
        )
    return None


def _entries_at(records: Mapping[int, Record], key: tuple[str, str, int]) -> dict[int, Entry]:
    """Each rank's entry of the collective ``key``, where its record has it."""
    found: dict[int, Entry] = {}
    for rank, rec in records.items():
        for e in rec.entries:
            if e.key == key:
                found[rank] = e
                break
    return found


def _other_sizes(
    entered: Mapping[int, Entry],
    groups: Mapping[Group, frozenset[int]],
    *,
    waiting: Iterable[int] = (),
) -> CollectiveVerdict | None:
    """``mismatch`` where the ranks that entered one collective did so with
    another op or other sizes than the majority (a tie: the lowest rank's
    decides); ``None`` where they agree. The waiting ranks are the majority's
    among ``waiting``, or the whole majority where none of them waits."""
    kinds = Counter(_shape_text(e) for e in entered.values())
    if len(kinds) < 2:
        return None
    ranked = kinds.most_common()
    top = ranked[0][0]
    if ranked[1][1] == ranked[0][1]:
        top = _shape_text(entered[min(entered)])
    majority = sorted(r for r, e in entered.items() if _shape_text(e) == top)
    odd = sorted(r for r in entered if r not in majority)
    entry, their = entered[majority[0]], entered[odd[0]]
    waits = set(waiting)
    blocked = [r for r in majority if r in waits] or majority
    return _verdict(
        "mismatch",
        odd,
        blocked,
        entry,
        groups,
        f"{ranks_text(odd)} entered {their.op} {their.shapes} as #{entry.seq} of "
        f"{entry.pg_label}, where {ranks_text(majority)} entered {entry.op} "
        f"{entry.shapes}: they can never match",
        other=f"{their.op} {their.shapes}",
    )


def _absent(
    key: tuple[str, str, int],
    waiters: list[int],
    absent: list[int],
    pending: Mapping[int, Entry],
    records: Mapping[int, Record],
    views: Mapping[int, RankView],
    groups: Mapping[Group, frozenset[int]],
) -> CollectiveVerdict:
    entry = pending[waiters[0]]
    unseen = RankView(note="not on this host")
    dead = [r for r in absent if views.get(r, unseen).exited]
    busy = [r for r in absent if r not in dead and views.get(r, unseen).busy]
    w = _wait(waiters)
    if dead:
        codes = ", ".join(_exit_text(r, views[r]) for r in dead)
        return _verdict(
            "exited",
            dead,
            waiters,
            entry,
            groups,
            f"{codes} before {entry.label}, in which {w}",
        )
    if busy:
        return _verdict(
            "in_compute",
            busy,
            waiters,
            entry,
            groups,
            f"{ranks_text(busy)} {'computes' if len(busy) == 1 else 'compute'} outside any "
            f"collective while {w} in {entry.label}",
        )
    notes = [
        f"rank {r}: {views.get(r, unseen).note}"
        for r in absent
        if r not in records and views.get(r, unseen).note
    ]
    why = f" ({'; '.join(notes)})" if notes else ""
    return _verdict(
        "missing",
        absent,
        waiters,
        entry,
        groups,
        f"{ranks_text(absent)} never entered {entry.label}, in which {w}{why}",
    )


def _exit_text(rank: int, view: RankView) -> str:
    code = "" if view.exitcode is None else f" (exit code {view.exitcode})"
    return f"rank {rank} exited{code}"


def _after_exit(
    records: Mapping[int, Record],
    views: Mapping[int, RankView],
    groups: Mapping[Group, frozenset[int]],
) -> CollectiveVerdict:
    """Nobody waits, and a rank died: for each group with a dead member, the
    latest collective any member entered (gloo fails it for the others the
    moment a peer exits: it reads done), and its dead members that never
    entered it - by their last record, or for want of one. The most recent such
    collective is the verdict; where every dead member entered what the others
    did, the first to die is named, inside it."""
    dead = sorted((v.exit_order, r) for r, v in views.items() if v.exited)
    if not dead:
        return CollectiveVerdict("none")
    found: list[tuple[int, Entry, list[int], list[int]]] = []
    for group, ranks in groups.items():
        gone = [r for _, r in dead if r in ranks]
        lasts = [e for rec in records.values() if (e := rec.last(group)) is not None]
        if not gone or not lasts:
            continue
        latest = max(lasts, key=lambda e: (e.seq, e.created_ns))
        entered = sorted(r for r, rec in records.items() if _entered(rec, latest))
        missing = [r for r in gone if r not in entered]
        found.append((latest.created_ns if missing else -1, latest, missing, entered))
    if not found:
        first = dead[0][1]
        return _verdict(
            "exited",
            (first,),
            (),
            None,
            groups,
            f"{_exit_text(first, views[first])}; no record says where",
        )
    _, latest, missing, entered = max(found, key=lambda f: (f[0], f[1].created_ns))
    if not missing:  # all of them entered it: with the same op and sizes?
        mismatch = _other_sizes(_entries_at(records, latest.key), groups)
        if mismatch is not None:
            return mismatch
    if missing:
        codes = ", ".join(_exit_text(r, views[r]) for r in missing)
        return _verdict(
            "exited",
            missing,
            entered,
            latest,
            groups,
            f"{codes} before {latest.label}, which {ranks_text(entered)} entered",
        )
    first = dead[0][1]
    return _verdict(
        "exited",
        (first,),
        entered,
        latest,
        groups,
        f"{_exit_text(first, views[first])} in {latest.label}, which {ranks_text(entered)} entered",
    )


def _entered(record: Record, entry: Entry) -> bool:
    return any(e.key == entry.key for e in record.entries)
