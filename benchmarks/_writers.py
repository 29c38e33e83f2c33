"""Log throughput as the writers see it: one fresh supervisor process per trial.

run.py's ``throughput`` rows call :func:`writers_trial`; this file, run as a
script, is that trial's supervisor (aiolaunch, torch or the raw floor)::

    python _writers.py IMPL PERIOD MODE N MIB WRITE LOG_DIR STAMP RESULT WORKER...

Each worker (``_worker.c``'s ``bulk`` mode) writes MIB blocks of 128-byte
lines to its stdout, WRITE bytes per ``write()`` (1 MiB: a bulk copy, at the
page cache's speed; 128: a line each, as ``print(..., flush=True)`` or
``PYTHONUNBUFFERED=1`` - CPU-bound writers, whose rate falls with every
CPU-second the supervisor takes from them), and stamps, *inside the worker*,
the monotonic time just before its first write and just after its last. The
supervisor's stdout - the console of the tee - is a pipe read by a separate
counting process (``_worker.c``'s ``count`` mode, as a terminal or ``| tee``
would read it), which stamps its last read. Metrics:

- ``MB_per_s``: the writers' own rate, all bytes / (latest last write -
  earliest first write) - not the time until ``wait()`` returns, which for
  torch includes its poll period;
- ``wait_ms``: the ``start_processes`` call -> ``wait()`` returned (aiolaunch:
  every byte in its file and on the console by then);
- ``console_MB_per_s`` (tee): all bytes / (earliest first write -> the
  console's last byte);
- ``cpu_ms_per_MB``: the supervisor's CPU (every thread) from the call to the
  end of ``close()``, per MB.

Every trial checks each log file byte for byte and, for tee, the console's
line and byte counts (torch losing console lines fails its own trial).
An aiolaunch trial ends when its supervisor's guardian has exited too (it
sweeps ``/proc`` for ~0.6 s after the supervisor's exit): otherwise the
next variant's trial would run beside it.
A fresh process per trial, not the long-lived driver, as for a user's one
run: aiolaunch's first ``start_processes()`` imports what ``import
aiolaunch`` deferred (~45 ms of CPU on this 2-core host, all of it before the
first spawn, so not in the writers' window), and ``cpu_ms_per_MB`` counts it;
torch's imports happen at ``import torch...`` before the clock starts.
Imports at the top: stdlib only.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import time

mono = time.monotonic
BLOCK_LINES = 8192
FILL = (
    bytes(((ord("a") + (i % 128) % 26) if i % 128 != 127 else 10) for i in range(128)) * BLOCK_LINES
)


class Check(AssertionError):
    """A correctness check failed."""


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------ the supervisor
def _supervise_aiolaunch(entry: str, args: dict, mode: str, log_dir: str) -> dict:
    import asyncio

    import aiolaunch

    async def main() -> dict:
        kw = {"tee": aiolaunch.Std.OUT} if mode == "tee" else {"redirects": aiolaunch.Std.OUT}
        c0, t0 = _cpu_s(), mono()
        ctx = await aiolaunch.start_processes(
            name="b", entrypoint=entry, args=args, envs={r: {} for r in args}, log_dir=log_dir, **kw
        )
        res = await ctx.wait()
        waited = mono() - t0
        await ctx.close()
        if res is None or res.is_failed():
            raise Check(f"workers failed: {res}")
        from aiolaunch._workers._guardian import current_guardian

        g = current_guardian()
        return {
            "wait_s": waited,
            "cpu_s": _cpu_s() - c0,
            "paths": dict(ctx.stdouts),
            # It outlives this process by ~0.6 s (its /proc sweep at EOF):
            # the trial waits for it, so that the next variant's does not
            # run beside it.
            "guardian_pid": g.pid if g is not None else 0,
        }

    return asyncio.run(main())


def _supervise_torch(entry: str, args: dict, mode: str, log_dir: str, period: float) -> dict:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    specs = DefaultLogsSpecs(
        log_dir=log_dir,
        redirects=Std.NONE if mode == "tee" else Std.OUT,
        tee=Std.OUT if mode == "tee" else Std.NONE,
    )
    c0, t0 = _cpu_s(), mono()
    pc = start_processes(
        name="b", entrypoint=entry, args=args, envs={r: {} for r in args}, logs_specs=specs
    )
    res = pc.wait(period=period)
    waited = mono() - t0
    pc.close()
    if res is None or res.is_failed():
        raise Check(f"workers failed: {res}")
    return {"wait_s": waited, "cpu_s": _cpu_s() - c0, "paths": dict(pc.stdouts)}


def _supervise_raw(entry: str, args: dict, mode: str, log_dir: str) -> dict:
    """The floor: the worker writes its file (redirect), or a plain asyncio
    protocol copies the pipe into the file and prefixed lines to stdout (tee)."""
    import asyncio

    class Pipe(asyncio.Protocol):
        def __init__(self, fd: int, prefix: bytes) -> None:
            self.fd, self.prefix, self.buf = fd, prefix, b""
            self.done = asyncio.get_running_loop().create_future()

        def data_received(self, data: bytes) -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
            self.buf += data
            head, sep, self.buf = self.buf.rpartition(b"\n")
            if sep:
                text = self.prefix + (head + sep).replace(b"\n", b"\n" + self.prefix)
                sys.stdout.buffer.write(text[: -len(self.prefix)])

        def connection_lost(self, exc: object) -> None:
            os.close(self.fd)
            self.done.set_result(None)

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        c0, t0 = _cpu_s(), mono()
        procs, pipes, paths = [], [], {}
        for r, argv in args.items():
            os.makedirs(os.path.join(log_dir, str(r)))
            paths[r] = os.path.join(log_dir, str(r), "stdout.log")
            fd = os.open(paths[r], os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if mode != "tee":
                procs.append(await asyncio.create_subprocess_exec(entry, *argv, stdout=fd))
                os.close(fd)
                continue
            rd, wr = os.pipe()
            procs.append(await asyncio.create_subprocess_exec(entry, *argv, stdout=wr))
            os.close(wr)
            _, proto = await loop.connect_read_pipe(
                lambda fd=fd, r=r: Pipe(fd, f"[b{r}]:".encode()), os.fdopen(rd, "rb", 0)
            )
            pipes.append(proto)
        rcs = await asyncio.gather(*(p.wait() for p in procs))
        await asyncio.gather(*(p.done for p in pipes))
        sys.stdout.flush()
        if any(rcs):
            raise Check(f"exit codes {rcs}")
        return {"wait_s": mono() - t0, "cpu_s": _cpu_s() - c0, "paths": paths}

    return asyncio.run(main())


def supervise(argv: list[str]) -> None:
    impl, period, mode, n, mib, write, log_dir, stamp, result = argv[:9]
    worker = argv[9:]
    args = {r: (*worker[1:], "bulk", str(r), mib, stamp, write) for r in range(int(n))}
    if impl == "aiolaunch":
        out = _supervise_aiolaunch(worker[0], args, mode, log_dir)
    elif impl == "torch":
        out = _supervise_torch(worker[0], args, mode, log_dir, float(period))
    else:
        out = _supervise_raw(worker[0], args, mode, log_dir)
    sys.stdout.flush()
    with open(result, "w") as f:
        json.dump(out, f)


# ------------------------------------------------------------------ the trial
def verify_bulk(path: str, rank: int, mib: int) -> None:
    """The log holds exactly what worker ``rank`` wrote (``bulk`` mode)."""
    size = os.path.getsize(path) if os.path.exists(path) else -1
    if size != mib << 20:
        raise Check(f"rank {rank}: log holds {size} bytes, expected {mib << 20}")
    with open(path, "rb") as f:
        for k in range(mib):
            block = f.read(1 << 20)
            if block[:15] != b"%03d %010d " % (rank, k) or block[15:] != FILL[15:]:
                raise Check(f"rank {rank}: block {k} differs from what the worker wrote")


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    """Wait until process ``pid`` (not our child) exited: its pidfd turns
    readable then. Nothing to wait for if it is gone already."""
    if pid <= 0:
        return
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # gone already (or no pidfds: not waited for)
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(timeout * 1e3):
            raise Check(f"the supervisor's guardian {pid} still runs {timeout} s after it")
    finally:
        os.close(fd)


def _stamps(path: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {"first": {}, "last": {}}
    with open(path) as f:
        for line in f:
            rank, what, t = line.split()
            out[what][int(rank)] = float(t)
    return out


def writers_trial(
    variant: str, params: dict, env: dict[str, str], tmp: str, profile: str = ""
) -> dict:
    """One throughput trial of ``variant`` (see the module docstring).

    ``params``: ``n`` workers, ``mib`` per worker, ``tee`` (else redirect),
    ``write``: bytes per ``write()`` (default 1 MiB).
    ``profile``: run the supervisor under cProfile into this file.
    """
    n, mib, tee = params["n"], params["mib"], params["tee"]
    mode = "tee" if tee else "redirect"
    impl = variant.split("-")[0]
    period = "0.1" if variant.endswith("p0.1") else "1.0"
    worker = json.loads(env["BENCH_WORKER"])
    d = tempfile.mkdtemp(dir=tmp)
    stamp, result, counted = (os.path.join(d, x) for x in ("stamps", "result", "console"))
    log_dir = os.path.join(d, "logs")
    os.makedirs(log_dir)
    here = os.path.abspath(__file__)
    sup = [sys.executable, here]
    if profile:
        code = "import cProfile,sys;sys.argv=sys.argv[1:];cProfile.run(open(sys.argv[0]).read(),%r)"
        sup = [sys.executable, "-c", code % profile, here]
    write = str(params.get("write", 1 << 20))
    argv = [*sup, impl, period, mode, str(n), str(mib), write, log_dir, stamp, result, *worker]
    with subprocess.Popen([*worker, "count", counted], stdin=subprocess.PIPE) as console:
        try:
            p = subprocess.run(
                argv, stdout=console.stdin, stderr=subprocess.PIPE, env=env, timeout=300
            )
        finally:
            assert console.stdin is not None
            console.stdin.close()
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace")
        tail = err.strip().splitlines()[-1] if err.strip() else f"exit status {p.returncode}"
        if "Check:" in tail:
            return {"ok": False, "error": f"check failed: {tail}"}
        return {"ok": False, "error": err[-2000:]}
    with open(result) as f:
        info = json.load(f)
    _wait_gone(info.get("guardian_pid", 0))
    st = _stamps(stamp)
    try:
        if len(st["last"]) != n:
            raise Check(f"{len(st['last'])}/{n} writers finished")
        for r in range(n):
            verify_bulk(info["paths"][str(r)], r, mib)
        with open(counted) as f:
            lines, chars, t_console = f.read().split()
        if tee:
            want_lines = n * mib * BLOCK_LINES
            want = n * mib * (1 << 20) + sum(len(f"[b{r}]:") for r in range(n)) * mib * BLOCK_LINES
            if (int(lines), int(chars)) != (want_lines, want):
                raise Check(
                    f"console got {lines} lines / {chars} bytes, expected {want_lines} / {want}"
                )
    except Check as e:
        return {"ok": False, "error": f"check failed: {e}"}
    mb = n * mib * (1 << 20) / 1e6
    first = min(st["first"].values())
    metrics = {
        "MB_per_s": mb / (max(st["last"].values()) - first),
        "wait_ms": info["wait_s"] * 1e3,
        "cpu_ms_per_MB": info["cpu_s"] * 1e3 / mb,
    }
    if tee:
        metrics["console_MB_per_s"] = mb / (float(t_console) - first)
    import shutil

    shutil.rmtree(d, ignore_errors=True)
    return {"ok": True, "metrics": metrics}


if __name__ == "__main__":
    supervise(sys.argv[1:])
