"""Under Slurm: the node count, node rank and rendezvous host from ``SLURM_*``.

``srun aiolaunch --nproc-per-node 4 train.py`` on every node of an allocation
needs no ``--nnodes/--node-rank/--rdzv-endpoint``: when ``SLURM_JOB_ID`` is
set and neither the command line nor ``PET_*`` gave them, they come from

- ``--nnodes``: ``SLURM_STEP_NUM_NODES`` in an ``srun`` step, else
  ``SLURM_NNODES`` (several nodes outside a step is an error: the batch
  script runs on the first node only);
- ``--node-rank`` (static rendezvous only: a torch rendezvous assigns node
  ranks itself): this node's (``SLURMD_NODENAME``) place in the node list,
  else ``SLURM_NODEID``;
- ``--rdzv-endpoint``: the first host of ``SLURM_STEP_NODELIST`` (else
  ``SLURM_JOB_NODELIST``; static and c10d; the port is ``--master-port`` or
  the backend's default), in Slurm's hostlist syntax (:func:`expand_hostlist`).

One line on stderr says what was taken from where. One node needs nothing
(a local rendezvous on a free port, no torch).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse
    from collections.abc import Mapping

__all__ = ["apply_slurm", "expand_hostlist"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
#: backends whose endpoint is the first node (etcd's is a server of its own)
_ENDPOINT_BACKENDS = ("static", "c10d")


def _split_top(text: str) -> list[str]:
    """Split ``text`` at the commas outside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"nested '[' in hostlist {text!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"unbalanced ']' in hostlist {text!r}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {text!r}")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str, hostlist: str) -> list[str]:
    """``"01-03,7"`` → ``["01", "02", "03", "7"]`` (a range keeps its lower bound's width)."""
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if m is None:
            raise ValueError(f"bad range {item!r} in hostlist {hostlist!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} goes down in hostlist {hostlist!r}")
        if int(hi) - int(lo) >= 100_000:
            raise ValueError(f"range {item!r} is too large in hostlist {hostlist!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_one(pattern: str, hostlist: str) -> list[str]:
    """One host pattern: every bracket group multiplies (``a[1-2]b[3,5]`` → 4 names)."""
    names = [""]
    pos = 0
    for m in re.finditer(r"\[([^\]]*)\]", pattern):
        literal = pattern[pos : m.start()]
        values = _expand_ranges(m.group(1), hostlist)
        names = [n + literal + v for n in names for v in values]
        pos = m.end()
    return [n + pattern[pos:] for n in names]


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's hostlist syntax → host names, in order.

    ``"node[01-03,07],gpu-a[1-2]-[0-1],login"`` → ``node01 node02 node03
    node07 gpu-a1-0 gpu-a1-1 gpu-a2-0 gpu-a2-1 login``: comma lists, ranges
    (zero padding from the lower bound's width), several bracket groups in
    one name (their product, the last varying fastest), as ``scontrol show
    hostnames`` prints them.

    :raises ValueError: unbalanced brackets, a range that is not ``N`` or
        ``N-M`` with ``N <= M``, or an empty name.
    """
    hosts: list[str] = []
    for part in _split_top(hostlist.strip()):
        part = part.strip()
        if not part:
            raise ValueError(f"empty host name in hostlist {hostlist!r}")
        hosts.extend(_expand_one(part, hostlist))
    return hosts


def _given(args: argparse.Namespace, dest: str, environ: Mapping[str, str]) -> bool:
    from ._parser import GIVEN

    return dest in getattr(args, GIVEN, set()) or f"PET_{dest.upper()}" in environ


def apply_slurm(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """Fill ``args`` from ``SLURM_*`` where the user gave nothing; return the one-line notice.

    ``None`` outside Slurm (no ``SLURM_JOB_ID``), or when nothing was taken.
    In an ``srun`` step the step's own variables count (``SLURM_STEP_NUM_NODES``,
    ``SLURM_STEP_NODELIST``; the node rank is this node's place in that list),
    so a step on part of the allocation forms its own world. ``--standalone``
    takes nothing: a world of one node, as under torchrun (an ``srun`` step
    on several nodes runs one such job per node).

    :raises ValueError: the variables are not what Slurm writes (the message
        names the variable), or the allocation has several nodes but this is
        the batch script (no ``srun``: it runs on the first node only).
    """
    if not environ.get("SLURM_JOB_ID") or args.standalone:
        return None
    step = "SLURM_STEP_NUM_NODES" in environ
    taken: list[str] = []
    nnodes_var = next(
        (
            v
            for v in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
            if v in environ
        ),
        None,
    )
    nnodes = args.nnodes
    if not _given(args, "nnodes", environ) and nnodes_var:
        value = environ[nnodes_var]
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{nnodes_var}={value!r} is not a node count; pass --nnodes")
        if int(value) > 1 and not step:
            raise ValueError(
                f"{nnodes_var}={value}, but this is not an srun step (the batch script runs "
                "on the first node only): start one aiolaunch per node with `srun aiolaunch "
                "...`, or pass --nnodes 1 for one node"
            )
        nnodes = args.nnodes = value
        taken.append(f"--nnodes {value} ({nnodes_var})")
    if nnodes.split(":")[-1] == "1":
        return _notice(environ, taken)
    list_var = next(
        (
            v
            for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if v in environ
        ),
        None,
    )
    hosts: list[str] = []
    if list_var:
        try:
            hosts = expand_hostlist(environ[list_var])
        except ValueError as exc:
            raise ValueError(f"{list_var}: {exc}; pass --rdzv-endpoint HOST:PORT") from None
    backend = args.rdzv_backend
    if backend == "static" and not _given(args, "node_rank", environ):
        me = environ.get("SLURMD_NODENAME", "")
        if me and me in hosts:
            args.node_rank = hosts.index(me)
            taken.append(f"--node-rank {args.node_rank} (SLURMD_NODENAME={me} in {list_var})")
        elif environ.get("SLURM_NODEID"):
            value = environ["SLURM_NODEID"]
            if not value.isdigit():
                raise ValueError(f"SLURM_NODEID={value!r} is not a node index; pass --node-rank")
            args.node_rank = int(value)
            taken.append(f"--node-rank {value} (SLURM_NODEID)")
    if (
        hosts
        and list_var
        and backend in _ENDPOINT_BACKENDS
        and not _given(args, "rdzv_endpoint", environ)
        and not _given(args, "master_addr", environ)
    ):
        port = args.master_port
        if port is None and backend == "static":
            from ._parser import DEFAULT_MASTER_PORT

            port = DEFAULT_MASTER_PORT
        args.rdzv_endpoint = hosts[0] if port is None else f"{hosts[0]}:{port}"
        taken.append(
            f"--rdzv-endpoint {args.rdzv_endpoint} (first host of {list_var}={environ[list_var]})"
        )
    return _notice(environ, taken)


def _notice(environ: Mapping[str, str], taken: list[str]) -> str | None:
    if not taken:
        return None
    return f"under Slurm job {environ['SLURM_JOB_ID']}: " + ", ".join(taken)
