"""Stragglers: the rank that waits least inside collectives. Pure (no
processes, no clock), unit-tested with hypothesis.

Why stack samples: under data parallelism every rank's step takes as long as
the slowest rank's (the collective makes them wait for it), so step times
cannot name the straggler. Where they wait can: the others spend the
straggler's extra time *inside* the collective, the straggler hardly at all.
So every sampling round (all ranks signalled at the same instant) classifies
each rank's main thread as waiting in a ``torch.distributed`` collective or
not (:func:`waiting_in_collective`), and :class:`StragglerStat` compares each
rank's *wait share* (the fraction of its samples inside a collective) with
its peers' pooled share over the last ``window`` rounds.

A rank is named when, at ``persist`` consecutive rounds, all of these hold:

1. it and its peers have at least ``min_samples`` samples in the window;
2. its peers wait in at least ``min_peers`` (20 %) of their samples: the job
   is communication-bound enough to measure;
3. it waits at most ``ratio`` (half) as often as its peers;
4. a one-sided Fisher exact test rejects "it waits as often as its peers" at
   ``alpha`` = 1e-6;
5. it waited less than its peers in each of the window's four quarters in
   which the peers waited at all (at least three).

Why a balanced run never triggers it: under equal shares (3) alone fails
most of the time and (4) holds with probability below ``alpha`` per test
(the exact test is conservative), which leaves ~1e-3 over an hour of 64
ranks sampled every second even if every test were independent; sliding
windows overlap, so they are far fewer. Samples are not independent when a
step is long compared with the sampling period - a rank that was last in one
slow step is "waiting less" for many samples in a row - and (5) is the guard
against that: chance lateness does not repeat in every quarter, a straggler's
does. The sampler jitters its period (±25 %) so that it cannot lock onto
the step's rhythm. Once named, a rank stays named (one event) until its share
is back to ``clear_ratio`` (three quarters) of its peers'.

The window starts at the first round in which some rank waited (before,
the job is starting: imports, rendezvous). Detection needs about
``min_samples`` to ``window`` rounds: a rank that never
waits among peers waiting half the time is named after ~30 samples, a rank
waiting 4 % vs its peers' 40 % after ~50.

What is a collective: a frame of a ``torch.distributed`` module whose
function is in :data:`COLLECTIVES`. DDP's gradient all-reduce runs inside
``backward()`` in C++ and has no frame of its own: there the explicit
collectives (metrics, barriers, buffer broadcasts) are what is measured.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._dump_text import Frame

__all__ = [
    "COLLECTIVES",
    "StragglerStat",
    "Straggling",
    "fisher_less",
    "starting",
    "waiting_in_collective",
]

#: the autocorrelation is estimated from at most this many ranks' series
_TAU_RANKS = 16
#: Functions of ``torch.distributed`` whose frame means "waiting for peers".
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "_all_gather_base",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
        "wait",
        "wait_tensor",
        "wait_all",
        "_wait_for_work",
    }
)


#: Functions of a starting rank (importing, ``init_process_group``'s rendezvous).
_STARTING = frozenset(
    {
        "init_process_group",
        "_new_process_group_helper",
        "rendezvous",
        "_create_c10d_store",
        "_env_rendezvous_handler",
        "_tcp_rendezvous_handler",
        "_store_based_barrier",
        "_find_and_load",
        "_load_unlocked",
        "exec_module",
    }
)


def starting(frames: list[Frame]) -> bool:
    """Whether a main thread's frames are still starting: importing, or in
    ``torch.distributed``'s rendezvous."""
    return any(func in _STARTING for func, _, _ in frames)


def waiting_in_collective(frames: list[Frame]) -> bool:
    """Whether a main thread's frames (innermost first) wait in a collective."""
    for func, file, _ in frames:
        if func in COLLECTIVES and ("torch/distributed/" in file or "torch\\distributed\\" in file):
            return True
    return False


def _lchoose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_less(k: int, n: int, total_k: int, total_n: int) -> float:
    """One-sided Fisher exact test: the probability of at most ``k`` successes
    in ``n`` draws without replacement from ``total_n`` items holding
    ``total_k`` successes (how unlikely so few waits are, if the rank waited
    like its peers)."""
    lo = max(0, n - (total_n - total_k))
    if k < lo:
        return 0.0
    base = _lchoose(total_n, n)
    p = sum(
        math.exp(_lchoose(total_k, x) + _lchoose(total_n - total_k, n - x) - base)
        for x in range(lo, min(k, total_k) + 1)
    )
    return min(1.0, p)


@dataclass(frozen=True)
class Straggling:
    """A rank named as a straggler: its wait share and its peers'."""

    rank: int
    wait_share: float
    peers_wait_share: float
    samples: int


