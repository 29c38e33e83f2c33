"""``_workers/_proc``: the fields of ``/proc/<pid>/stat`` that decide whether
``close()`` needs the token scan for escaped daemons (#26), on a synthetic
stat line (the rule) and on real processes (the kernel's counters)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hypothesis import given
from hypothesis import strategies as st

from aiolaunch._workers._proc import parse_stat, read_stat
from aiolaunch._workers._processes import ProcTable

SIGCHLD_BIT = 1 << (signal.SIGCHLD - 1)


def _line(
    state: str = "S", cminflt: int = 0, cmajflt: int = 0, ignored: int = 0, caught: int = 0
) -> bytes:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime cutime cstime prio nice threads itreal starttime vsize
    # rss rsslim startcode endcode startstack esp eip signal blocked sigignore
    # sigcatch wchan ...
    fields = [state, "1", "7", "7", "0", "-1", "0", "10", str(cminflt), "0", str(cmajflt)]
    fields += ["3", "4", "0", "0", "20", "0", "1", "0", "555", "1000", "66", "0"]
    fields += ["0", "0", "0", "0", "0", "0", "0", str(ignored), str(caught), "0", "0", "0"]
    return b"42 (a (odd) name) " + " ".join(fields).encode()


def test_parse_stat_reads_the_fields_of_the_escape_rule() -> None:
    stat = parse_stat(_line(cminflt=5, cmajflt=2, ignored=SIGCHLD_BIT, caught=2))
    assert stat is not None
    assert stat.comm == "a (odd) name"
    assert (stat.ppid, stat.pgid, stat.starttime, stat.rss_pages) == (1, 7, 555, 66)
    assert (stat.cminflt, stat.cmajflt, stat.sigignore, stat.sigcatch) == (5, 2, SIGCHLD_BIT, 2)
    # an old kernel's shorter line: the fields are unknown, and unknown counts as a trace
    short = parse_stat(b"42 (x) S " + b" ".join([b"1"] * 25))
    assert short is not None and short.cminflt == -1
    assert short.may_have_lost_children


@given(
    state=st.sampled_from("RSDTtZX"),
    cminflt=st.integers(0, 3),
    cmajflt=st.integers(0, 3),
    ignored=st.integers(0, 2**32),
    caught=st.integers(0, 2**32),
)
def test_a_lost_child_leaves_a_trace(
    state: str, cminflt: int, cmajflt: int, ignored: int, caught: int
) -> None:
    """The rule in words: a process may have lost a child (whose own children
    were then re-parented away) if it reaped one (child page faults counted),
    is itself a zombie or dead, or lets the kernel reap them unseen (SIGCHLD
    ignored, or handled: SA_NOCLDWAIT is invisible in /proc)."""
    stat = parse_stat(_line(state, cminflt, cmajflt, ignored, caught))
    assert stat is not None
    expected = state in "ZX" or cminflt > 0 or cmajflt > 0 or bool((ignored | caught) & SIGCHLD_BIT)
    assert stat.may_have_lost_children == expected


def test_the_kernel_counts_a_reaped_child_and_shows_an_ignored_sigchld() -> None:
    code = (
        "import os, signal, subprocess, sys, time\n"
        "print('fresh', flush=True); sys.stdin.readline()\n"
        "subprocess.run(['true'])\n"
        "print('reaped', flush=True); sys.stdin.readline()\n"
        "signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
        "print('ignoring', flush=True); sys.stdin.readline()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
        assert p.stdin is not None and p.stdout is not None
        seen = {}
        for step in ("fresh", "reaped", "ignoring"):
            assert p.stdout.readline().strip() == step
            stat = read_stat(p.pid)
            assert stat is not None
            seen[step] = stat
            p.stdin.write("\n")
            p.stdin.flush()
        assert p.wait(60) == 0
    assert not seen["fresh"].may_have_lost_children
    assert seen["reaped"].cminflt > 0 and seen["reaped"].may_have_lost_children
    assert seen["ignoring"].sigignore & SIGCHLD_BIT


def test_proc_table_sees_a_tree_with_a_zombie_as_possibly_escaped() -> None:
    # parent -> child that exits unreaped (a zombie), leaving a grandchild
    # re-parented away: only the zombie tells.
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(30); os._exit(0)\n"
        "    os._exit(0)\n"
        "print('ready', flush=True); time.sleep(30)\n"
    )
    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    ) as p:
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            for _ in range(500):  # the child's exit is quick but not instant
                table = ProcTable(min(quiet.pid, p.pid))
                if any(table.stats[c].state == "Z" for c in table.children.get(p.pid, ())):
                    break
                time.sleep(0.01)
            assert table.may_have_escaped(p.pid)
            assert not table.may_have_escaped(quiet.pid)
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            quiet.kill()
            quiet.wait()


def _ready(code: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _end(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def test_proc_table_lists_processes_never_their_threads() -> None:
    # /proc answers for a thread id as for a process (never listing it): a
    # table that tries pids one by one must not take threads for children.
    p = _ready(
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('ready', flush=True); time.sleep(30)\n"
    )
    try:
        threads = {int(t) for t in os.listdir(f"/proc/{p.pid}/task")} - {p.pid}
        assert len(threads) == 3
        table = ProcTable(p.pid)
        assert p.pid in table.stats
        assert not threads & set(table.stats), "a thread read as a process"
        assert table.tree(p.pid) == set()
    finally:
        _end(p)


def test_proc_table_reads_the_workers_only_when_something_else_was_born() -> None:
    """``alone``: live workers with no other process born since the first of
    them have nothing below them; any other process makes the table read
    everything (it may be a descendant, or one re-parented away)."""
    quiet = [_ready("import time; print('ready', flush=True); time.sleep(30)") for _ in range(2)]
    with_child = _ready(
        "import os, time\n"
        "if os.fork() == 0: time.sleep(30); os._exit(0)\n"
        "print('ready', flush=True); time.sleep(30)\n"
    )
    # A double fork: the daemon lives on, re-parented away; its parent was reaped.
    escaped = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, time\n"
            "r, w = os.pipe()\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0: os.write(w, b'%d' % os.getpid()); time.sleep(30); os._exit(0)\n"
            "    os._exit(0)\n"
            "os.wait(); print(os.read(r, 16).decode(), flush=True); time.sleep(30)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert escaped.stdout is not None
    daemon = int(escaped.stdout.readline())
    try:
        a, b = (q.pid for q in quiet)
        table = ProcTable(min(a, b), [a, b])
        # Alone unless another process started on this host meanwhile; the
        # answers are the same either way.
        assert table.alone in (frozenset({a, b}), frozenset())
        if table.alone:
            assert table.stats == {}
        assert table.tree(a) == table.tree(b) == set()
        assert not table.may_have_escaped(a) and not table.may_have_escaped(b)

        table = ProcTable(with_child.pid, [with_child.pid])
        assert table.alone == frozenset()
        (child,) = table.tree(with_child.pid)
        assert table.stats[child].ppid == with_child.pid
        assert not table.may_have_escaped(with_child.pid)

        table = ProcTable(escaped.pid, [escaped.pid])
        assert table.alone == frozenset(), "the daemon was born since: not alone"
        assert table.tree(escaped.pid) == set(), "re-parented away: out of the tree"
        assert table.may_have_escaped(escaped.pid), "the reaped child left a trace"
    finally:
        os.kill(daemon, signal.SIGKILL)
        _end(*quiet, with_child, escaped)
