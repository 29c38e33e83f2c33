"""A real single-node Slurm (Debian's ``slurm-wlm`` 22.05 and ``munge``) that
the tests start in a temporary folder, and the signal scenarios run in it.

:class:`Slurm` writes a ``slurm.conf`` (the node declared with 16 CPUs so the
scenarios' jobs run side by side; ``proctrack/pgid``: Slurm signals and kills
a step's process group only, so what reaches a launcher's workers - and
whether any survive the job - is the launcher's doing; ``KillWait=5``;
``jobcomp/filetxt``) and runs ``munged``, ``slurmctld`` and ``slurmd`` in the
foreground as its children. :func:`run_scenario` submits one job of a
launcher (aiolaunch, or torchrun for the closing note's matrix,
tests/engines/slurm_matrix.py), signals it as ``scancel`` does, and reports
what Slurm recorded and which of the job's processes outlived it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = ["SCENARIOS", "Outcome", "Scenario", "Slurm", "missing", "run_scenario", "slurm"]

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "scontrol")

# The workers: write their pid, note a SIGUSR1 (a checkpoint request), run
# until the test says stop; rank 1 exits with argv[2] when one is given.
WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    d, rank = sys.argv[1], os.environ["LOCAL_RANK"]
    def on_usr1(signum, frame):
        open(os.path.join(d, f"{rank}.usr1"), "w").close()
    signal.signal(signal.SIGUSR1, on_usr1)
    if len(sys.argv) > 2 and rank == "1":
        sys.exit(int(sys.argv[2]))
    with open(os.path.join(d, f"{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(d, f"{rank}.tmp"), os.path.join(d, f"{rank}.pid"))
    while not os.path.exists(os.path.join(d, "stop")):
        time.sleep(0.1)
    """
)


