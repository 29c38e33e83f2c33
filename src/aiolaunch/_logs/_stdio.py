"""Writing text to the console streams: the one place that touches them.

``sys.stdout``/``sys.stderr`` are looked up at each write (a notebook swaps
them per cell). A hook (:func:`set_console_hook`) or a parent's tqdm bar get
the text through their own API; the process's own fd 1/2 is written with
``os.write`` (every byte, see :func:`_write_fd`); any other stream through
its ``write``. Called on the console thread only (``_console``).
"""

from __future__ import annotations

import io
import os
import select
import sys
from collections.abc import Callable
from typing import TextIO

__all__ = ["ConsoleHook", "console_stream", "set_console_hook", "write_text"]

#: ``hook(stream, text)`` must write ``text`` to ``stream``.
ConsoleHook = Callable[[TextIO, str], None]
_hook: ConsoleHook | None = None


def set_console_hook(hook: ConsoleHook | None) -> ConsoleHook | None:
    """Route every console write of aiolaunch through ``hook(stream, text)``.

    Use it to keep a progress display of your own intact: clear it, write,
    redraw. ``None`` restores the default (which already handles tqdm).
    Returns the previous hook. Called on aiolaunch's console thread.
    """
    if hook is not None and not callable(hook):
        raise TypeError(
            f"set_console_hook({hook!r}) needs a callable hook(stream, text), or None for "
            "the default"
        )
    global _hook
    previous, _hook = _hook, hook
    return previous


def console_stream(name: str) -> TextIO:
    # Looked up at write time: a notebook swaps sys.stdout per cell.
    return sys.stdout if name == "stdout" else sys.stderr


def _tqdm_write_mode(stream: TextIO) -> object | None:
    tqdm_mod = sys.modules.get("tqdm")
    if tqdm_mod is None:
        return None
    cls = getattr(tqdm_mod, "tqdm", None)
    instances = getattr(cls, "_instances", None)
    if not instances:
        return None
    try:
        mode: object = cls.external_write_mode(file=stream)  # type: ignore[union-attr]
        return mode
    except Exception:  # pragma: no cover - an odd tqdm
        return None


def write_text(stream_name: str, text: str) -> None:
    """Write ``text`` to the console stream ``stream_name`` now; a closed or
    broken console is ignored."""
    stream = console_stream(stream_name)
    if stream is None:
        return
    try:
        if _hook is not None:
            _hook(stream, text)
            return
        mode = _tqdm_write_mode(stream)
        if mode is not None:
            with mode:  # type: ignore[attr-defined]
                stream.write(text)
                stream.flush()
        elif not _write_fd(stream, stream_name, text):
            stream.write(text)
            stream.flush()
    except (OSError, ValueError):
        # A closed or broken console must not take the supervisor down.
        pass


def _write_fd(stream: TextIO, stream_name: str, text: str) -> bool:
    """Write ``text`` to the process's own fd 1/2 with ``os.write``, every byte.

    Why not ``stream.write``: on Linux a blocking ``write()`` to a pipe may
    return short, with no signal, while another thread of the process spawns
    (``subprocess``' ``vfork``: the loop thread starting workers), and
    CPython's buffered stdout (3.10-3.13) then drops the rest - measured:
    5-25 % of a 16-worker tee into a pipe lost. A loop of ``os.write`` loses
    nothing. Only where the stream *is* fd 1/2 (a notebook's or a test's
    stream is written through); what it buffered is flushed first, so the
    order is kept. Returns ``False`` where this does not apply.
    """
    want = 1 if stream_name == "stdout" else 2
    try:
        if not isinstance(stream, io.TextIOWrapper) or stream.fileno() != want:
            return False
        data = text.encode(stream.encoding or "utf-8", "replace")
    except (AttributeError, OSError, ValueError):
        return False
    stream.flush()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(want, view) :]
        except BlockingIOError:  # someone made the console non-blocking
            select.select([], [want], [])
    return True
