"""Function-worker entrypoints (stdlib only: importable by spawn/forkserver children)."""

import os
import signal
import time


def _stamp(path, rank, what):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{rank} {what} {time.monotonic():.9f}\n".encode())
    os.close(fd)


def fn_stamp(stamp, rank):
    _stamp(stamp, rank, "start")


def fn_gate(stamp, rank, fifo, code, hang):
    """Ready stamp; block until the FIFO reaches EOF; then hang, fail or return."""
    # Open before the ready stamp: the driver closes its end once every worker
    # is ready, and an open for reading with no writer left blocks forever.
    fd = os.open(fifo, os.O_RDONLY)
    _stamp(stamp, rank, "ready")
    while os.read(fd, 1):
        pass
    os.close(fd)
    if hang:
        while True:
            signal.pause()
    _stamp(stamp, rank, "exit")
    if code:
        raise RuntimeError(f"rank {rank} fails on purpose")
    return rank
