"""``aiolaunch top [LOG_DIR]``: a running job's ranks, live, in the terminal.

Drawn with the standard library's :mod:`curses` - no dependency, ~1 ms to
import, terminfo for whatever terminal (80x24 over ssh, tmux, screen), and
only the cells that changed are sent each second (docs/ARCHITECTURE.md says
why not a TUI library). The layout and the keys are plain functions in
``_top_view.py`` (tested without a terminal); this module only polls the
control socket and paints.

One connection to ``{log_dir}/control.sock``, one ``status`` request per
interval (1 s). ``s`` asks for the selected rank's stacks. When the job ends,
the last screen stays, marked, until ``q``; with the elastic agent, the next
attempt's socket is found again.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from ._live import ControlConnection
from ._top_view import TopState, ended, on_key, screen

if TYPE_CHECKING:
    import curses
    from collections.abc import Sequence

__all__ = ["top_main"]

_STACKS_TIMEOUT = 5.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aiolaunch top",
        description="Live view of a running job's ranks (q or Ctrl-C quits, s shows the "
        "selected rank's stacks, f filters by state).",
    )
    p.add_argument(
        "log_dir",
        nargs="?",
        default=None,
        help="the job's --log-dir (searched up to 3 levels down); default: your one running job",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between two refreshes (default 1; at least 0.1)",
    )
    return p


def top_main(argv: Sequence[str]) -> int:
    """Run ``aiolaunch top``; return the exit status (0, or 1 when no job is found)."""
    args = _parser().parse_args(list(argv))
    if not args.interval >= 0.1:
        print(
            f"aiolaunch top: --interval {args.interval} must be at least 0.1 seconds",
            file=sys.stderr,
        )
        return 2
    conn = ControlConnection(args.log_dir)
    try:
        conn.connect()  # before the screen is taken: errors print plainly
    except (OSError, ValueError) as exc:
        print(f"aiolaunch top: {exc}", file=sys.stderr)
        return 1
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        conn.close()
        print(
            "aiolaunch top: needs a terminal (use `aiolaunch status --json` in scripts)",
            file=sys.stderr,
        )
        return 1
    import curses

    try:
        curses.wrapper(_Top(conn, args.interval).run)
    except KeyboardInterrupt:
        pass  # Ctrl-C quits; curses.wrapper restored the terminal
    finally:
        conn.close()
    return 0


class _Top:
    def __init__(self, conn: ControlConnection, interval: float) -> None:
        self.conn = conn
        self.interval = interval
        self.state = TopState()
        self.snapshot: dict[str, Any] | None = None
        self.ended = False

    def poll(self) -> None:
        try:
            if not self.conn.connected:
                self.conn.connect()
            answer = self.conn.request({"cmd": "status"}, timeout=10.0)
        except (OSError, ValueError) as exc:
            self.conn.close()
            if self.snapshot is not None and not self.ended:
                self.ended = True
                self.state.message = f"job not running since {time.strftime('%H:%M:%S')}"
                self.snapshot = ended(self.snapshot)  # its live ranks are gone now
            elif self.snapshot is None:
                self.state.message = str(exc)
            return
        if not answer.get("ok"):
            self.state.message = f"error: {answer.get('error')}"
            return
        if self.ended:
            self.state.message = "a new attempt of the job is running"
        self.ended = False
        self.snapshot = answer

    def stacks(self) -> None:
        rank = self.state.selected
        try:
            answer = self.conn.request(
                {"cmd": "stacks", "ranks": [rank], "timeout": _STACKS_TIMEOUT},
                timeout=_STACKS_TIMEOUT + 30,
            )
        except (OSError, ValueError) as exc:
            self.conn.close()
            self.state.pager = [f"<no stacks: {exc}>"]
            return
        if not answer.get("ok"):
            self.state.pager = [f"<no stacks: {answer.get('error')}>"]
            return
        text = str(answer.get("stacks", {}).get(str(rank), "<no dump>"))
        files = answer.get("files", {})
        self.state.pager = text.rstrip("\n").splitlines()
        if str(rank) in files:
            self.state.pager += ["", f"(saved as {files[str(rank)]})"]
        self.state.pager_top = 0

    def draw(self, win: curses.window, styles: dict[str, int]) -> None:
        import curses

        height, width = win.getmaxyx()
        clock = time.strftime("%H:%M:%S")
        lines = screen(self.snapshot, self.state, width, height, clock)
        win.erase()
        for y, (text, style) in enumerate(lines):
            # The bottom-right cell cannot be written without scrolling.
            n = width - 1 if y == height - 1 else width
            try:
                win.addnstr(y, 0, text, n, styles.get(style, 0))
            except curses.error:
                pass
        win.refresh()

    def run(self, win: curses.window) -> None:
        import curses

        styles = _styles()
        try:
            curses.curs_set(0)
        except curses.error:
            pass  # a terminal without an invisible cursor
        win.keypad(True)
        next_poll = 0.0
        while True:
            now = time.monotonic()
            if now >= next_poll:
                self.poll()
                next_poll = now + self.interval
            self.draw(win, styles)
            win.timeout(max(1, int((next_poll - time.monotonic()) * 1000)))
            key = win.getch()
            if key == -1:
                continue
            if key == curses.KEY_RESIZE:
                continue
            height, _ = win.getmaxyx()
            action = on_key(self.state, key, self.snapshot, height)
            if action == "quit":
                return
            if action == "stacks" and not self.ended:
                self.state.pager = ["dumping ..."]
                self.state.pager_title = f"stacks of rank {self.state.selected} (q: back)"
                self.draw(win, styles)
                self.stacks()


def _styles() -> dict[str, int]:
    import curses

    styles = {
        "title": curses.A_BOLD,
        "header": curses.A_REVERSE,
        "selected": curses.A_REVERSE,
        "footer": curses.A_REVERSE,
        "dim": curses.A_DIM,
        "alert": curses.A_BOLD,
        "warn": curses.A_BOLD,
        "row": curses.A_NORMAL,
    }
    try:
        if curses.has_colors():
            curses.start_color()
            curses.use_default_colors()
            curses.init_pair(1, curses.COLOR_RED, -1)
            curses.init_pair(2, curses.COLOR_YELLOW, -1)
            styles["alert"] = curses.color_pair(1) | curses.A_BOLD
            styles["warn"] = curses.color_pair(2) | curses.A_BOLD
    except curses.error:
        pass  # monochrome: bold marks only
    return styles
