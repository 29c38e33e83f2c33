"""Resilience across hosts (issue #45): a host lost, survived in seconds; beside torchrun.

    python benchmarks/bench_hosts.py [--only spare,spares2,agents,check,soak] [--sizes 8,16,32]
                                     [--trials 2] [--baseline SRC] [--json OUT] [--keep]

Needs root (network namespaces), iproute2 and torch; ``soak`` needs etcd.
Every job runs ``tests/_hostnet.py``'s worker: plain ``env://`` gloo
(``init_process_group("gloo")``, no store of its own, no key prefix), which
stamps its first all_reduce with ``time.monotonic()`` - one clock for every
namespace - then reduces until told to stop.

- ``spare`` (``spares2``): 3 (4) namespace hosts, c10d on host A,
  ``--nnodes 2``. A and B run; one (two) spare host(s) join mid-run (20 s
  before the loss: an agent imports torch first);
  ``disturbed`` says whether that started a new round. Host B is lost
  (SIGKILL to every process in it); ``resume_s`` = the kill -> the first
  all_reduce of the next round (the spare's); ``new_rounds``: rounds started
  after the kill (1 is right); then the job is told to stop: ``codes`` are
  the exit statuses of the agents left.
- ``agents``: N agents on this machine (loopback), ``--nnodes 2:N``, one
  worker each. ``start_s``: the first agent's start -> every rank's first
  all_reduce. After 30 s of training (a zygote's deferred imports are done by
  then; a real job fails hours in), one agent and its worker are SIGKILLed;
  ``resume_s`` = the kill -> the survivors' first all_reduce (the later).
- ``check``: one machine, 2 gloo ranks, one restart (rank 1 fails after its
  first all_reduce): the failure -> the next attempt's first all_reduce,
  without a health check, with ``--health-check true``, and with ``sleep 0.2``
  (the check runs while the failed attempt is stopped: it costs the restart
  only what it takes beyond that).
- ``soak`` (aiolaunch, etcd-v3 on a host of its own): 4 training hosts,
  ``--nnodes 2`` (two spares). ``--failures`` times: a random host is lost
  at a random moment, and an agent is started on it again (a returning host:
  a spare). A job that does not resume within 60 s is a loss (the job is
  started anew). At the end no process of the run may be left anywhere.

Launchers: ``aiolaunch`` (this tree), ``aiolaunch-base`` (``--baseline
SRC``: another tree's ``src``, e.g. ``git archive main src | tar -x -C
/tmp/base``), ``torchrun`` (torch 2.13's). Trials are interleaved. Report the
host's load (printed) with any number: the host is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from _hostnet import WORKER, Net, read_stamps  # noqa: E402

#: seconds a lost job gets to resume before it counts as lost
RESUME_TIMEOUT = 90.0


def launcher_argv(name: str) -> list[str]:
    module = "torch.distributed.run" if name == "torchrun" else "aiolaunch"
    return [sys.executable, "-m", module]


def launcher_env(name: str, baseline: str | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": os.environ.get("LOGLEVEL", "INFO")}
    if name == "aiolaunch-base":
        assert baseline is not None
        env["PYTHONPATH"] = baseline
    return env


def wait_until(check: Any, timeout: float, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(step)
    return None


def after(out: Path, t: float) -> list[dict[str, Any]]:
    return [s for s in read_stamps(out) if s["t"] > t]


def at_least(n: int, out: Path, t: float = -1.0) -> Any:
    """A check: the stamps after ``t`` once there are ``n``, else ``None``."""

    def check() -> list[dict[str, Any]] | None:
        got = after(out, t)
        return got if len(got) >= n else None

    return check


def tree(pid: int) -> list[int]:
    """``pid`` and every descendant (by parent pid)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
                kids.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def kill_all(pids: list[int]) -> float:
    """Lose them at once: SIGSTOP all (none reacts to the others' deaths), then SIGKILL."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            at = time.monotonic()
    return at


def leftovers(tag: str) -> list[int]:
    """Processes whose command line or environment names this run's folder."""
    found = []
    needle = tag.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        for name in ("cmdline", "environ"):
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/{name}").read_bytes():
                    found.append(int(entry))
                    break
    return found


def stop_job(out: Path, procs: list[subprocess.Popen[bytes]], timeout: float) -> list[Any]:
    (out / "stop").write_text("")
    codes: list[Any] = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append("hung")
    for p in procs:
        if p.poll() is None:
            kill_all(tree(p.pid))
            p.wait()
    return codes


