"""What ``aiolaunch top`` shows, as plain data: the screen's lines and the keys.

No terminal here (``_top.py`` draws these lines with curses), so the layout and
the key bindings are tested without one: :func:`screen` turns a status
snapshot (the control socket's ``status`` answer) and a :class:`TopState` into
at most ``height`` lines of at most ``width`` characters, each with a style
name; :func:`on_key` applies one key to the state.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._signals._names import describe_signal

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "GONE",
    "TopState",
    "ended",
    "fmt_age",
    "fmt_bytes",
    "on_key",
    "pager_lines",
    "screen",
]

#: key codes (curses' values, so the driver passes them through unchanged)
KEY_DOWN, KEY_UP, KEY_LEFT, KEY_HOME, KEY_END = 258, 259, 260, 262, 360
KEY_NPAGE, KEY_PPAGE, KEY_ENTER, KEY_BACKSPACE = 338, 339, 343, 263
ESC = 27
#: the state of a rank that was live when its job ended (how it ended is not known here)
GONE = "gone"
_STATE_ORDER = (
    "stalled",
    "straggling",
    "running",
    "sleeping",
    "disk-sleep",
    "stopped",
    "restarting",
    "starting",
    GONE,
    "exited",
)
_HEAD_ROWS = 3  # title, subtitle, column header
_FOOT_ROWS = 1
Line = tuple[str, str]  # (text, style): title header row selected alert warn dim blank footer


@dataclass
class TopState:
    """What the user chose: filter, selection, scroll, the stacks pager."""

    #: show only ranks in this state (``None``: all)
    filter: str | None = None
    #: the selected rank (``None``: the first visible one)
    selected: int | None = None
    #: index of the first visible row
    top: int = 0
    #: the stacks shown instead of the table, with their title
    pager: list[str] | None = None
    pager_title: str = ""
    pager_top: int = 0
    #: a one-line notice under the title (an error, "job ended", ...)
    message: str = ""
    #: the states seen so far, for the filter's cycle
    seen_states: set[str] = field(default_factory=set)


def ended(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """``snapshot`` once its job ended (the control socket is gone): the ranks
    it showed live are :data:`GONE`, without live figures (CPU %, output
    age, step rate); those it showed exited stay as they were."""
    workers = []
    for w in snapshot.get("workers", []):
        if w.get("state") != "exited":
            w = {**w, "state": GONE, "cpu_percent": None, "last_output_s": None}
            w["step_rate"] = None
        workers.append(w)
    return {**snapshot, "workers": workers}


def _cpu(w: Mapping[str, Any]) -> str:
    cpu = w.get("cpu_percent", 0.0)
    return "-" if cpu is None else f"{cpu:.1f}"


def fmt_age(seconds: float | None) -> str:
    """``3.2s``, ``42s``, ``12m05s``, ``3h02m``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 100:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_bytes(n: int | None) -> str:
    """Compact sizes: ``812K``, ``64M``, ``1.2G``."""
    if not n:
        return "-"
    value = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1000 or unit == "T":
            return f"{value:.1f}{unit}" if value < 10 and unit != "B" else f"{value:.0f}{unit}"
        value /= 1024
    return str(n)  # pragma: no cover


def _marks(w: Mapping[str, Any]) -> str:
    marks: list[str] = []
    if w.get("state") == "stalled":
        marks.append("STALLED")
    elif w.get("stalls"):
        marks.append(f"stalled x{w['stalls']}")
    if w.get("straggling"):
        late = w.get("lateness_s")
        marks.append("STRAGGLING" if late is None else f"STRAGGLING +{late:.3f}s")
    if w.get("collective"):
        marks.append(str(w["collective"]))
    if w.get("attached"):
        marks.append("ATTACHED")
    code = w.get("exitcode")
    if code is not None:
        marks.append(f"killed by {describe_signal(-code)}" if code < 0 else f"exit {code}")
    return " ".join(marks)


def _rate(w: Mapping[str, Any]) -> str:
    rate = w.get("step_rate")
    if rate is None:
        return "-"
    return f"{rate:.2f}" if rate < 100 else f"{rate:.0f}"


_Column = tuple[str, int, bool, "Callable[[Mapping[str, Any]], str]"]
_COLUMNS: tuple[_Column, ...] = (
    ("RANK", 4, True, lambda w: str(w["rank"])),
    ("STATE", 10, False, lambda w: str(w.get("state", "?"))),
    ("PID", 7, True, lambda w: str(w.get("pid") or "-")),
    ("RST", 3, True, lambda w: str(w.get("restarts", 0))),
    ("OUTPUT", 7, True, lambda w: fmt_age(w.get("last_output_s"))),
    ("CPU%", 6, True, _cpu),
    ("RSS", 6, True, lambda w: fmt_bytes(w.get("rss"))),
    ("STEP/s", 7, True, _rate),
)


