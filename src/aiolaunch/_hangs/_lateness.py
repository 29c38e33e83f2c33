"""Stragglers by lateness: who arrives last at the collectives, and by how much. Pure.

Every collective a rank enters is in its record with the time it called it
(``time_created_ns``). The same collective - one ``(group, sequence
number)`` - on every member gives each member's *lateness*: its arrival
minus the earliest member's. Under data parallelism the peers of a slow rank
wait for it in every step, wherever the slowness is - the data loader, the
forward pass, *inside* DDP's backward (whose gradient all-reduces have no
Python frame to sample), the optimizer - and its lateness says how long.

:class:`LatenessStat` collects arrivals pull after pull (a collective counts
once every member's arrival is known) and keeps each rank's lateness over a
sliding window (the last :attr:`~LatenessStat.window_s` seconds, at most
:attr:`~LatenessStat.max_collectives`). A rank is named when, at
``persist`` consecutive pulls with new collectives, all of these hold:

1. at least ``min_collectives`` collectives in the window;
2. it was the last to arrive at ``last_share`` (three quarters) of them;
3. its median lateness is at least ``min_lateness`` (10 ms: below that, one
   host's scheduling noise) and ``ratio`` (1.5) times the highest third
   quartile of a peer's lateness: under balanced jitter every rank is late
   now and then by the same amounts, so one rank's *median* half as much
   again above every other rank's *third quartile* does not happen by
   chance (a step's bucket all-reduces repeat one arrival order: the
   condition is on magnitudes, not on counts of collectives that are not
   independent), while a loaded host's long tail of late arrivals (a rank
   not scheduled in time) leaves the quartile where it is.

Once named, a rank stays named (one event) until its median lateness falls
under ``clear`` (half) of what it was named with, or it is last at under
half the collectives. Its lateness, median over the window, is what
``status()`` shows for every rank.

Clocks: the arrivals of ranks on one host come from one clock. The watchdog
sees the ranks of its own host only, so lateness is measured among them;
across hosts (each agent its own host's ranks) no clock is compared - a host
whose ranks are all late together is not seen by its own agent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

__all__ = ["Key", "Late", "LatenessStat"]

#: One collective on every member: ``(backend, process group, sequence number)``.
Key = tuple[str, str, int]


@dataclass(frozen=True)
class Late:
    """A rank named a straggler by its lateness.

    :param lateness_s: its median lateness over the window.
    :param last_share: the fraction of the window's collectives at which it
        arrived last.
    :param peers_last_share: the same for its peers, on average.
    :param collectives: the window's collectives it took part in.
    """

    rank: int
    lateness_s: float
    last_share: float
    peers_last_share: float
    collectives: int


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


class LatenessStat:
    """The lateness statistic over a sliding window of collectives (see the
    module docstring). Ranks are whatever the caller numbers them by."""

    def __init__(
        self,
        *,
        window_s: float = 60.0,
        max_collectives: int = 400,
        min_collectives: int = 20,
        min_lateness: float = 0.01,
        ratio: float = 1.5,
        last_share: float = 0.75,
        persist: int = 3,
        clear: float = 0.5,
        keep_pulls: int = 20,
    ) -> None:
        self.window_s, self.max_collectives = window_s, max_collectives
        self.min_collectives, self.min_lateness, self.ratio = min_collectives, min_lateness, ratio
        self.last_share, self.persist, self.clear = last_share, persist, clear
        self.keep_pulls = keep_pulls
        #: arrivals of collectives not every member reported yet, with the pull they started at
        self._open: dict[Key, tuple[int, dict[int, int]]] = {}
        self._counted: set[Key] = set()
        self._counted_order: deque[Key] = deque()
        #: (when counted, {rank: lateness in s}, the last rank)
        self._window: deque[tuple[float, dict[int, float], int]] = deque()
        self._pulls = 0
        self._streak: dict[int, int] = {}
        #: ranks named now (until they clear)
        self.named: dict[int, Late] = {}

    def forget(self, rank: int) -> None:
        """A rank exited or restarted: drop its arrivals (its peers keep theirs)."""
        for _, arrivals in self._open.values():
            arrivals.pop(rank, None)
        for _, late, _ in self._window:
            late.pop(rank, None)
        self._streak.pop(rank, None)
        self.named.pop(rank, None)

    def lateness(self, rank: int) -> float | None:
        """``rank``'s median lateness over the window (s); ``None`` before any."""
        values = [late[rank] for _, late, _ in self._window if rank in late]
        return round(_median(values), 4) if values else None

    def add(
        self,
        arrivals: Mapping[Key, Mapping[int, int]],
        expected: Mapping[Key, Collection[int]],
        now: float,
    ) -> list[Late]:
        """One pull: ``{collective: {rank: arrival, ns}}`` as the records show
        them, ``{collective: the ranks that take part}``, at ``now`` (s).
        Returns the ranks named at this pull (each once per straggling spell)."""
        self._pulls += 1
        fresh = 0
        for key, seen in arrivals.items():
            if key in self._counted:
                continue
            want = set(expected.get(key, ()))
            if len(want) < 2:
                continue
            _, got = self._open.setdefault(key, (self._pulls, {}))
            got.update((r, t) for r, t in seen.items() if r in want)
            if set(got) >= want:
                del self._open[key]
                self._count(key, got, now)
                fresh += 1
        for key in [k for k, (p, _) in self._open.items() if self._pulls - p > self.keep_pulls]:
            del self._open[key]  # a member's record moved on without it: never complete
        while self._window and (
            now - self._window[0][0] > self.window_s or len(self._window) > self.max_collectives
        ):
            self._window.popleft()
        return self._judge() if fresh else []

    def _count(self, key: Key, got: Mapping[int, int], now: float) -> None:
        first = min(got.values())
        late = {r: (t - first) / 1e9 for r, t in got.items()}
        last = max(late, key=lambda r: (late[r], -r))
        self._window.append((now, late, last))
        self._counted.add(key)
        self._counted_order.append(key)
        while len(self._counted_order) > 4 * self.max_collectives:
            self._counted.discard(self._counted_order.popleft())

    def _judge(self) -> list[Late]:
        per: dict[int, list[float]] = {}
        lasts: dict[int, int] = {}
        for _, late, last in self._window:
            for r, v in late.items():
                per.setdefault(r, []).append(v)
            if late[last] > 0:
                lasts[last] = lasts.get(last, 0) + 1
        shares = {r: lasts.get(r, 0) / len(vs) for r, vs in per.items()}
        q3 = sorted(((_quantile(vs, 0.75), r) for r, vs in per.items()), reverse=True)
        out: list[Late] = []
        for rank in sorted(per):
            values = per[rank]
            n = len(values)
            median = _median(values)
            share = shares[rank]
            peers = [r for r in per if r != rank]
            peers_share = sum(shares[r] for r in peers) / len(peers) if peers else 0.0
            # the highest third quartile among its peers (the top one, unless it is its own)
            peers_q3 = next((q for q, r in q3 if r != rank), 0.0)
            named = self.named.get(rank)
            if named is not None and (median < self.clear * named.lateness_s or share < 0.5):
                del self.named[rank]
            if (
                n < self.min_collectives
                or not peers
                or share < self.last_share
                or median < self.min_lateness
                or median < self.ratio * peers_q3
            ):
                self._streak[rank] = 0
                continue
            self._streak[rank] = self._streak.get(rank, 0) + 1
            if self._streak[rank] >= self.persist and rank not in self.named:
                found = Late(rank, round(median, 4), round(share, 3), round(peers_share, 3), n)
                self.named[rank] = found
                out.append(found)
        return out