class StragglerStat:
    """The straggler statistic over a sliding window of sampling rounds."""

    def __init__(
        self,
        *,
        window: int = 120,
        min_samples: int = 30,
        alpha: float = 1e-6,
        ratio: float = 0.5,
        min_peers: float = 0.2,
        persist: int = 3,
        clear_ratio: float = 0.75,
    ) -> None:
        self.window, self.min_samples, self.alpha = window, min_samples, alpha
        self.ratio, self.min_peers, self.persist = ratio, min_peers, persist
        self.clear_ratio = clear_ratio
        self._rounds: deque[dict[int, bool]] = deque()
        self._k: dict[int, int] = {}
        self._n: dict[int, int] = {}
        self._streak: dict[int, int] = {}
        #: ranks named now (until they clear)
        self.named: dict[int, Straggling] = {}

    def forget(self, rank: int) -> None:
        """A rank exited or restarted: drop its samples (its peers keep theirs)."""
        for r in self._rounds:
            r.pop(rank, None)
        self._k.pop(rank, None)
        self._n.pop(rank, None)
        self._streak.pop(rank, None)
        self.named.pop(rank, None)

    def add(self, waits: Mapping[int, bool]) -> list[Straggling]:
        """One round: ``{rank: waiting in a collective}`` for each rank sampled.
        Returns the ranks named at this round (each once per straggling spell)."""
        if not self._rounds and not any(waits.values()):
            return []  # no collective yet (the job is starting): nothing to compare
        self._rounds.append(dict(waits))
        for rank, w in waits.items():
            self._k[rank] = self._k.get(rank, 0) + w
            self._n[rank] = self._n.get(rank, 0) + 1
        if len(self._rounds) > self.window:
            for rank, w in self._rounds.popleft().items():
                self._k[rank] -= w
                self._n[rank] -= 1
        total_k, total_n = sum(self._k.values()), sum(self._n.values())
        out: list[Straggling] = []
        tau: float | None = None
        for rank in sorted(self._n):
            k, n = self._k[rank], self._n[rank]
            pk, pn = total_k - k, total_n - n
            if n < self.min_samples or pn < self.min_samples:
                self._streak[rank] = 0
                continue
            share, peers = k / n, pk / pn
            if rank in self.named and share >= self.clear_ratio * peers:
                del self.named[rank]
            if (
                peers < self.min_peers
                or share > self.ratio * peers
                or not self._lowest(rank, share)
                or not self._steady(rank)
            ):
                self._streak[rank] = 0
                continue
            if tau is None:
                tau = self._autocorrelation()
            f = 1 / tau  # an independent sample per tau samples
            p = fisher_less(round(k * f), round(n * f), round(total_k * f), round(total_n * f))
            # One or two peers: a fluke of a few steps cannot be told from
            # their spread (there is none to see): a stricter bound.
            if p > (self.alpha if len(self._n) > 3 else self.alpha / 100):
                self._streak[rank] = 0
                continue
            self._streak[rank] = self._streak.get(rank, 0) + 1
            if self._streak[rank] >= self.persist and rank not in self.named:
                s = Straggling(rank, round(share, 3), round(peers, 3), n)
                self.named[rank] = s
                out.append(s)
        return out

    def _autocorrelation(self) -> float:
        # How many samples are worth one independent one: the integrated
        # autocorrelation time 1 + 2 * sum(rho_k) of the ranks' series over
        # the window (pooled: a rank that hardly ever waits has no rhythm of
        # its own), summed while rho_k stays positive. Samples within one
        # long step repeat each other; so do steps' random wait amounts.
        series: dict[int, list[float]] = {}
        for r in self._rounds:
            for rank, w in r.items():
                series.setdefault(rank, []).append(float(w))
        centred = []
        var = 0.0
        for xs in list(series.values())[:_TAU_RANKS]:
            m = sum(xs) / len(xs)
            c = [x - m for x in xs]
            var += sum(x * x for x in c)
            centred.append(c)
        if var <= 0:
            return 1.0
        tau = 1.0
        for lag in range(1, len(self._rounds) // 4):
            cov = sum(sum(a * b for a, b in zip(c[:-lag], c[lag:], strict=True)) for c in centred)
            if cov <= 0:
                break
            tau += 2 * cov / var
        return tau

    def _lowest(self, rank: int, share: float) -> bool:
        # It waits less than every one of its peers, each on its own.
        return all(self._k[r] / self._n[r] > share for r in self._n if r != rank and self._n[r])

    def _steady(self, rank: int) -> bool:
        # Condition 5: less waiting than the peers in each quarter of the
        # window where the peers waited at all (a quarter in which nobody
        # waits - the job was starting, say - says nothing); three at least.
        rounds = list(self._rounds)
        size = len(rounds) // 4
        informative = 0
        for q in range(4 if size else 0):
            k = n = pk = pn = 0
            for r in rounds[q * size : (q + 1) * size]:
                for other, w in r.items():
                    if other == rank:
                        k, n = k + w, n + 1
                    else:
                        pk, pn = pk + w, pn + 1
            if pk == 0:
                continue
            if n == 0 or k / n >= pk / pn:
                return False
            informative += 1
        return informative >= 3