def _columns(workers: Sequence[Mapping[str, Any]], width: int) -> list[_Column]:
    cols = [
        c
        for c in _COLUMNS
        if c[0] != "STEP/s" or any(w.get("step_rate") is not None for w in workers)
    ]
    # Narrow terminals lose columns from the right (MARKS takes what is left).
    while len(cols) > 2 and sum(c[1] + 1 for c in cols) > width:
        cols.pop()
    return cols


def _cell(text: str, width: int, right: bool) -> str:
    text = text[:width]
    return text.rjust(width) if right else text.ljust(width)


def _row(cols: Sequence[_Column], values: Sequence[str], marks: str, width: int) -> str:
    text = " ".join(_cell(v, c[1], c[2]) for c, v in zip(cols, values, strict=True))
    if marks:
        text += " " + marks
    return text[:width].ljust(width)


def visible(workers: Sequence[Mapping[str, Any]], state: TopState) -> list[Mapping[str, Any]]:
    """The ranks shown: those in the filter's state (all without a filter)."""
    if state.filter is None:
        return list(workers)
    return [w for w in workers if w.get("state") == state.filter]


def _style(w: Mapping[str, Any]) -> str:
    code = w.get("exitcode")
    if w.get("state") == "stalled" or (code is not None and code != 0):
        return "alert"
    if w.get("straggling"):
        return "warn"
    if w.get("state") in ("exited", GONE):
        return "dim"
    return "row"


