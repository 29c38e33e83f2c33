"""A small real DDP training run on CPU (gloo), for ``aiolaunch`` or ``torchrun``.

    aiolaunch --standalone --nproc-per-node 2 examples/ddp_train.py

Every worker reads its place in the world from the environment the launcher
sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), trains
the same small MLP on its own shard of a synthetic regression problem, and
DDP averages the gradients. Rank 0 shows a progress bar and prints the loss.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def make_data(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth non-linear target, the same function on every rank, different samples."""
    w = torch.randn(dim, 1, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = torch.sin(1.5 * (x @ w) / dim**0.5) + 0.2 * (x**2).sum(dim=1, keepdim=True) / dim
    y += 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=250)
    args = parser.parse_args()

    # One thread per worker: the workers share the machine's cores.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.manual_seed(1234)  # identical initial weights (DDP also broadcasts them)

    x, y = make_data(4096, args.dim, seed=100 + rank)
    model = DDP(
        nn.Sequential(
            nn.Linear(args.dim, args.hidden),
            nn.Tanh(),
            nn.Linear(args.hidden, args.hidden),
            nn.Tanh(),
            nn.Linear(args.hidden, 1),
        )
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    def global_loss() -> float:
        with torch.no_grad():
            t = loss_fn(model(x), y).detach().reshape(1)
        dist.all_reduce(t)
        return float(t.item()) / world

    start_loss = global_loss()
    if rank == 0:
        print(
            f"world_size={world} local_rank={local_rank} restart="
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} start loss {start_loss:.4f}",
            flush=True,
        )

    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, desc="train", unit="step")
        except ImportError:  # tqdm is optional
            bar = None

    g = torch.Generator().manual_seed(rank)
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, x.shape[0], (args.batch_size,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()  # DDP all-reduces the gradients here
        opt.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        if step % args.log_every == 0 or step == args.steps:
            current = global_loss()
            if rank == 0:
                msg = f"step {step:4d}  loss {current:.4f}"
                if bar is not None:
                    bar.write(msg)
                else:
                    print(msg, flush=True)
    if bar is not None:
        bar.close()

    final = global_loss()
    if rank == 0:
        assert math.isfinite(final)
        print(
            f"final loss {final:.4f} (start {start_loss:.4f}) "
            f"in {time.monotonic() - t0:.1f}s on {world} workers",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