# -- spare: namespace hosts --------------------------------------------------------
def spare_trial(launcher: str, spares: int, tmp: Path, baseline: str | None) -> dict[str, Any]:
    net = Net(2 + spares)
    net.create()
    out = tmp / "out"
    out.mkdir()
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**launcher_env(launcher, baseline), "OUT": str(out)}
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(i: int) -> None:
        argv = [
            *launcher_argv(launcher),
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={net.addrs[0]}:29400",
            "--rdzv-id=spare",
            f"--rdzv-conf=join_timeout=300,is_host={int(i == 0)}",
            f"--local-addr={net.addrs[i]}",
            "--max-restarts=3",
            str(script),
        ]
        procs[i] = net.popen(i, argv, env, tmp / f"agent{i}.log")

    result: dict[str, Any] = {"launcher": launcher, "spares": spares}
    try:
        start(0)
        start(1)
        first = wait_until(at_least(2, out), 300)
        if not first:
            result["error"] = "the job did not start"
            return result
        for k in range(spares):
            start(2 + k)
        # The spares' agents are up and waiting (or disturbed the round) by
        # now: an agent imports torch first, seconds on a loaded machine.
        time.sleep(20)
        result["disturbed"] = len(read_stamps(out)) > 2
        kill = net.kill(1)
        resumed = wait_until(at_least(2, out, kill), RESUME_TIMEOUT)
        if resumed:
            result["resume_s"] = round(max(s["t"] for s in resumed[:2]) - kill, 3)
            result["restart_counts"] = sorted({s["restart"] for s in resumed})
        else:
            result["resume_s"] = None  # never: the job is lost
        time.sleep(8)  # a second round, if any, shows up by now
        result["new_rounds"] = len(after(out, kill)) // 2
        result["codes"] = stop_job(out, [p for i, p in sorted(procs.items()) if i != 1], 90)
        return result
    finally:
        for p in procs.values():
            if p.poll() is None:
                kill_all(tree(p.pid))
                p.wait()
        net.remove()


# -- agents: N agents on this machine ------------------------------------------------
def agents_trial(launcher: str, n: int, tmp: Path, baseline: str | None) -> dict[str, Any]:
    out = tmp / "out"
    out.mkdir()
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**launcher_env(launcher, baseline), "OUT": str(out), "NODE_ADDR": "127.0.0.1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        *launcher_argv(launcher),
        f"--nnodes=2:{n}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=agents",
        "--rdzv-conf=join_timeout=600",
        "--local-addr=127.0.0.1",
        "--max-restarts=3",
        str(script),
    ]
    procs: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {"launcher": launcher, "n": n}

    def listening() -> bool:
        with socket.socket() as c:
            return c.connect_ex(("127.0.0.1", port)) == 0

    t0 = time.monotonic()
    try:
        for i in range(n):
            with open(tmp / f"agent{i}.log", "ab") as log:
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            if i == 0 and not wait_until(listening, 120):  # agent 0 hosts the store
                result["error"] = "no store"
                return result
        started = wait_until(at_least(n, out), 900)
        if not started:
            result["error"] = f"only {len(read_stamps(out))} of {n} ranks started"
            return result
        result["start_s"] = round(max(s["t"] for s in started) - t0, 2)
        time.sleep(30)
        kill = kill_all(tree(procs[-1].pid))
        resumed = wait_until(at_least(n - 1, out, kill), 240)
        result["resume_s"] = None if not resumed else round(max(s["t"] for s in resumed) - kill, 2)
        result["codes"] = stop_job(out, procs[:-1], 180)
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                kill_all(tree(p.pid))
            p.wait()


# -- check: what a passing health check costs a restart -----------------------------
RESTART_WORKER = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
what = "fail" if attempt == 0 else "first"
with open(sys.argv[1], "a") as f:
    f.write(f"{attempt} {dist.get_rank()} {what} {time.monotonic()}\\n")
if attempt == 0 and dist.get_rank() == 1:
    os._exit(1)
