"""The early-failure restart benchmark's script (``bench_early_restart.py``).

``_early_script.py DELAY [ddp]``: a 2-rank gloo job (with ``ddp``: a DDP
model wrapped before the first all_reduce, which imports torch._dynamo
where the zygote has not yet). In attempt 0 rank
1 stamps ``fail`` and exits 1 ``DELAY`` seconds after its first all_reduce,
while rank 0 sleeps; every rank of every attempt stamps ``start`` as the
script begins and ``first`` right after its first all_reduce. Stamps go to
``$BENCH_STAMP`` as ``ATTEMPT RANK WHAT CLOCK_MONOTONIC`` lines
(``bench_warm.read_stamps`` reads them).
"""

import os
import sys
import time

STAMP = os.environ["BENCH_STAMP"]
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


def stamp(what: str) -> None:
    fd = os.open(STAMP, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{ATTEMPT} {RANK} {what} {time.monotonic():.6f}\n".encode())
    os.close(fd)


stamp("start")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
if sys.argv[2:] == ["ddp"]:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
t = torch.ones(16)
dist.all_reduce(t)
stamp("first")
if ATTEMPT == 0:
    if RANK == 1:
        time.sleep(float(sys.argv[1]))
        stamp("fail")
        sys.exit(1)
    time.sleep(600)  # stopped by the launcher once rank 1 failed
dist.barrier()
# End without the interpreter's teardown, which sometimes aborts in gloo
# (as _warm_script.py does): the turnaround is what is measured.
os._exit(0)
