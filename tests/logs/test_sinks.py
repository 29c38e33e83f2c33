"""Console-side sinks without worker processes: prompts, hand-over of a stuck tee."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import TYPE_CHECKING, TextIO

from aiolaunch._logs import ConsoleSink, PassthroughSink, console, set_console_hook
from aiolaunch._logs._sink import FileRest

if TYPE_CHECKING:
    from pathlib import Path


class _Capture:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, stream: TextIO, text: str) -> None:
        with self.lock:
            self.texts.append(text)

    def text(self) -> str:
        with self.lock:
            return "".join(self.texts)


async def test_a_prompt_shows_once_the_stream_is_quiet_not_while_bytes_flow() -> None:
    captured = _Capture()
    previous = set_console_hook(captured)
    try:
        sink = PassthroughSink("stdout")
        # A line cut by read boundaries, its pieces 30 ms apart: never shown cut.
        for piece in (b"lo", b"ng li", b"ne", b" end\n"):
            sink.feed(piece)
            await asyncio.sleep(0.03)
        await console().flush()
        assert captured.text() == "long line end\n"
        sink.feed(b"continue? [y/n] ")  # a prompt: nothing follows
        for _ in range(100):
            await asyncio.sleep(0.02)
            await console().flush()
            if captured.text().endswith("[y/n] "):
                break
        assert captured.text() == "long line end\ncontinue? [y/n] "
        await sink.aclose()
    finally:
        set_console_hook(previous)


async def test_a_handed_over_file_is_written_in_order_by_the_console_thread(
    tmp_path: Path,
) -> None:
    """The tee of a finished worker whose console is stuck: the rest of its
    file goes to the console thread, after what was queued before, whole
    lines, the partial line completed, nothing lost."""
    lines = [f"line {i:06d} " + "z" * 100 + "\n" for i in range(30_000)]  # ~3.2 MB
    data = "".join(lines).encode()
    path = tmp_path / "stdout.log"
    path.write_bytes(data + b"last, no newline")
    captured = _Capture()
    previous = set_console_hook(captured)
    try:
        sink = ConsoleSink("stdout", "[w0]:")
        cut = 12_345  # mid-line: the framer holds a partial line
        sink.feed(data[:cut])
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        assert sink.hand_over(FileRest(fd, cut, path.stat().st_size))
        console().write("stdout", "after\n")
        await console().flush()
    finally:
        set_console_hook(previous)
    expected = "".join(f"[w0]:{line}" for line in lines) + "[w0]:last, no newline\n" + "after\n"
    assert captured.text() == expected
    if sys.platform.startswith("linux"):
        assert str(path) not in _open_paths(), "the console thread kept the file open"


def _open_paths() -> set[str]:
    out = set()
    for n in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{n}"))
        except OSError:  # the listing's own fd
            pass
    return out