dist.barrier() if attempt else time.sleep(30)
"""

#: variant -> the health check (None: none)
CHECKS = {"no check": None, "--health-check true": "true", "check sleep 0.2": "sleep 0.2"}


def check_trial(variant: str, tmp: Path) -> dict[str, Any]:
    """One standalone job (2 gloo ranks, one restart): rank 1's failure ->
    the later first all_reduce of the next attempt."""
    script = tmp / "worker.py"
    script.write_text(RESTART_WORKER)
    stamps = tmp / "stamps"
    argv = [*launcher_argv("aiolaunch"), "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    check = CHECKS[variant]
    if check is not None:
        argv.append(f"--health-check={check}")
    env = launcher_env("aiolaunch", None) | {"LOGLEVEL": "WARNING"}
    with open(tmp / "agent.log", "ab") as log:
        code = subprocess.run(
            [*argv, str(script), str(stamps)], env=env, stdout=log, stderr=subprocess.STDOUT,
            timeout=300, check=False,
        ).returncode  # fmt: skip
    rows = [line.split() for line in stamps.read_text().splitlines()] if stamps.exists() else []
    fail = [float(r[3]) for r in rows if r[2] == "fail" and r[1] == "1"]
    first = [float(r[3]) for r in rows if r[2] == "first"]
    ok = code == 0 and fail and len(first) == 2
    turnaround = round((max(first) - fail[0]) * 1e3, 1) if ok else None
    return {"variant": variant, "turnaround_ms": turnaround, "code": code}


# -- soak --------------------------------------------------------------------------
def soak(failures: int, tmp: Path, seed: int) -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parent / "tests" / "engines"))
    from _etcd import etcd_server  # tests/engines/_etcd.py

    rng = random.Random(seed)
    hosts = 4
    net = Net(1 + hosts)  # host 0: etcd only
    net.create()
    tag = str(tmp)
    counts = {"failures": 0, "participant_lost": 0, "resumed": 0, "job_losses": 0}
    turnarounds: list[float] = []
    try:
        with etcd_server(tmp / "etcd", host=net.addrs[0], port=2379, netns=net.names[0]) as ep:
            job = 0
            while counts["failures"] < failures:
                counts["failures"] += _soak_job(net, ep, tmp / f"job{job}", rng, failures - counts[
                    "failures"], counts, turnarounds)  # fmt: skip
                job += 1
    finally:
        for i in range(len(net.names)):
            net.kill(i)
        net.remove()
    time.sleep(2)
    left = leftovers(tag)
    return {
        **counts,
        "left_processes": len(left),
        "turnaround_p50_s": round(statistics.median(turnarounds), 2) if turnarounds else None,
        "turnaround_max_s": round(max(turnarounds), 2) if turnarounds else None,
        "turnarounds_s": sorted(round(t, 2) for t in turnarounds),
    }


def _soak_job(
    net: Net,
    endpoint: str,
    tmp: Path,
    rng: random.Random,
    budget: int,
    counts: dict[str, int],
    turnarounds: list[float],
) -> int:
    """One job, losing hosts until ``budget`` failures or a job loss; failures done."""
    tmp.mkdir()
    out = tmp / "out"
    out.mkdir()
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**launcher_env("aiolaunch", None), "OUT": str(out), "LOGLEVEL": "WARNING"}
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(i: int) -> None:
        argv = [
            *launcher_argv("aiolaunch"),
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=etcd-v3",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id=soak-{tmp.name}",
            "--rdzv-conf=join_timeout=600",
            f"--local-addr={net.addrs[i]}",
            "--max-restarts=100000",
            str(script),
        ]
        procs[i] = net.popen(i, argv, env, tmp / f"agent{i}-{time.monotonic():.0f}.log")

    done = 0
    try:
        for i in range(1, len(net.names)):
            start(i)
        if not wait_until(at_least(2, out), 300):
            counts["job_losses"] += 1
            return 1
        while done < budget:
            time.sleep(rng.uniform(0.5, 4.0))  # a random moment
            stamps = read_stamps(out)
            latest = max(s["restart"] for s in stamps)
            running = {s["host"] for s in stamps if s["restart"] == latest}
            victim = rng.randrange(1, len(net.names))
            participant = net.addrs[victim] in running
            kill = net.kill(victim)
            procs.pop(victim).wait()
            done += 1
            time.sleep(rng.uniform(0.0, 3.0))
            start(victim)  # the host comes back: a spare
            if not participant:
                continue
            counts["participant_lost"] += 1
            resumed = wait_until(at_least(2, out, kill), 60)
            if not resumed:
                counts["job_losses"] += 1
                return done
            counts["resumed"] += 1
            turnarounds.append(max(s["t"] for s in resumed[:2]) - kill)
        return done
    finally:
        live = [p for p in procs.values() if p.poll() is None]
        stop_job(out, live, 120)
        for i in range(1, len(net.names)):
            net.kill(i)


def median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return round(statistics.median(got), 2) if got else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="spare,spares2,agents")
    p.add_argument("--sizes", default="8,16,32")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--launchers", default="aiolaunch,torchrun")
    p.add_argument("--baseline", default=None, help="another tree's src (aiolaunch-base)")
    p.add_argument("--failures", type=int, default=100)
    p.add_argument("--seed", type=int, default=45)
    p.add_argument(
        "--worker",
        default="env",
        choices=("env", "prefixed"),
        help="env: plain env:// workers; prefixed: a store prefix per restart (torchrun's "
        "workaround for the keys its store keeps across rounds)",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the jobs' folders (logs)")
    args = p.parse_args()
    if args.worker == "prefixed":
        os.environ["STORE_PREFIX"] = "1"
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    launchers = args.launchers.split(",")
    if args.baseline and "aiolaunch-base" not in launchers:
        launchers.insert(1, "aiolaunch-base")
    only = args.only.split(",")
    print(f"load average at start: {os.getloadavg()}", flush=True)
    rows: list[dict[str, Any]] = []
    prefix = "bench_hosts_"
    kept = tempfile.mkdtemp(prefix=prefix) if args.keep else None
    folder = contextlib.nullcontext(kept) if kept else tempfile.TemporaryDirectory(prefix=prefix)
    with folder as root:
        for what in ("spare", "spares2"):
            if what not in only:
                continue
            for trial in range(args.trials):
                for launcher in launchers:
                    tmp = Path(root, f"{what}-{launcher}-{trial}")
                    tmp.mkdir()
                    row = spare_trial(launcher, 2 if what == "spares2" else 1, tmp, args.baseline)
                    rows.append({"bench": what, **row})
                    print(json.dumps(rows[-1]), flush=True)
        if "agents" in only:
            for n in [int(x) for x in args.sizes.split(",")]:
                for trial in range(args.trials):
                    for launcher in launchers:
                        tmp = Path(root, f"agents{n}-{launcher}-{trial}")
                        tmp.mkdir()
                        rows.append({"bench": "agents", **agents_trial(launcher, n, tmp, (
                            args.baseline))})  # fmt: skip
                        print(json.dumps(rows[-1]), flush=True)
        if "check" in only:
            for trial in range(max(args.trials, 5)):
                for variant in CHECKS:
                    tmp = Path(root, f"check-{trial}-{variant.replace(' ', '_')}")
                    tmp.mkdir()
                    rows.append({"bench": "check", **check_trial(variant, tmp)})
                    print(json.dumps(rows[-1]), flush=True)
        if "soak" in only:
            tmp = Path(root, "soak")
            tmp.mkdir()
            rows.append({"bench": "soak", **soak(args.failures, tmp, args.seed)})
            print(json.dumps(rows[-1]), flush=True)
    print(f"load average at end: {os.getloadavg()}")
    if kept:
        print(f"the jobs' folders: {kept}")
    for row in rows:
        row.setdefault("worker", args.worker)
    summary(rows, launchers)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load": os.getloadavg()}, indent=1))
    return 0


def summary(rows: list[dict[str, Any]], launchers: list[str]) -> None:
    print("\nmedians (s); None = never resumed")
    for what in ("spare", "spares2"):
        for launcher in launchers:
            got = [r for r in rows if r["bench"] == what and r["launcher"] == launcher]
            if got:
                print(
                    f"{what:8} {launcher:15} resume {median([r.get('resume_s') for r in got])}"
                    f"  disturbed {[r.get('disturbed') for r in got]}"
                    f"  new rounds {[r.get('new_rounds') for r in got]}"
                    f"  codes {[r.get('codes') for r in got]}"
                )
    for n in sorted({r["n"] for r in rows if r["bench"] == "agents"}):
        for launcher in launchers:
            got = [r for r in rows if r["bench"] == "agents" and r["n"] == n]
            got = [r for r in got if r["launcher"] == launcher]
            if got:
                print(
                    f"agents {n:3} {launcher:15} start {median([r.get('start_s') for r in got])}"
                    f"  resume {median([r.get('resume_s') for r in got])}"
                    f"  codes {[r.get('codes') for r in got]}"
                )
    for variant in CHECKS:
        got = [r["turnaround_ms"] for r in rows if r.get("variant") == variant]
        if got:
            print(f"restart with {variant:22} turnaround ms median {median(got)}  all {got}")
    for r in rows:
        if r["bench"] == "soak":
            print("soak", r)


if __name__ == "__main__":
    sys.exit(main())