def _summary(workers: Sequence[Mapping[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for w in workers:
        counts[str(w.get("state"))] = counts.get(str(w.get("state")), 0) + 1
    order = sorted(counts, key=_state_key)
    return ", ".join(f"{counts[s]} {s}" for s in order)


def screen(
    snapshot: Mapping[str, Any] | None, state: TopState, width: int, height: int, clock: str = ""
) -> list[Line]:
    """The lines to draw: at most ``height``, each exactly ``width`` characters."""
    width, height = max(width, 1), max(height, 1)
    workers: Sequence[Mapping[str, Any]] = (snapshot or {}).get("workers", [])
    for w in workers:
        state.seen_states.add(str(w.get("state")))
    name = (snapshot or {}).get("name", "?")
    title = f"aiolaunch top - {name}: {len(workers)} ranks ({_summary(workers)})"
    if clock:
        title = title[: max(0, width - len(clock) - 1)].ljust(max(0, width - len(clock))) + clock
    sub = f"filter: {state.filter or 'all'}  "
    for key, section in sorted((snapshot or {}).items()):  # the job's sections (its hosts)
        if isinstance(section, dict) and isinstance(section.get("summary"), str):
            sub = f"{key}: {section['summary']}  |  {sub}"
    if state.message:
        sub = f"{state.message}  |  {sub}"
    log_dir = str((snapshot or {}).get("log_dir", ""))
    room = width - len(sub)
    if len(log_dir) > room:  # the end of a path says more than its start
        log_dir = "..." + log_dir[len(log_dir) - room + 3 :] if room > 3 else ""
    sub += log_dir
    lines: list[Line] = [(title[:width].ljust(width), "title"), (sub[:width].ljust(width), "dim")]
    if state.pager is not None:
        return _pager(lines, state, width, height)
    rows = visible(workers, state)
    cols = _columns(workers, width)
    lines.append((_row(cols, [c[0] for c in cols], "MARKS", width), "header"))
    room = max(0, height - _HEAD_ROWS - _FOOT_ROWS)
    ranks = [w["rank"] for w in rows]
    if state.selected not in ranks:
        state.selected = ranks[0] if ranks else None
    if ranks and state.selected is not None:
        i = ranks.index(state.selected)
        state.top = min(max(state.top, i - room + 1), i) if room else 0
    state.top = max(0, min(state.top, max(0, len(rows) - room)))
    for w in rows[state.top : state.top + room]:
        text = _row(cols, [c[3](w) for c in cols], _marks(w), width)
        lines.append((text, "selected" if w["rank"] == state.selected else _style(w)))
    if not rows:
        lines.append((f"(no rank is {state.filter})"[:width].ljust(width), "dim"))
    more = f"  [{state.top + 1}-{min(len(rows), state.top + room)} of {len(rows)}]"
    foot = "q quit  Up/Dn select  s stacks  f filter  a all" + (more if len(rows) > room else "")
    lines = lines[: height - _FOOT_ROWS]
    lines.extend([(" " * width, "blank")] * (height - _FOOT_ROWS - len(lines)))
    lines.append((foot[:width].ljust(width), "footer"))
    return lines[:height]


_FRAME = re.compile(r'^(\s*)File "(.*)", line (\d+) in (.*)$')


def pager_lines(text: list[str], width: int) -> list[str]:
    """Stack dumps for a narrow screen: a frame's function first, then where it is;
    what is still too long wraps (continuations indented)."""
    out: list[str] = []
    for raw in text:
        line = raw.expandtabs()
        m = _FRAME.match(line)
        if m:
            indent, path, lineno, func = m.groups()
            folder = os.path.dirname(path)
            line = f"{indent}{func}  {os.path.basename(path)}:{lineno}"
            line += f"  ({folder})" if folder else ""
        first = True
        while True:
            room = width if first else max(1, width - 4)
            chunk, line = line[:room], line[room:]
            out.append(chunk if first else "    " + chunk)
            first = False
            if not line:
                break
    return out


def _pager(lines: list[Line], state: TopState, width: int, height: int) -> list[Line]:
    body = pager_lines(state.pager or [], width)
    room = max(0, height - _HEAD_ROWS - _FOOT_ROWS)
    state.pager_top = max(0, min(state.pager_top, max(0, len(body) - room)))
    lines.append((state.pager_title[:width].ljust(width), "header"))
    for text in body[state.pager_top : state.pager_top + room]:
        lines.append((text[:width].ljust(width), "row"))
    lines = lines[: height - _FOOT_ROWS]
    lines.extend([(" " * width, "blank")] * (height - _FOOT_ROWS - len(lines)))
    end = min(len(body), state.pager_top + room)
    foot = f"q back  Up/Dn PgUp/PgDn scroll  [{min(state.pager_top + 1, end)}-{end} of {len(body)}]"
    lines.append((foot[:width].ljust(width), "footer"))
    return lines[:height]


def on_key(
    state: TopState, key: int, snapshot: Mapping[str, Any] | None, height: int
) -> str | None:
    """Apply ``key``; returns ``"quit"``, ``"stacks"`` (show the selected rank's) or ``None``."""
    room = max(1, height - _HEAD_ROWS - _FOOT_ROWS)
    if state.pager is not None:
        steps = {
            KEY_DOWN: 1,
            ord("j"): 1,
            KEY_UP: -1,
            ord("k"): -1,
            KEY_NPAGE: room,
            ord(" "): room,
            KEY_PPAGE: -room,
        }
        if key in steps:
            state.pager_top = max(0, state.pager_top + steps[key])
        elif key in (ord("q"), ord("Q"), ESC, KEY_LEFT, KEY_BACKSPACE, ord("s")):
            state.pager = None
        elif key in (KEY_HOME, ord("g")):
            state.pager_top = 0
        elif key in (KEY_END, ord("G")):
            state.pager_top = len(state.pager)
        return None
    if key in (ord("q"), ord("Q")):
        return "quit"
    rows = [w["rank"] for w in visible((snapshot or {}).get("workers", []), state)]
    if key in (ord("s"), ord("\n"), ord("\r"), KEY_ENTER):
        return "stacks" if state.selected in rows else None
    if key == ord("f"):
        cycle: list[str | None] = [None, *sorted(state.seen_states, key=_state_key)]
        i = cycle.index(state.filter) if state.filter in cycle else 0
        state.filter = cycle[(i + 1) % len(cycle)]
        state.top = 0
        return None
    if key == ord("a"):
        state.filter, state.top = None, 0
        return None
    moves = {
        KEY_DOWN: 1,
        ord("j"): 1,
        KEY_UP: -1,
        ord("k"): -1,
        KEY_NPAGE: room,
        KEY_PPAGE: -room,
        KEY_HOME: -len(rows),
        ord("g"): -len(rows),
        KEY_END: len(rows),
        ord("G"): len(rows),
    }
    if key in moves and rows:
        i = rows.index(state.selected) if state.selected in rows else 0
        state.selected = rows[max(0, min(len(rows) - 1, i + moves[key]))]
    return None


def _state_key(s: str) -> tuple[int, str]:
    return (_STATE_ORDER.index(s) if s in _STATE_ORDER else 99, s)
