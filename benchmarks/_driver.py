"""Trial server: runs benchmark trials for ONE implementation, in its own process.

    python benchmarks/_driver.py IMPL        IMPL = aiolaunch | torch | raw

run.py starts one driver per implementation and sends it one JSON command per
line on stdin ({"bench": ..., "variant": ..., "params": {...}}); the driver
answers one JSON line on the fd named by $BENCH_RESULT_FD:
{"ok": bool, "metrics": {name: number | [numbers]}, "error": str}.

Why a driver process per implementation: torch's start_processes installs
SIGTERM/SIGINT handlers and its log tailers are threads, aiolaunch keeps a
console thread and a file thread pool per process; keeping each
implementation in its own long-lived process keeps them independent while
paying the interpreter and ``import torch`` (~1.8 s) once, not per trial.

The module-level imports are stdlib only on purpose: spawn and forkserver
children re-import ``__main__``; a light main module measures the launcher's
own cost (torch's function workers still import torch: that is torch's
bootstrap, ``torch.multiprocessing.spawn._wrap``).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

IMPL = ""
WORKER: list[str] = []  # argv prefix of the binary worker
TMP = ""
mono = time.monotonic


class Check(AssertionError):
    """A correctness check failed: the trial is marked FAIL."""


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise Check(msg)


# ---------------------------------------------------------------- helpers
def tmpdir() -> str:
    return tempfile.mkdtemp(dir=TMP)


def read_stamps(path: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    try:
        with open(path) as f:
            for line in f:
                rank, what, t = line.split()
                out.setdefault(what, {})[int(rank)] = float(t)
    except FileNotFoundError:
        pass
    return out


def count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_stamps_blocking(path: str, n: int, timeout: float = 120.0) -> None:
    end = mono() + timeout
    while count_lines(path) < n:
        if mono() > end:
            raise Check(f"only {count_lines(path)}/{n} workers became ready in {timeout}s")
        time.sleep(0.002)


async def wait_stamps(path: str, n: int, timeout: float = 120.0) -> None:
    end = mono() + timeout
    while count_lines(path) < n:
        if mono() > end:
            raise Check(f"only {count_lines(path)}/{n} workers became ready in {timeout}s")
        await asyncio.sleep(0.002)


class Gate:
    """A FIFO that workers block on; ``release()`` gives them all EOF at once."""

    def __init__(self, d: str) -> None:
        self.path = os.path.join(d, "gate")
        os.mkfifo(self.path)
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.released_at = 0.0

    def release(self) -> None:
        if self.fd is not None:
            self.released_at = mono()
            os.close(self.fd)
            self.fd = None

    def release_when_ready(self, stamp: str, n: int) -> threading.Thread:
        """Release from a thread once n workers stamped 'ready' (torch's wait blocks)."""

        def run() -> None:
            try:
                wait_stamps_blocking(stamp, n)
            except Check:
                pass
            self.release()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


class ExitObserver:
    """Independent clock for process exits: a separate process (the C worker's
    ``observe`` mode) blocked in poll() on pidfds writes when each worker
    process actually terminated. A separate process, not a thread, so the
    supervisor's GIL cannot delay the time stamp. Used to split "user code
    finished" -> "process gone" (the worker's own teardown) from "process
    gone" -> "wait() returned" (the supervisor's detection)."""

    def __init__(self, pids: dict[int, int], d: str) -> None:
        import subprocess

        self.pids = pids
        self.out = os.path.join(d, "exits")
        self.proc = None
        if len(WORKER) == 1:  # needs the C worker
            self.proc = subprocess.Popen([WORKER[0], "observe", self.out, *map(str, pids.values())])
            end = mono() + 10
            while not os.path.exists(self.out) and mono() < end:
                time.sleep(0.001)

    def join(self, timeout: float = 10.0) -> dict[int, float]:
        if self.proc is None:
            return {}
        try:
            self.proc.wait(timeout)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        rank = {pid: r for r, pid in self.pids.items()}
        out = {}
        with open(self.out) as f:
            for line in f:
                if line.strip() != "ready":
                    pid, t = line.split()
                    out[rank[int(pid)]] = float(t)
        return out


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            f.read()  # still there (running, or a zombie nobody reaped)
        return False
    except (FileNotFoundError, ProcessLookupError):
        return True


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


class StampWriter(io.TextIOBase):
    """Stands in for sys.stdout: records (monotonic time, text) of every write."""

    def __init__(self) -> None:
        self.chunks: list[tuple[float, str]] = []

    def write(self, s: str) -> int:
        self.chunks.append((mono(), s))
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True


# ------------------------------------------------------- implementations
# Each implementation offers: run_group(entry, args, kind, **opts) returning
# a Group with .start() / .wait() / .close() implemented on its own terms.
def torch_period(variant: str) -> float:
    return 0.1 if variant.endswith("p0.1") else 1.0


def bin_args(n: int, f) -> dict[int, tuple]:
    return {r: tuple(WORKER[1:]) + tuple(str(a) for a in f(r)) for r in range(n)}


# --- aiolaunch ---------------------------------------------------------
async def al_start(
    entry, args, *, method="spawn", redirects=None, tee=None, log_dir=None, shutdown_timeout=30.0
):
    import aiolaunch

    kw = {}
    if redirects is not None:
        kw["redirects"] = getattr(aiolaunch.Std, redirects)
    if tee is not None:
        kw["tee"] = getattr(aiolaunch.Std, tee)
    return await aiolaunch.start_processes(
        name="b",
        entrypoint=entry,
        args=args,
        envs={r: {} for r in args},
        log_dir=log_dir,
        start_method=method,
        shutdown_timeout=shutdown_timeout,
        **kw,
    )


# --- torch -------------------------------------------------------------
def torch_start(entry, args, *, method="spawn", redirects=None, tee=None, log_dir=None):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    specs = DefaultLogsSpecs(
        log_dir=log_dir or tmpdir(),
        redirects=getattr(Std, redirects) if redirects else Std.NONE,
        tee=getattr(Std, tee) if tee else Std.NONE,
    )
    return start_processes(
        name="b",
        entrypoint=entry,
        args=args,
        envs={r: {} for r in args},
        logs_specs=specs,
        start_method=method,
    )


# --- raw floor -----------------------------------------------------------
class _Pipe(asyncio.Protocol):
    """Raw floor for piped output: bytes to a file fd, optionally lines to sys.stdout."""

    def __init__(self, fd: int | None, prefix: str | None) -> None:
        self.fd, self.prefix, self.buf = fd, prefix, b""
        self.done = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        if self.fd is not None:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
        if self.prefix is not None:
            self.buf += data
            *lines, self.buf = self.buf.split(b"\n")
            if lines:
                sys.stdout.write(
                    "".join(f"{self.prefix}{ln.decode(errors='replace')}\n" for ln in lines)
                )

    def connection_lost(self, exc) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.done.set_result(None)


async def raw_spawn(argv_by_rank: dict[int, tuple], out_dir: str | None = None, tee: bool = False):
    loop = asyncio.get_running_loop()
    procs, pipes = [], []
    for r, argv in argv_by_rank.items():
        if out_dir is None:
            procs.append(await asyncio.create_subprocess_exec(WORKER[0], *argv))
            continue
        rd, wr = os.pipe()
        p = await asyncio.create_subprocess_exec(WORKER[0], *argv, stdout=wr)
        os.close(wr)
        d = os.path.join(out_dir, str(r))
        os.makedirs(d)
        fd = os.open(os.path.join(d, "stdout.log"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _, proto = await loop.connect_read_pipe(
            lambda fd=fd, r=r: _Pipe(fd, f"[b{r}]:" if tee else None),
            os.fdopen(rd, "rb", 0),
        )
        procs.append(p)
        pipes.append(proto)
    return procs, pipes


# ---------------------------------------------------------------- benches
def bench_launch_bin(variant: str, p: dict) -> dict:
    n = p["n"]
    d = tmpdir()
    stamp = os.path.join(d, "stamps")
    args = bin_args(n, lambda r: ("stamp", stamp, r))
    if IMPL == "aiolaunch":

        async def go():
            c0, t0 = cpu_s(), mono()
            ctx = await al_start(WORKER[0], args)
            t1, c1 = mono(), cpu_s()
            res = await ctx.wait()
            check(not res.is_failed(), f"failures: {res.failures}")
            return t0, t1, c1 - c0

        t0, t1, cpu = asyncio.run(go())
    elif IMPL == "torch":
        c0, t0 = cpu_s(), mono()
        pc = torch_start(WORKER[0], args)
        t1, cpu = mono(), cpu_s() - c0
        res = pc.wait(period=0.1)
        pc.close()
        check(res is not None and not res.is_failed(), f"failures: {res and res.failures}")
    else:

        async def go():
            c0, t0 = cpu_s(), mono()
            procs, _ = await raw_spawn(args)
            t1, c1 = mono(), cpu_s()
            rcs = await asyncio.gather(*(pr.wait() for pr in procs))
            check(rcs == [0] * n, f"exit codes {rcs}")
            return t0, t1, c1 - c0

        t0, t1, cpu = asyncio.run(go())
    st = read_stamps(stamp).get("start", {})
    check(len(st) == n, f"{len(st)}/{n} workers ran")
    return {
        "all_running_ms": (max(st.values()) - t0) * 1e3,
        "call_returned_ms": (t1 - t0) * 1e3,
        "call_cpu_ms": cpu * 1e3,
    }


def bench_launch_fn(variant: str, p: dict) -> dict:
    import _bench_workers as bw

    n, method = p["n"], p["method"]
    d = tmpdir()
    stamp = os.path.join(d, "stamps")
    args = {r: (stamp, r) for r in range(n)}
    if IMPL == "aiolaunch":

        async def go():
            t0 = mono()
            ctx = await al_start(bw.fn_stamp, args, method=method)
            t1 = mono()
            res = await ctx.wait()
            check(not res.is_failed(), f"failures: {res.failures}")
            return t0, t1

        t0, t1 = asyncio.run(go())
    elif IMPL == "torch":
        t0 = mono()
        pc = torch_start(bw.fn_stamp, args, method=method)
        t1 = mono()
        res = pc.wait(period=0.1)
        pc.close()
        check(res is not None and not res.is_failed(), f"failures: {res and res.failures}")
    else:
        import multiprocessing as mp

        ctx = mp.get_context(method)
        t0 = mono()
        procs = [ctx.Process(target=bw.fn_stamp, args=args[r]) for r in range(n)]
        for pr in procs:
            pr.start()
        t1 = mono()
        for pr in procs:
            pr.join()
        check([pr.exitcode for pr in procs] == [0] * n, "exit codes")
    st = read_stamps(stamp).get("start", {})
    check(len(st) == n, f"{len(st)}/{n} workers ran")
    return {"all_running_ms": (max(st.values()) - t0) * 1e3, "call_returned_ms": (t1 - t0) * 1e3}


def _exit_bench(variant: str, p: dict, fn: bool) -> dict:
    """Workers block on a gate; once all are ready it opens. code 0: every worker
    exits 0 at once, latency = wait() return - last exit stamp. code 1: rank 0
    exits 1, the others keep running; latency = wait() return - rank 0's exit
    stamp (includes stopping the others)."""
    import _bench_workers as bw

    n, code = p["n"], p["code"]
    d = tmpdir()
    stamp = os.path.join(d, "stamps")
    gate = Gate(d)
    hang = lambda r: int(code != 0 and r != 0)  # noqa: E731
    if fn:
        entry = bw.fn_gate
        args = {r: (stamp, r, gate.path, code if r == 0 else 0, hang(r)) for r in range(n)}
    else:
        entry = WORKER[0]
        args = bin_args(n, lambda r: ("gate", stamp, r, gate.path, code if r == 0 else 0, hang(r)))
    pids: dict[int, int] = {}
    obs: list[ExitObserver] = []
    if IMPL == "aiolaunch":

        async def go():
            ctx = await al_start(entry, args, method="spawn")
            pids.update(ctx.pids())
            obs.append(ExitObserver(pids, d))
            gate.release_when_ready(stamp, n)
            res = await ctx.wait()
            return mono(), res

        t_end, res = asyncio.run(go())
        failed = {r: f.exitcode for r, f in res.failures.items()}
    elif IMPL == "torch":
        pc = torch_start(entry, args, method="spawn")
        pids.update(pc.pids())
        obs.append(ExitObserver(pids, d))
        gate.release_when_ready(stamp, n)
        res = pc.wait(period=torch_period(variant))
        t_end = mono()
        pc.close()
        check(res is not None, "wait returned None")
        failed = {r: f.exitcode for r, f in res.failures.items()}
    else:

        async def go():
            if fn:
                import multiprocessing as mp

                mctx = mp.get_context("spawn")
                procs = [mctx.Process(target=entry, args=args[r]) for r in range(n)]
                for pr in procs:
                    pr.start()
                pids.update({i: pr.pid for i, pr in enumerate(procs)})
                obs.append(ExitObserver(pids, d))
                loop = asyncio.get_running_loop()
                futs = []
                for pr in procs:
                    fut = loop.create_future()
                    loop.add_reader(pr.sentinel, lambda f=fut: f.done() or f.set_result(None))
                    futs.append(fut)
                gate.release_when_ready(stamp, n)
                pending = set(futs)
                fails = {}
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for f in done:
                        i = futs.index(f)
                        loop.remove_reader(procs[i].sentinel)
                        procs[i].join()
                        if procs[i].exitcode:
                            fails[i] = procs[i].exitcode
                    if fails:
                        for pr in procs:
                            if pr.exitcode is None:
                                pr.terminate()
                        for pr in procs:
                            pr.join()
                        for f2 in pending:
                            loop.remove_reader(procs[futs.index(f2)].sentinel)
                        break
                return mono(), fails
            procs, _ = await raw_spawn(args)
            pids.update({i: pr.pid for i, pr in enumerate(procs)})
            obs.append(ExitObserver(pids, d))
            gate.release_when_ready(stamp, n)
            tasks = {asyncio.ensure_future(pr.wait()): i for i, pr in enumerate(procs)}
            pending, fails = set(tasks), {}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                fails.update({tasks[t]: t.result() for t in done if t.result()})
                if fails:
                    for pr in procs:
                        if pr.returncode is None:
                            pr.terminate()
                    await asyncio.gather(*pending)
                    break
            return mono(), fails

        t_end, failed = asyncio.run(go())
    st = read_stamps(stamp)
    check(len(st.get("ready", {})) == n, f"{len(st.get('ready', {}))}/{n} workers ready")
    exits = st.get("exit", {})
    gone = obs[0].join() if obs else {}
    if len(WORKER) == 1:
        check(len(gone) == n, f"observer saw {len(gone)}/{n} exits")
    else:  # no C compiler: no observer, fall back to the worker's own stamps
        gone = exits
    if code == 0:
        check(failed == {}, f"unexpected failures {failed}")
        check(len(exits) == n, f"{len(exits)}/{n} exit stamps")
        lat = t_end - max(exits.values())
        det = t_end - max(gone.values())
    else:
        check(failed.get(0) == 1, f"failures {failed}, expected rank 0 with exit code 1")
        # torch also lists the workers it stopped (exit code -15); aiolaunch and
        # the floor report the deciding failure only
        others = {r: c for r, c in failed.items() if r != 0}
        check(
            (IMPL == "torch" and set(others.values()) <= {-signal.SIGTERM}) or not others,
            f"workers stopped on purpose reported as failures: {others}",
        )
        lat = t_end - exits[0]
        det = t_end - gone[0]
    for r, pid in pids.items():
        check(proc_gone(pid), f"rank {r} pid {pid} still present after wait()")
    return {"detect_ms": det * 1e3, "user_exit_to_return_ms": lat * 1e3}


def bench_exit_bin(variant, p):
    return _exit_bench(variant, p, fn=False)


def bench_exit_fn(variant, p):
    return _exit_bench(variant, p, fn=True)


def bench_shutdown(variant: str, p: dict) -> dict:
    n, mode, timeout = p["n"], p["mode"], p["timeout"]
    d = tmpdir()
    stamp = os.path.join(d, "stamps")
    args = bin_args(n, lambda r: (mode, stamp, r))
    if IMPL == "aiolaunch":

        async def go():
            ctx = await al_start(WORKER[0], args)
            pids = ctx.pids()
            await wait_stamps(stamp, n)
            c0, t0 = cpu_s(), mono()
            await ctx.close(timeout=timeout)
            return mono() - t0, cpu_s() - c0, pids

        dt, cpu, pids = asyncio.run(go())
    elif IMPL == "torch":
        pc = torch_start(WORKER[0], args)
        pids = pc.pids()
        wait_stamps_blocking(stamp, n)
        c0, t0 = cpu_s(), mono()
        pc.close(timeout=timeout)
        dt, cpu = mono() - t0, cpu_s() - c0
    else:

        async def go():
            procs, _ = await raw_spawn(args)
            await wait_stamps(stamp, n)
            c0, t0 = cpu_s(), mono()
            for pr in procs:
                pr.terminate()
            try:
                await asyncio.wait_for(asyncio.gather(*(pr.wait() for pr in procs)), timeout)
            except asyncio.TimeoutError:
                for pr in procs:
                    if pr.returncode is None:
                        pr.kill()
                await asyncio.gather(*(pr.wait() for pr in procs))
            return mono() - t0, cpu_s() - c0, {i: pr.pid for i, pr in enumerate(procs)}

        dt, cpu, pids = asyncio.run(go())
    for r, pid in pids.items():
        check(proc_gone(pid), f"rank {r} pid {pid} still present after close()")
    out = {"close_ms": dt * 1e3, "close_cpu_ms": cpu * 1e3}
    if mode == "ignore":
        check(
            dt >= timeout - 0.005, f"close() returned after {dt:.3f}s, before the {timeout}s grace"
        )
        out["overshoot_ms"] = (dt - timeout) * 1e3
    return out


def bench_tee_latency(variant: str, p: dict) -> dict:
    n, lines, us = p["n"], p["lines"], p["interval_us"]
    d = tmpdir()
    args = bin_args(n, lambda r: ("lines", lines, us))
    w = StampWriter()
    old = sys.stdout
    sys.stdout = w
    try:
        if IMPL == "aiolaunch":

            async def go():
                ctx = await al_start(WORKER[0], args, tee="OUT", log_dir=os.path.join(d, "logs"))
                return await ctx.wait()

            res = asyncio.run(go())
        elif IMPL == "torch":
            pc = torch_start(WORKER[0], args, tee="OUT")
            res = pc.wait(period=0.1)
            pc.close()
        else:

            async def go():
                procs, pipes = await raw_spawn(args, out_dir=os.path.join(d, "logs"), tee=True)
                await asyncio.gather(*(pr.wait() for pr in procs))
                await asyncio.gather(*(pp.done for pp in pipes))

            asyncio.run(go())
            res = None
    finally:
        sys.stdout = old
    check(res is None or not res.is_failed(), "workers failed")
    lat: list[float] = []
    seen = {r: 0 for r in range(n)}
    for t, text in w.chunks:
        for line in text.splitlines():
            if not line.startswith("[b"):
                continue
            pre, _, ts = line.partition("]:")
            seen[int(pre[2:])] += 1
            lat.append((t - float(ts)) * 1e3)
    check(
        all(v == lines for v in seen.values()), f"lines received per rank {seen}, expected {lines}"
    )
    return {"line_ms": lat}


#: idle_cpu: time after every worker started before the measurement begins
#: (the group's start-up work - control socket, folders - has settled).
SETTLE_S = 1.0


def bench_idle_cpu(variant: str, p: dict) -> dict:
    """Supervisor CPU while n workers sleep, measured once start-up settled
    (the stamps of every worker, then SETTLE_S)."""
    n, secs = p["n"], p["secs"]
    d = tmpdir()
    stamp = os.path.join(d, "stamps")
    args = bin_args(n, lambda r: ("sleep", stamp, r))
    if IMPL == "aiolaunch":

        async def go():
            ctx = await al_start(WORKER[0], args)
            await wait_stamps(stamp, n)
            await asyncio.sleep(SETTLE_S)
            c0, t0 = cpu_s(), mono()
            res = await ctx.wait(timeout=secs)
            c1, t1 = cpu_s(), mono()
            check(res is None, "wait(timeout) returned a result with workers sleeping")
            await ctx.close()
            return c1 - c0, t1 - t0

        cpu, dt = asyncio.run(go())
    elif IMPL == "torch":
        pc = torch_start(WORKER[0], args)
        wait_stamps_blocking(stamp, n)
        time.sleep(SETTLE_S)
        c0, t0 = cpu_s(), mono()
        res = pc.wait(timeout=secs, period=torch_period(variant))
        cpu, dt = cpu_s() - c0, mono() - t0
        check(res is None, "wait(timeout) returned a result with workers sleeping")
        pc.close()
    else:

        async def go():
            procs, _ = await raw_spawn(args)
            await wait_stamps(stamp, n)
            await asyncio.sleep(SETTLE_S)
            c0, t0 = cpu_s(), mono()
            done, _ = await asyncio.wait(
                [asyncio.ensure_future(pr.wait()) for pr in procs], timeout=secs
            )
            c1, t1 = cpu_s(), mono()
            check(not done, "workers exited")
            for pr in procs:
                pr.terminate()
            await asyncio.gather(*(pr.wait() for pr in procs))
            return c1 - c0, t1 - t0

        cpu, dt = asyncio.run(go())
    check(abs(dt - secs) < 0.5 + 0.1 * secs, f"wait(timeout={secs}) took {dt:.2f}s")
    return {"cpu_ms_per_s": cpu * 1e3 / dt}


def bench_scale(variant: str, p: dict) -> dict:
    n = p["n"]
    d = tmpdir()
    stamp = os.path.join(d, "stamps")
    gate = Gate(d)
    args = bin_args(n, lambda r: ("gate", stamp, r, gate.path, 0, 0))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM: peak RSS of this trial only
    except OSError:
        pass
    fds0 = nfds()
    out: dict = {}

    def sample(t0: float) -> None:
        out["launch_ms"] = (mono() - t0) * 1e3
        out["fds"] = nfds() - fds0
        out["threads"] = status_kb("Threads")

    if IMPL == "aiolaunch":

        async def go():
            t0 = mono()
            ctx = await al_start(WORKER[0], args)
            await wait_stamps(stamp, n)
            sample(t0)
            gate.release()
            res = await ctx.wait()
            check(not res.is_failed(), f"{len(res.failures)} failures")
            return t0, mono()

        t0, t1 = asyncio.run(go())
    elif IMPL == "torch":
        t0 = mono()
        pc = torch_start(WORKER[0], args)
        wait_stamps_blocking(stamp, n)
        sample(t0)
        gate.release()
        res = pc.wait(period=torch_period(variant))
        t1 = mono()
        pc.close()
        check(res is not None and not res.is_failed(), "failures")
    else:

        async def go():
            t0 = mono()
            procs, _ = await raw_spawn(args)
            await wait_stamps(stamp, n)
            sample(t0)
            gate.release()
            rcs = await asyncio.gather(*(pr.wait() for pr in procs))
            check(rcs == [0] * n, "exit codes")
            return t0, mono()

        t0, t1 = asyncio.run(go())
    check(len(read_stamps(stamp).get("exit", {})) == n, "not every worker ran to its exit")
    out["reap_ms"] = (t1 - gate.released_at) * 1e3
    out["wall_ms"] = (t1 - t0) * 1e3
    out["peak_rss_MB"] = status_kb("VmHWM") / 1024
    out["fds_after"] = nfds() - fds0
    check(out["fds_after"] <= 2, f"{out['fds_after']} fds left open after wait()")
    return out


BENCHES = {k[6:]: v for k, v in globals().items() if k.startswith("bench_")}


def setup(impl: str) -> None:
    global IMPL, WORKER, TMP
    IMPL = impl
    WORKER = json.loads(os.environ["BENCH_WORKER"])
    TMP = os.environ["BENCH_TMP"]
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if impl == "aiolaunch":
        import aiolaunch  # noqa: F401
    elif impl == "torch":
        import torch.distributed.elastic.multiprocessing  # noqa: F401


def main() -> None:
    setup(sys.argv[1])
    out = os.fdopen(int(os.environ["BENCH_RESULT_FD"]), "w", buffering=1)
    out.write(json.dumps({"ok": True, "ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            metrics = BENCHES[cmd["bench"]](cmd["variant"], cmd["params"])
            reply = {"ok": True, "metrics": metrics}
        except Check as e:
            reply = {"ok": False, "error": f"check failed: {e}"}
        except BaseException as e:
            reply = {"ok": False, "error": "".join(traceback.format_exception(e))[-2000:]}
        # trials must not leak signal handlers into each other
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
