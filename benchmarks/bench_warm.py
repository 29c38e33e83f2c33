"""Warm start rows of run.py: first start and restart, aiolaunch vs --no-preload vs torchrun.

Each trial runs the CLI (``python -m aiolaunch`` or ``python -m
torch.distributed.run``) on ``_warm_script.py`` in a session of its own; a
trial that does not end within its timeout is killed (the whole session) and
reported as hung.

- ``warm_start``: ``--nproc-per-node N`` workers; ``all_imported_ms`` = from
  just before the launcher's ``exec`` to the last rank's stamp right after
  ``import torch``.
- ``warm_restart``: ``--standalone --nproc-per-node 2 --max-restarts 1``, a
  gloo DDP job; ``turnaround_ms`` = from rank 1's failure (stamped right
  before its ``sys.exit(1)``, after its first all_reduce) to the first
  all_reduce of the next attempt (the later of the two ranks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_warm_script.py")

#: variant -> the launcher command line before its own options
LAUNCHERS = {
    "aiolaunch": [sys.executable, "-m", "aiolaunch"],
    "aiolaunch-cold": [sys.executable, "-m", "aiolaunch", "--no-preload"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def read_stamps(path: str) -> dict[tuple[int, int, str], float]:
    out: dict[tuple[int, int, str], float] = {}
    try:
        with open(path) as f:
            for line in f:
                a, r, what, t = line.split()
                out[int(a), int(r), what] = float(t)
    except FileNotFoundError:
        pass
    return out


def kill_job(p: subprocess.Popen[bytes], stamp: str) -> None:
    """Stop a job for good: the launcher's session, then every process of the job.

    torchrun starts each worker in a session of its own, so a hung torchrun's
    workers outlive a kill of its session: they are found by the job's own
    ``BENCH_STAMP`` in their environment.
    """
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
    needle = f"BENCH_STAMP={stamp}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass


def run_launcher(
    variant: str,
    opts: list[str],
    args: list[str],
    env: dict[str, str],
    cwd: str,
    timeout: float,
    script: str = SCRIPT,
) -> tuple[int | None, float, str]:
    """Run one job of ``script``: ``(exit status or None if it hung, t0, stderr tail)``.

    ``t0``: ``time.monotonic()`` just before the launcher started.
    """
    argv = [*LAUNCHERS[variant], *opts, script, *args]
    err_path = os.path.join(cwd, "launcher.err")
    with open(err_path, "wb") as err:
        t0 = time.monotonic()
        p = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
        try:
            rc: int | None = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_job(p, env["BENCH_STAMP"])
    with open(err_path, "rb") as f:
        tail = f.read()[-800:].decode(errors="replace")
    return rc, t0, tail


def warm_trial(variant: str, params: dict, env: dict[str, str], tmp: str) -> dict:
    d = tempfile.mkdtemp(dir=tmp)
    stamp = os.path.join(d, "stamps")
    env = dict(env, BENCH_STAMP=stamp)
    mode, n = params["mode"], params["n"]
    opts = ["--standalone", "--nproc-per-node", str(n)]
    if mode == "restart":
        opts += ["--max-restarts", "1"]
    rc, t0, tail = run_launcher(variant, opts, [mode], env, d, params.get("timeout", 180))
    st = read_stamps(stamp)
    if rc is None:
        return {"ok": False, "error": f"hung (killed after {params.get('timeout', 180)} s): {tail}"}
    if rc != 0:
        return {"ok": False, "error": f"exit status {rc}: {tail}"}
    if mode == "start":
        got = [st[0, r, "imported"] for r in range(n) if (0, r, "imported") in st]
        if len(got) != n:
            return {"ok": False, "error": f"{len(got)}/{n} ranks imported torch"}
        return {"ok": True, "metrics": {"all_imported_ms": (max(got) - t0) * 1e3}}
    firsts = [st[1, r, "first"] for r in range(n) if (1, r, "first") in st]
    if (0, 1, "fail") not in st or len(firsts) != n:
        return {"ok": False, "error": f"attempt 1 did not reach its first all_reduce: {st}"}
    return {"ok": True, "metrics": {"turnaround_ms": (max(firsts) - st[0, 1, "fail"]) * 1e3}}
