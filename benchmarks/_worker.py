"""Python fallback of _worker.c (used when no C compiler is found); same modes."""

import os
import signal
import sys
import time


def stamp(path, rank, what):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{rank} {what} {time.monotonic():.9f}\n".encode())
    os.close(fd)


def main(argv):
    mode = argv[1]
    if mode == "stamp":
        stamp(argv[2], argv[3], "start")
        os._exit(0)
    if mode == "gate":
        fd = os.open(argv[4], os.O_RDONLY)  # before "ready" (see _worker.c)
        stamp(argv[2], argv[3], "ready")
        while os.read(fd, 1):
            pass
        if int(argv[6]):
            while True:
                signal.pause()
        stamp(argv[2], argv[3], "exit")
        os._exit(int(argv[5]))
    if mode in ("sleep", "ignore"):
        if mode == "ignore":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stamp(argv[2], argv[3], "ready")
        while True:
            signal.pause()
    if mode == "lines":
        n, us = int(argv[2]), int(argv[3])
        for _ in range(n):
            os.write(1, f"{time.monotonic():.9f}\n".encode())
            if us:
                time.sleep(us / 1e6)
        os._exit(0)
    if mode == "bulk":
        rank, mib = int(argv[2]), int(argv[3])
        each = int(argv[5]) if len(argv) > 5 else 1 << 20
        block = bytearray(
            bytes(((ord("a") + (i % 128) % 26) if i % 128 != 127 else 10) for i in range(128))
            * 8192
        )
        first = time.monotonic()
        for k in range(mib):
            block[:15] = b"%03d %010d " % (rank, k)
            for at in range(0, len(block), each):
                view = memoryview(block)[at : at + each]
                while view:
                    view = view[os.write(1, view) :]
        last = time.monotonic()
        if len(argv) > 4:
            fd = os.open(argv[4], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(fd, f"{rank} first {first:.9f}\n{rank} last {last:.9f}\n".encode())
            os.close(fd)
        os._exit(0)
    if mode == "count":
        lines = nbytes = 0
        t = 0.0
        while True:
            chunk = os.read(0, 1 << 20)
            if not chunk:
                break
            t = time.monotonic()
            nbytes += len(chunk)
            lines += chunk.count(b"\n")
        with open(argv[2], "w") as f:
            f.write(f"{lines} {nbytes} {t:.9f}\n")
        os._exit(0)
    os._exit(3)


if __name__ == "__main__":
    main(sys.argv)
