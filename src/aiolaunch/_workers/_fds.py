"""File descriptors: closing one that may be gone, and reading what a pipe still holds.

Both are used on either side of a worker's streams (the log pipeline's pumps,
a function worker's result pipe, the zygote's forks).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

__all__ = ["close_fd", "read_pipe_rest"]

#: the most bytes one read of :func:`read_pipe_rest` takes
READ_SIZE = 1 << 20


def close_fd(fd: int | None) -> None:
    """Close ``fd`` unless it is ``None`` or negative; an fd already closed is fine."""
    if fd is not None and fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def read_pipe_rest(transport: asyncio.ReadTransport | None, data: Callable[[bytes], None]) -> bool:
    """Hand ``data`` every byte the kernel still buffers in ``transport``'s pipe,
    without waiting (the writer exited); ``True`` once the pipe is at EOF.

    Every byte a worker wrote before it exited is in the pipe; a descendant
    that inherited the write end may keep it open, so this reads until the
    pipe is empty rather than until EOF. A closing transport is left alone:
    it either saw EOF (every byte was delivered) or was closed by us, and its
    fd may already be closed and its number reused.
    """
    if transport is None or transport.is_closing():
        return False
    pipe = transport.get_extra_info("pipe")
    if pipe is None:  # pragma: no cover - every pipe transport sets it
        return False
    while True:
        try:
            # Non-blocking: connect_read_pipe set O_NONBLOCK on this fd.
            chunk = os.read(pipe.fileno(), READ_SIZE)
        except (BlockingIOError, InterruptedError, OSError):
            return False
        if not chunk:
            return True
        data(chunk)