def missing() -> str | None:
    """Why the Slurm tests cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "a private Slurm (slurmd, SlurmUser=root) needs root"
    absent = [
        b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")
    ]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge; .ci/run does)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Slurm:
    """munged + slurmctld + slurmd for one node, all under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        r = self.root
        for sub in ("state", "spool"):
            (r / sub).mkdir()
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(
            textwrap.dedent(
                f"""\
                ClusterName=aiolaunch
                SlurmctldHost={self.node}(127.0.0.1)
                SlurmctldPort={_free_port()}
                SlurmdPort={_free_port()}
                SlurmUser=root
                SlurmdUser=root
                AuthType=auth/munge
                AuthInfo=socket={r}/munge.sock
                CredType=cred/munge
                StateSaveLocation={r}/state
                SlurmdSpoolDir={r}/spool
                SlurmctldPidFile={r}/slurmctld.pid
                SlurmdPidFile={r}/slurmd.pid
                SlurmctldLogFile={r}/slurmctld.log
                SlurmdLogFile={r}/slurmd.log
                ProctrackType=proctrack/pgid
                TaskPlugin=task/none
                MpiDefault=none
                SchedulerType=sched/builtin
                SelectType=select/cons_tres
                SelectTypeParameters=CR_CPU
                SlurmdParameters=config_overrides
                JobCompType=jobcomp/filetxt
                JobCompLoc={r}/jobcomp.txt
                AccountingStorageType=accounting_storage/none
                JobAcctGatherType=jobacct_gather/none
                KillWait=5
                MinJobAge=3600
                ReturnToService=2
                InactiveLimit=0
                NodeName={self.node} NodeAddr=127.0.0.1 CPUs=16 State=UNKNOWN
                PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
                """
            )
        )

    def start(self) -> None:
        self.root.chmod(0o755)  # munged wants its socket's folder searchable
        self._write_conf()
        r = self.root
        daemons = [
            [
                _binary("munged"),
                "-F",
                "-f",
                f"--socket={r}/munge.sock",
                f"--key-file={r}/munge.key",
                f"--pid-file={r}/munged.pid",
                f"--log-file={r}/munged.log",
                f"--seed-file={r}/munged.seed",
            ],
            [_binary("slurmctld"), "-D", "-f", str(self.conf)],
            [_binary("slurmd"), "-D", "-f", str(self.conf)],
        ]
        for argv in daemons:
            name = os.path.basename(argv[0])
            with open(r / f"{name}.out", "wb") as out:
                self._procs.append(
                    subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
                )
            if name == "munged":
                self._wait_for(lambda: (r / "munge.sock").exists(), "munged's socket")
        self._wait_for(self._idle, "the node to be idle")

    def _idle(self) -> bool:
        out = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
        return out == "idle"

    def _wait_for(self, cond: object, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():  # type: ignore[operator]
            dead = [str(p.args) for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm: no {what} (exited: {dead})\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        parts = []
        for name in ("munged.out", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [_binary(argv[0]), *argv[1:]],
            capture_output=True,
            text=True,
            timeout=60,
            env=self.env,
            check=check,
        )

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``ExitCode``, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        fields = {}
        for word in shlex.split(out):
            key, sep, value = word.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def wait_done(self, job_id: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout}s")
            time.sleep(0.2)


@contextlib.contextmanager
def slurm(root: Path) -> Iterator[Slurm]:
    s = Slurm(root)
    try:
        s.start()
        yield s
    finally:
        s.stop()


@dataclass(frozen=True)
class Scenario:
    """One job and what happens to it.

    ``step``: ``batch`` (the launcher is the batch script, ``exec``'d: the
    job's ExitCode is its status) or ``srun`` (a job step; the script exits
    with srun's status). ``action``: ``none``, ``fail`` (rank 1 exits 3),
    ``cancel`` (plain ``scancel``: SIGTERM), ``timeout`` (``--time=1``),
    ``signal`` (``scancel --signal=SIG``, with ``--batch`` for a batch step).
    """

    name: str
    step: str
    action: str
    sig: str = ""
    flags: tuple[str, ...] = ()


FORWARD_USR1 = ("--forward-signals", "SIGUSR1")
SCENARIOS = (
    Scenario("success", "srun", "none"),
    Scenario("worker fails", "batch", "fail"),
    Scenario("worker fails, root cause", "batch", "fail", flags=("--exit-code", "root-cause")),
    Scenario("scancel", "batch", "cancel"),
    Scenario("time limit", "batch", "timeout"),
    Scenario("scancel --signal=USR1", "srun", "signal", "USR1"),
    Scenario(
        "scancel --signal=USR1, forwarded",
        "srun",
        "signal",
        "USR1",
        ("--forward-signals", "SIGUSR1"),
    ),
    Scenario("scancel --batch --signal=USR1", "batch", "signal", "USR1"),
    Scenario("scancel --signal=USR2", "srun", "signal", "USR2"),
)


@dataclass
class Outcome:
    state: str
    exit_code: str  # Slurm's "status:signal"
    usr1: list[str]  # ranks whose handler saw SIGUSR1
    survivors: list[str] = field(default_factory=list)  # "pid cmdline" after the job
    log: str = ""


def _tagged(token: str) -> list[str]:
    mark = f"AIOLAUNCH_SLURM_SCENARIO={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(f"{entry} {cmd}")
    return found


def run_scenario(
    s: Slurm, sc: Scenario, launcher: list[str], folder: Path, settle: float = 15.0
) -> Outcome:
    """Submit ``sc``'s job of ``launcher`` (argv prefix), act, wait, report.

    Survivors are the job's processes (tagged through the environment) still
    running ``settle`` seconds after Slurm ended the job.
    """
    folder.mkdir(parents=True)
    (folder / "w.py").write_text(WORKER)
    token = uuid.uuid4().hex
    cmd = [*launcher, "--nproc-per-node", "2", *sc.flags, str(folder / "w.py"), str(folder)]
    if sc.action == "fail":
        cmd.append("3")
    line = shlex.join(cmd)
    if sc.step == "batch":
        body = f"exec {line}"
    else:
        body = f"srun {line}\nrc=$?\necho $rc > {folder}/srun.rc\nexit $rc"
    script = folder / "job.sh"
    script.write_text(f"#!/bin/bash\nexport AIOLAUNCH_SLURM_SCENARIO={token}\n{body}\n")
    opts = ["--parsable", "-c", "1", "-o", str(folder / "out.txt"), "-J", sc.name[:30]]
    if sc.action == "timeout":
        opts.append("--time=1")
    job_id = s.run("sbatch", *opts, str(script)).stdout.strip().split(";")[0]
    if sc.action != "fail":
        deadline = time.monotonic() + 120
        while len(list(folder.glob("*.pid"))) < 2:
            state = s.job(job_id).get("JobState")
            if time.monotonic() > deadline or state not in ("PENDING", "CONFIGURING", "RUNNING"):
                break
            time.sleep(0.1)
    if sc.action == "none":
        (folder / "stop").touch()
    elif sc.action == "cancel":
        s.run("scancel", job_id)
    elif sc.action == "signal":
        batch = ["--batch"] if sc.step == "batch" else []
        s.run("scancel", *batch, f"--signal={sc.sig}", job_id)
        if sc.flags:  # forwarded: the workers note it and go on; then stop them
            deadline = time.monotonic() + 30
            while len(list(folder.glob("*.usr1"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            (folder / "stop").touch()
    info = s.wait_done(job_id, timeout=240)
    deadline = time.monotonic() + settle
    while _tagged(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = _tagged(token)
    out = folder / "out.txt"
    return Outcome(
        state=info.get("JobState", "?"),
        exit_code=info.get("ExitCode", "?"),
        usr1=sorted(p.stem for p in folder.glob("*.usr1")),
        survivors=survivors,
        log=out.read_text(errors="replace")[-3000:] if out.exists() else "",
    )


def kill_survivors(outcome: Outcome) -> None:
    """SIGKILL what a launcher left behind (the torchrun measurement)."""
    for entry in outcome.survivors:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(entry.split()[0]), signal.SIGKILL)
