"""A rank's collective record as torch's Flight Recorder dumps it: parsed, grouped, written back.

Pure functions of the dumps (no processes, no clock), unit-tested on dumps
taken from real gloo ranks.

A dump (``fr_trace_json``; NCCL's ``dump_nccl_trace_json`` has the same
shape) is ``{"version", "pg_config", "pg_status", "entries": [...]}``, each
entry one collective a rank entered, in the order it entered them: its
process group as ``[name, desc]`` (names count creation order and are the
same on every rank; ``pg_id`` and ``pg_status``'s keys are not), its
``collective_seq_id`` (per group, from 1), ``profiling_name``
(``"gloo:all_reduce"``), sizes, dtypes, ``time_created_ns`` (the wall clock
when the rank called it) and ``retired`` (done: returned, or failed because
a peer went away). :class:`Record` keeps what the verdicts and the lateness
need; a record's *pending* entry is its oldest one not retired (gloo retires
an entry a moment after the call returns; NCCL once the GPU finished it).

Torch 2.13's gloo dump keys ``pg_config`` by ``""`` with no name and no
members, so torch's own analyzer (``torchfrtrace``) cannot read a folder of
them (``KeyError``, and world size 0 once re-keyed). :func:`torch_dump` fills
it in from :func:`members`: every rank of the world for the default group,
and for a subgroup the ranks whose records mention it - a member that never
entered one of its collectives cannot be known from gloo's record.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = [
    "DEFAULT_PG_DESC",
    "DUMP_PREFIX",
    "Entry",
    "Group",
    "Record",
    "members",
    "parse_record",
    "torch_dump",
    "write_dumps",
]

#: The description torch gives the default process group.
DEFAULT_PG_DESC = "default_pg"
#: The file name of rank ``r``'s dump in a dumps folder is this + ``r``
#: (``torchfrtrace`` finds the common prefix itself).
DUMP_PREFIX = "rank_"

#: ``(backend, process group name)``: a group's collectives have one
#: sequence; a process group with two backends (gloo for CPU tensors, NCCL
#: for GPU ones) counts each backend's apart.
Group = tuple[str, str]


class Entry(NamedTuple):
    """One collective a rank entered (a named tuple: a pull makes 64 per rank,
    and only the few a verdict names need their sizes: read from ``raw``).

    :param pg: the process group's name (``"0"``, ``"1"``...).
    :param desc: its description (``"default_pg"``, ``new_group(group_desc=)``).
    :param backend: ``"gloo"``, ``"nccl"``...
    :param seq: ``collective_seq_id`` (``p2p_seq_id`` for a send or recv).
    :param op: the operation (``"all_reduce"``, ``"send 0->1"``...).
    :param created_ns: when the rank called it (the wall clock, ns).
    :param done: retired (returned, or failed) or completed.
    :param p2p: a send or recv (paired, not every member's).
    :param raw: the entry as torch dumped it.
    """

    pg: str
    desc: str
    backend: str
    seq: int
    op: str
    created_ns: int = 0
    done: bool = False
    p2p: bool = False
    raw: Mapping[str, Any] = {}

    @property
    def group(self) -> Group:
        """The sequence this entry belongs to."""
        return (self.backend, self.pg)

    @property
    def key(self) -> tuple[str, str, int]:
        """The same collective on every member: its group and sequence number."""
        return (self.backend, self.pg, self.seq)

    @property
    def pg_label(self) -> str:
        """How messages name its process group: the description, else the name."""
        return self.desc or f"pg {self.pg}"

    @property
    def label(self) -> str:
        """``all_reduce #5 of default_pg``."""
        return f"{self.op} #{self.seq} of {self.pg_label}"

    @property
    def shapes(self) -> list[list[int]]:
        """The input tensors' sizes, as JSON lists (``[]`` where torch wrote none)."""
        sizes = self.raw.get("input_sizes")
        if not isinstance(sizes, list):
            return []
        return [list(s) for s in sizes if isinstance(s, list)]


@dataclass(frozen=True)
class Record:
    """One rank's record, as pulled.

    :param rank: the rank's global rank.
    :param entries: every entry, in the order the rank entered them.
    :param dumps: torch's dumps as parsed (gloo's first; NCCL's after, if any),
        for the files.
    """

    rank: int
    entries: tuple[Entry, ...]
    dumps: tuple[dict[str, Any], ...] = field(default=(), compare=False, repr=False)

    def pending(self) -> Entry | None:
        """The oldest collective (not a send or recv) the rank entered and that
        is not done: where it waits; ``None`` if none."""
        for e in self.entries:
            if not e.done and not e.p2p:
                return e
        return None

    def in_flight(self) -> bool:
        """Whether any entry is not done (a send or recv too)."""
        return any(not e.done for e in self.entries)

    def last(self, group: Group) -> Entry | None:
        """The latest entry of ``group``, or ``None``."""
        for i in range(len(self.entries) - 1, -1, -1):
            if self.entries[i].group == group:
                return self.entries[i]
        return None

    def groups(self) -> set[Group]:
        """The groups its entries belong to."""
        return {e.group for e in self.entries}


def _entry(raw: Mapping[str, Any]) -> Entry | None:
    try:
        pg = raw["process_group"]
        backend, _, op = raw["profiling_name"].partition(":")
        if not op:  # no backend prefix
            backend, op = "", backend
        p2p = raw.get("is_p2p") is True
        return Entry(
            str(pg[0]),
            str(pg[1]),
            backend,
            int(raw["p2p_seq_id"] if p2p else raw["collective_seq_id"]),
            op,
            int(raw.get("time_created_ns") or 0),
            raw.get("retired") is True or raw.get("state") == "completed",
            p2p,
            raw,
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None


def parse_record(rank: int, raws: Iterable[bytes]) -> Record:
    """``rank``'s record from its dumps (JSON bytes: gloo's, then NCCL's).

    :raises ValueError: a dump that is not a JSON object.
    """
    dumps: list[dict[str, Any]] = []
    entries: list[Entry] = []
    for raw in raws:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("a Flight Recorder dump is a JSON object")
        dumps.append(data)
        for item in data.get("entries") or ():
            if isinstance(item, dict):
                e = _entry(item)
                if e is not None:
                    entries.append(e)
    return Record(rank, tuple(entries), tuple(dumps))


def _config_ranks(records: Iterable[Record]) -> dict[str, frozenset[int]]:
    # A dump whose pg_config names a group and its members (NCCL's does).
    out: dict[str, frozenset[int]] = {}
    for rec in records:
        for dump in rec.dumps:
            config = dump.get("pg_config")
            if not isinstance(config, dict):
                continue
            for name, cfg in config.items():
                if not name or not isinstance(cfg, dict):
                    continue
                try:
                    ranks = ast.literal_eval(str(cfg.get("ranks", "[]")))
                except (ValueError, SyntaxError):
                    continue
                if isinstance(ranks, list) and ranks:
                    out[str(name)] = frozenset(int(r) for r in ranks)
    return out


def members(records: Mapping[int, Record], world_size: int) -> dict[Group, frozenset[int]]:
    """Every group's members (global ranks), for the groups the records mention.

    The default group (described ``default_pg``): ranks ``0..world_size-1``;
    a group whose members a dump names (NCCL's ``pg_config``): those; any
    other: the ranks whose records mention it.
    """
    seen: dict[Group, set[int]] = {}
    descs: dict[Group, str] = {}
    for rank, rec in records.items():
        for e in rec.entries:
            seen.setdefault(e.group, set()).add(rank)
            descs.setdefault(e.group, e.desc)
    named = _config_ranks(records.values())
    out: dict[Group, frozenset[int]] = {}
    for group, ranks in seen.items():
        if descs.get(group) == DEFAULT_PG_DESC:
            out[group] = frozenset(range(world_size)) | frozenset(ranks)
        elif group[1] in named:
            out[group] = named[group[1]] | frozenset(ranks)
        else:
            out[group] = frozenset(ranks)
    return out


def torch_dump(record: Record, groups: Mapping[Group, frozenset[int]]) -> dict[str, Any]:
    """``record`` as one dump in torch's format, its ``pg_config`` filled in
    with every group it mentions (``torchfrtrace`` reads a folder of these).

    The entries of every dump (gloo's, NCCL's) are kept as torch wrote them.
    """
    base: dict[str, Any] = dict(record.dumps[0]) if record.dumps else {"version": "2.10"}
    entries: list[Any] = []
    for dump in record.dumps:
        entries.extend(dump.get("entries") or ())
    config: dict[str, dict[str, str]] = {}
    for e in record.entries:
        if e.pg in config:
            continue
        ranks = sorted(groups.get(e.group, frozenset({record.rank})))
        config[e.pg] = {"name": e.pg, "desc": e.desc, "ranks": str(ranks)}
    base["entries"] = entries
    base["pg_config"] = config
    return base


def write_dumps(
    folder: str, records: Mapping[int, Record], groups: Mapping[Group, frozenset[int]]
) -> None:
    """One pickle per rank in ``folder`` (made here), as torch writes its own
    dumps: ``torchfrtrace FOLDER`` reads them.

    :raises OSError: the folder or a file cannot be written.
    """
    os.makedirs(folder, exist_ok=True)
    for rank, rec in sorted(records.items()):
        path = os.path.join(folder, f"{DUMP_PREFIX}{rank}")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(torch_dump(rec, groups), f)
        os.replace(path + ".tmp", path)
