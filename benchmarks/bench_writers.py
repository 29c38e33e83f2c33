"""Redirect and tee throughput as the *writers* see it, aiolaunch vs torch.

    python benchmarks/bench_writers.py [--rounds 5] [--n 1,4,16] [--modes redirect,tee]
                                       [--redirect-mib 32] [--tee-mib 4]
    python benchmarks/bench_writers.py --cprofile out.prof --modes tee --n 16
    python benchmarks/bench_writers.py --impls aiolaunch,torch,aiolaunch=/path/to/other/src

Each trial starts a fresh supervisor process (aiolaunch's ``start_processes``
or torch's ``torch.distributed.elastic.multiprocessing.start_processes``,
``wait(period=0.1)`` as torchrun) whose stdout - the console of the tee - is a
pipe read by ``wc -lc``, as a terminal or ``| tee`` would read it. Each worker
(a small C program, compiled here; a Python one where there is no compiler)
writes MIB blocks of 128-byte lines to its stdout and stamps, *inside the
worker*, the monotonic time just before its first write and just after its
last. Throughput is the writers' own rate: all bytes / (latest last write -
earliest first write). Beside it: the rate until ``wait()`` returns (all
bytes / the time ``wait()`` took: the console got every line by then; it
includes torch's poll period), and the supervisor's CPU per MiB (all its
threads, from the call to ``start_processes`` to the end).

Trials are interleaved: each round runs every (mode, N) for both launchers, the
launcher that goes first alternating. Every trial checks the log files byte for
byte and, for tee, the console's line and byte counts. Each ratio is the median
[min-max] of the per-round ratios (> 1: aiolaunch better).
The 1-minute load average is printed before and after (``uptime``): on a
loaded host, only the ratio of one interleaved run means anything.
``aiolaunch=SRC`` runs another aiolaunch (its ``src`` folder first on
``PYTHONPATH``) in the same interleaved run: a before/after comparison.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

WORKER_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static double mono(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static void stamp(const char *path, const char *rank, const char *what, double t) {
    char buf[96]; int n = snprintf(buf, sizeof buf, "%s %s %.9f\n", rank, what, t);
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, buf, n) != n) _exit(90);
    close(fd);
}
int main(int argc, char **argv) {
    int rank = atoi(argv[2]), mib = atoi(argv[3]);
    static char block[1 << 20];
    for (int i = 0; i < (1 << 20); i++) block[i] = (i % 128 == 127) ? '\n' : 'a' + (i % 128) % 26;
    double first = mono();
    for (int k = 0; k < mib; k++) {
        char hdr[32]; snprintf(hdr, sizeof hdr, "%03d %010d ", rank, k); memcpy(block, hdr, 15);
        const char *p = block; size_t n = sizeof block;
        while (n) { ssize_t w = write(1, p, n); if (w <= 0) _exit(91); p += w; n -= w; }
    }
    double last = mono();
    stamp(argv[1], argv[2], "first", first);
    stamp(argv[1], argv[2], "last", last);
    return 0;
}
"""

WORKER_PY = r"""
import os, sys, time
stamp, rank, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
line = bytes((ord("a") + i % 26) for i in range(127)) + b"\n"
block = bytearray(line * 8192)
first = time.monotonic()
for k in range(mib):
    block[:15] = b"%03d %010d " % (rank, k)
    view = memoryview(block)
    while view:
        view = view[os.write(1, view):]
last = time.monotonic()
with open(stamp, "a") as f:
    f.write(f"{rank} first {first:.9f}\n{rank} last {last:.9f}\n")
"""

