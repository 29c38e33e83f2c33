"""The training script of the warm-start benchmarks (launched by aiolaunch / torchrun).

Stamps go to ``$BENCH_STAMP`` as ``ATTEMPT RANK WHAT CLOCK_MONOTONIC`` lines.

_warm_script.py start     every rank stamps "imported" right after ``import torch``
                          and exits 0 (first start: launch -> every rank past it)
_warm_script.py restart   a real gloo DDP job: in attempt 0 rank 1 stamps "fail"
                          and exits 1 right after its first all_reduce; every
                          rank of every attempt stamps "first" after its first
                          all_reduce (the restart turnaround: fail -> first)
_warm_script.py soak R S  attempts 0..R-1: a random rank (seeded by the attempt)
                          SIGKILLs itself at a random step in 1..S (stamp "fail"
                          first); attempt R trains S steps and exits 0
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


import torch  # noqa: E402

stamp("imported")
if sys.argv[1] == "start":
    sys.exit(0)

import random  # noqa: E402
import signal  # noqa: E402

import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
t = torch.ones(16)
dist.all_reduce(t)
stamp("first")
if sys.argv[1] == "restart":
    if ATTEMPT == 0 and RANK == 1:
        stamp("fail")
        sys.exit(1)
    dist.barrier()
    # The turnaround is measured; end without the interpreter's teardown,
    # which sometimes aborts in gloo ("terminate called without an active
    # exception", seen under torchrun and aiolaunch --no-preload alike).
    os._exit(0)

restarts, steps = int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(ATTEMPT)
victim, at = rng.randrange(dist.get_world_size()), rng.randint(1, steps)
for step in range(1, steps + 1):
    if step == at and victim == RANK and restarts > ATTEMPT:
        stamp("fail")
        os.kill(os.getpid(), signal.SIGKILL)
    loss = model(torch.randn(32, 64)).square().mean()
    opt.zero_grad()
    loss.backward()  # DDP's gradient all_reduce
    opt.step()
dist.barrier()
os._exit(0)  # as above
