"""Console dedup: one line for what several ranks print alike."""

from __future__ import annotations

import asyncio

from ._console import console

__all__ = ["ConsoleDedup", "rank_ranges"]


class ConsoleDedup:
    """Shows a line that several ranks print within ``window`` seconds once.

    ``[trainer0-3,6]:epoch 1 done`` instead of five copies. Lines are held at
    most ``window`` seconds; each rank's own lines keep their order (a line is
    merged into an earlier copy only if that copy comes after the rank's
    previous line). Off by default: ``start_processes(console_dedup=0.05)``.
    """

    def __init__(self, name: str, window: float) -> None:
        self.name = name
        self.window = window
        self._entries: list[tuple[str, str, set[int]]] = []
        self._index: dict[tuple[str, str], int] = {}
        self._last: dict[tuple[int, str], int] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, stream: str, rank: int, lines: list[str]) -> None:
        entries = self._entries
        for line in lines:
            key = (stream, line)
            pos = self._index.get(key)
            last = self._last.get((rank, stream), -1)
            if pos is not None and rank not in entries[pos][2]:
                ranks = entries[pos][2]
                if pos < last:
                    # Merging here would put this line before the rank's
                    # previous one. Move the entry to the end instead - allowed
                    # only if it is still the last line of every rank in it.
                    if any(self._last.get((r, stream)) != pos for r in ranks):
                        pos = None
                    else:
                        entries[pos] = (stream, "", set())  # tombstone
                        pos = len(entries)
                        entries.append((stream, line, ranks))
                        self._index[key] = pos
                        for r in ranks:
                            self._last[(r, stream)] = pos
                if pos is not None:
                    ranks.add(rank)
            else:
                pos = None
            if pos is None:
                pos = len(entries)
                entries.append((stream, line, {rank}))
                self._index[key] = pos
            self._last[(rank, stream)] = pos
        if entries and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window, self.flush)

    def flush(self) -> None:
        """Write everything held now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        entries, self._entries = self._entries, []
        self._index.clear()
        self._last.clear()
        out: list[tuple[str, list[str]]] = []
        for stream, line, ranks in entries:
            if not ranks:
                continue  # moved later
            text = f"[{self.name}{rank_ranges(ranks)}]:{line}\n"
            if out and out[-1][0] == stream:
                out[-1][1].append(text)
            else:
                out.append((stream, [text]))
        for stream, texts in out:
            console().write(stream, "".join(texts))


def rank_ranges(ranks: set[int]) -> str:
    """``{0, 1, 2, 3, 6}`` -> ``"0-3,6"``."""
    ordered = sorted(ranks)
    parts: list[str] = []
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)