# The supervisor of one trial: argv = IMPL MODE N MIB LOG_DIR STAMP WORKER...
RUNNER = r"""
import resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
impl, mode, n, mib, log_dir, stamp = sys.argv[1:7]
worker = sys.argv[7:]
n, mib = int(n), int(mib)
args = {r: tuple(worker[1:]) + (stamp, str(r), str(mib)) for r in range(n)}
envs = {r: {} for r in range(n)}
if impl.startswith("aiolaunch"):
    import asyncio, aiolaunch
    from aiolaunch import Std
    async def main():
        kw = {"tee": Std.OUT} if mode == "tee" else {"redirects": Std.OUT}
        global c0
        c0 = cpu()
        async with aiolaunch.start_processes(name="b", entrypoint=worker[0], args=args,
                                             envs=envs, log_dir=log_dir, **kw) as ctx:
            t0 = time.monotonic()
            res = await ctx.wait()
            waited = time.monotonic() - t0
            paths = dict(ctx.stdouts)
        return res, waited, paths
    res, waited, paths = asyncio.run(main())
else:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
    specs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.OUT if mode != "tee" else Std.NONE,
                             tee=Std.OUT if mode == "tee" else Std.NONE)
    c0 = cpu()
    pc = start_processes(name="b", entrypoint=worker[0], args=args, envs=envs, logs_specs=specs)
    t0 = time.monotonic()
    res = pc.wait(period=0.1)
    waited = time.monotonic() - t0
    pc.close()
    paths = dict(pc.stdouts)
assert res is not None and not res.is_failed(), res
sys.stdout.flush()
spent = cpu() - c0
print(repr({"waited": waited, "paths": paths, "cpu": spent}), file=sys.stderr)
"""

BLOCK = bytes(((ord("a") + (i % 128) % 26) if i % 128 != 127 else 10) for i in range(128)) * 8192


def build_worker(tmp: str) -> list[str]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        src = os.path.join(tmp, "writer.c")
        exe = os.path.join(tmp, "writer")
        with open(src, "w") as f:
            f.write(WORKER_C)
        if subprocess.run([cc, "-O2", "-o", exe, src]).returncode == 0:
            return [exe]
    path = os.path.join(tmp, "writer.py")
    with open(path, "w") as f:
        f.write(WORKER_PY)
    return [sys.executable, path]


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def verify(path: str, rank: int, mib: int) -> None:
    size = os.path.getsize(path)
    if size != mib << 20:
        raise SystemExit(f"rank {rank}: {path} holds {size} bytes, expected {mib << 20}")
    with open(path, "rb") as f:
        for k in range(mib):
            block = f.read(1 << 20)
            if block[:15] != b"%03d %010d " % (rank, k) or block[15:] != BLOCK[15:]:
                raise SystemExit(f"rank {rank}: block {k} of {path} differs")


