"""The trivial training script of the end-to-end benchmark (launched by aiolaunch / torchrun).

_e2e_script.py trivial   every rank stamps "RANK start0 T" and exits 0
_e2e_script.py restart   attempt 0: rank 0 waits until all ranks run, stamps
                         "0 fail T" and exits 1 (the others sleep); attempt 1:
                         every rank stamps "RANK start1 T" and exits 0
"""

import os
import sys
import time


def stamp(what):
    fd = os.open(os.environ["BENCH_STAMP"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{os.environ['LOCAL_RANK']} {what} {time.monotonic():.9f}\n".encode())
    os.close(fd)


attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
stamp(f"start{attempt}")
if sys.argv[1] == "restart" and attempt == "0":
    if os.environ["LOCAL_RANK"] == "0":
        n = int(os.environ["LOCAL_WORLD_SIZE"])
        while True:
            with open(os.environ["BENCH_STAMP"]) as f:
                if sum(" start0 " in ln for ln in f) >= n:
                    break
            time.sleep(0.002)
        stamp("fail")
        sys.exit(1)
    time.sleep(120)