def trial(impl: str, mode: str, n: int, mib: int, worker: list[str], tmp: str, prof: str) -> dict:
    d = tempfile.mkdtemp(dir=tmp)
    stamp = os.path.join(d, "stamps")
    log_dir = os.path.join(d, "logs")
    os.makedirs(log_dir)
    runner = [sys.executable, "-c", RUNNER]
    if prof:
        # CPU time of the loop thread (time.thread_time), not wall time: on a
        # loaded host a profile in wall time mostly shows waiting for a CPU.
        code = (
            "import cProfile,sys,time;sys.argv=['x',*sys.argv[1:]];"
            "p=cProfile.Profile(time.thread_time);g={'__name__':'__main__'};p.runctx(sys.argv.pop(1),g,g);p.dump_stats(%r)"
        )
        runner = [sys.executable, "-c", code % prof, RUNNER]
    env = dict(os.environ)
    if impl.startswith("aiolaunch="):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [impl[10:], env.get("PYTHONPATH")]))
    counter = subprocess.Popen(["wc", "-lc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert counter.stdin is not None
    sup = subprocess.run(
        [*runner, impl, mode, str(n), str(mib), log_dir, stamp, *worker],
        stdout=counter.stdin,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    counter.stdin.close()
    assert counter.stdout is not None
    out = counter.stdout.read().split()
    counter.wait()
    if sup.returncode != 0:
        raise SystemExit(f"{impl} {mode} N={n} failed:\n{sup.stderr}")
    info = eval(sup.stderr.strip().splitlines()[-1])  # our own repr line
    stamps: dict[str, dict[int, float]] = {"first": {}, "last": {}}
    with open(stamp) as f:
        for line in f:
            rank, what, t = line.split()
            stamps[what][int(rank)] = float(t)
    for r in range(n):
        verify(info["paths"][r], r, mib)
    if mode == "tee":
        lines, chars = int(out[0]), int(out[1])
        want_lines = n * mib * 8192
        want_chars = n * mib * (1 << 20) + sum(len(f"[b{r}]:") for r in range(n)) * mib * 8192
        if (lines, chars) != (want_lines, want_chars):
            raise SystemExit(
                f"{impl} tee N={n}: console got {lines} lines / {chars} bytes, "
                f"expected {want_lines} / {want_chars}"
            )
    span = max(stamps["last"].values()) - min(stamps["first"].values())
    shutil.rmtree(d)
    return {
        "MiB_s": n * mib / span,
        "wait_s": info["waited"],
        "e2e_MiB_s": n * mib / info["waited"],
        "cpu_ms_MiB": info["cpu"] * 1e3 / (n * mib),
    }


def _med(rs: list[dict], key: str) -> float:
    return statistics.median(x[key] for x in rs) if rs else float("nan")


def _ratio(al: list[dict], to: list[dict], key: str) -> str:
    """Median [min-max] of the per-round ratios aiolaunch / torch."""
    rs = [x[key] / y[key] for x, y in zip(al, to, strict=False)]
    return f"{statistics.median(rs):.2f}x [{min(rs):.2f}-{max(rs):.2f}]" if rs else ""


def row(al: list[dict], to: list[dict]) -> str:
    """The cells of one (mode, N) row: writers' rate, its ratio, until wait(), CPU."""
    return (
        f"{_med(al, 'MiB_s'):.0f} | {_med(to, 'MiB_s'):.0f} | {_ratio(al, to, 'MiB_s')} "
        f"| {_med(al, 'e2e_MiB_s'):.0f} / {_med(to, 'e2e_MiB_s'):.0f} "
        f"| {_ratio(al, to, 'e2e_MiB_s')} "
        f"| {_med(al, 'cpu_ms_MiB'):.2f} / {_med(to, 'cpu_ms_MiB'):.2f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", default="1,4,16")
    ap.add_argument("--modes", default="redirect,tee")
    ap.add_argument("--redirect-mib", default="32", help="MiB per worker, or one per --n")
    ap.add_argument("--tee-mib", default="4", help="MiB per worker, or one per --n")
    ap.add_argument("--impls", default="aiolaunch,torch")
    ap.add_argument("--cprofile", default="", help="profile ONE aiolaunch trial into this file")
    ap.add_argument("--dir", default=None, help="where the logs go (e.g. /dev/shm: no writeback)")
    a = ap.parse_args()
    ns = [int(x) for x in a.n.split(",")]

    def sizes(arg: str) -> dict[int, int]:
        v = [int(x) for x in arg.split(",")]
        return dict(zip(ns, v if len(v) == len(ns) else v[:1] * len(ns), strict=True))

    mibs = {"redirect": sizes(a.redirect_mib), "tee": sizes(a.tee_mib)}
    modes = a.modes.split(",")
    impls = a.impls.split(",")
    tmp = tempfile.mkdtemp(prefix="bench_writers_", dir=a.dir)
    try:
        worker = build_worker(tmp)
        if a.cprofile:
            mode = modes[0]
            mib = mibs[mode][ns[0]]
            r = trial("aiolaunch", mode, ns[0], mib, worker, tmp, os.path.abspath(a.cprofile))
            print(f"profiled aiolaunch {mode} N={ns[0]}: {r['MiB_s']:.0f} MiB/s -> {a.cprofile}")
            return 0
        print(f"load {load()} at start; worker {os.path.basename(worker[-1])}", flush=True)
        t0 = time.monotonic()
        res: dict[tuple[str, int, str], list[dict]] = {}
        for k in range(a.rounds):
            for mode in modes:
                for n in ns:
                    mib = mibs[mode][n]
                    order = impls if k % 2 == 0 else impls[::-1]
                    for impl in order:
                        r = trial(impl, mode, n, mib, worker, tmp, "")
                        res.setdefault((mode, n, impl), []).append(r)
            print(f"round {k + 1}/{a.rounds} done (load {load()})", flush=True)
        print(f"\nload {load()} at end; {time.monotonic() - t0:.0f} s\n")
        print("| aiolaunch | mode | N | MiB/worker | writers' MiB/s aiolaunch | torch "
              "| ratio | until wait(): MiB/s aiolaunch / torch | ratio "
              "| supervisor CPU ms/MiB aiolaunch / torch |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for mode in modes:
            for n in ns:
                mib = mibs[mode][n]
                to = res.get((mode, n, "torch"), [])
                for impl in impls:
                    if impl.startswith("aiolaunch"):
                        al = res.get((mode, n, impl), [])
                        print(f"| {impl} | {mode} | {n} | {mib} | {row(al, to)} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
