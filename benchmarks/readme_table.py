"""Rewrite README.md's benchmark block from a run's results.json.

    python benchmarks/readme_table.py [RESULTS_JSON]   (default benchmarks/results/results.json)

Marked blocks are generated, never hand-edited:

- ``<!-- why:start ... -->`` .. ``<!-- why:end -->`` (README.md): the "Why not
  torch's?" table, whose numbers are looked up in the JSON (``n/a`` where the
  run did not measure them, e.g. a run without torch);
- ``<!-- bench:start ... -->`` .. ``<!-- bench:end -->``, in a file that has
  them: the plot and the full table of ``run.py`` (every row, medians, p99,
  ratios to torch and the floor). The full table itself is
  benchmarks/results/results.md, which ``run.py`` writes.

``run.py --readme`` calls :func:`update_readme` after a run.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(os.path.dirname(HERE), "README.md")

BENCH_START = "<!-- bench:start (written by benchmarks/run.py --readme; do not edit) -->"
BENCH_END = "<!-- bench:end -->"
WHY_START = "<!-- why:start (written by benchmarks/readme_table.py; do not edit) -->"
WHY_END = "<!-- why:end -->"


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if x >= 100:
        s = f"{x:.0f}"
    elif x >= 10:
        s = f"{x:.1f}"
    elif x >= 1:
        s = f"{x:.2f}".rstrip("0").rstrip(".")
    else:
        s = f"{x:.2f}"
    return s + unit


def _ms(x: float | None) -> str:
    """Milliseconds, as seconds from 1000 ms on."""
    if x is None:
        return "n/a"
    return _fmt(x / 1000, " s") if x >= 1000 else _fmt(x, " ms")


class Results:
    """Lookups into one results.json."""

    def __init__(self, out: dict) -> None:
        self.out = out
        self.rows = out["results"]

    def row(self, group: str, label: str) -> dict | None:
        for r in self.rows:
            if r["group"] == group and r["label"].startswith(label):
                return r
        return None

    def stat(self, group: str, label: str, variant: str, metric: str, stat: str = "median"):
        r = self.row(group, label)
        if r is None or variant in r.get("errors", {}):
            return None
        return r["stats"].get(variant, {}).get(metric, {}).get(stat)

    def ratio(self, group: str, label: str, metric: str, vs: str) -> float | None:
        r = self.row(group, label)
        if r is None or r["status"] != "ok":
            return None
        return r.get("ratios", {}).get(metric, {}).get(vs)


def render_why(out: dict) -> str:
    """The "Why not torch's?" table, every number from ``out``."""
    R = Results(out)

    def fx(x: float | None) -> str:
        return "n/a" if x is None else f"{_fmt(x)}x"

    exit_ms = "user_exit_to_return_ms"
    exit_al = (
        f"{_ms(R.stat('exit_bin', 'binaries N=1 exit 0', 'aiolaunch', exit_ms))} median, "
        f"{_ms(R.stat('exit_bin', 'binaries N=1 exit 0', 'aiolaunch', exit_ms, 'p99'))} p99"
    )
    fn_torch = (
        f"{_ms(R.stat('launch_fn', 'functions spawn N=1', 'torch', 'all_running_ms'))} for one, "
        f"{_ms(R.stat('launch_fn', 'functions spawn N=4', 'torch', 'all_running_ms'))} for four"
    )
    fn_al = (
        f"{_ms(R.stat('launch_fn', 'functions spawn N=1', 'aiolaunch', 'all_running_ms'))} for "
        f"one, {_ms(R.stat('launch_fn', 'functions spawn N=4', 'aiolaunch', 'all_running_ms'))}"
        " for four (spawn)"
    )
    tee_torch = _ms(R.stat("tee_latency", "4 workers", "torch", "line_ms"))
    tee_al = (
        f"{_ms(R.stat('tee_latency', '4 workers', 'aiolaunch', 'line_ms'))} median, "
        f"{_ms(R.stat('tee_latency', '4 workers', 'aiolaunch', 'line_ms', 'p99'))} p99"
    )
    redirect = ", ".join(
        f"{fx(R.ratio('throughput', f'redirect {n} x', 'MB_per_s', 'torch-p0.1'))} at N={n}"
        for n in (1, 4, 16)
    )
    tee_tp = ", ".join(
        f"{fx(R.ratio('throughput', f'tee {n} x', 'MB_per_s', 'torch-p0.1'))} at N={n}"
        for n in (1, 4, 16)
    )
    tee_console = ", ".join(
        f"{fx(R.ratio('throughput', f'tee {n} x', 'console_MB_per_s', 'torch-p0.1'))} at N={n}"
        for n in (1, 4, 16)
    )
    lines, vs_torch = "a write() per line", "torch-p0.1"
    # the per-line rows write 64 MiB in all: 64 / N MiB per writer (run.py)
    tee_lines = ", ".join(
        f"{fx(R.ratio('throughput', f'tee {n} x {64 // n} MiB, {lines}', 'MB_per_s', vs_torch))}"
        f" at N={n}"
        for n in (1, 4, 16)
    )
    tee_lines_console = ", ".join(
        fx(
            R.ratio(
                "throughput", f"tee {n} x {64 // n} MiB, {lines}", "console_MB_per_s", "torch-p0.1"
            )
        )
        for n in (1, 4, 16)
    )
    torch_tee_fail = any(
        "torch-p0.1" in (R.row("throughput", f"tee {n} x") or {}).get("errors", {})
        for n in (1, 4, 16)
    )
    e2e_torch = (
        f"{_ms(R.stat('e2e', 'CLI, 4 workers', 'torchrun', 'wall_ms'))} for a trivial 4-worker "
        f"script; {_ms(R.stat('e2e', 'CLI restart', 'torchrun', 'turnaround_ms'))} restart "
        "turnaround"
    )
    e2e_al = (
        f"{_ms(R.stat('e2e', 'CLI, 4 workers', 'aiolaunch', 'wall_ms'))}; "
        f"{_ms(R.stat('e2e', 'CLI restart', 'aiolaunch', 'turnaround_ms'))}"
    )
    rows = [
        (
            "noticing a worker's exit",
            "polls every `period` (1 s): up to 1 s late",
            f"the exit is an event: {exit_al}",
        ),
        (
            "function workers",
            f"importable functions only; every child imports torch ({fn_torch})",
            f"`__main__`, notebook cells, lambdas, closures (cloudpickle); {fn_al}",
        ),
        (
            "`envs` for function workers",
            "applied after torch is imported (`OMP_NUM_THREADS` too late)",
            "applied before the function is even unpickled",
        ),
        (
            "log files",
            "the worker writes its file",
            f"the same (direct writes, the page cache is the limit): {redirect} torch's throughput",
        ),
        (
            "tee",
            f"each log file polled by a thread every 0.1 s ({tee_torch} median line latency); "
            "prefixes mid-line; tqdm floods"
            + ("; lost console lines in this run" if torch_tee_fail else ""),
            f"inotify-driven ({tee_al}); line-atomic; never drops a line (a slow console "
            f"catches up from the file); progress bars drawn in place; the console gets the "
            f"output at {tee_console} torch's rate and the writers' own rate is {tee_tp} "
            f"torch's with 1 MiB writes; with {lines} (`print(..., flush=True)`), console "
            f"{tee_lines_console}, writers {tee_lines} torch's (a streaming file is read "
            "without its inotify watch: an event per write() would slow its writer)",
        ),
        ("`torchrun` vs `aiolaunch`", e2e_torch, e2e_al),
        (
            "notebook",
            "tee'd output never reaches the cell",
            "output shows in the cell; interrupt stops the workers",
        ),
        (
            "signal handlers",
            "installed at start, never restored",
            "installed while `wait()` runs, restored after, `SIG_IGN` respected",
        ),
        (
            "supervisor SIGKILLed",
            "binary workers orphaned",
            "workers and their children die with it",
        ),
        (
            "a worker's own children",
            "survive `close()`",
            "process group + `/proc` descendants are stopped",
        ),
    ]
    meta = out["meta"]
    lines = [
        f"Measured in one run on {meta['machine']['nproc']} x {meta['machine']['cpu']}, "
        f"{meta['date'][:10]}, torch {meta['versions'].get('torch') or 'n/a'} "
        "(see [Benchmarks](#benchmarks) for every row):",
        "",
        "| | torch | aiolaunch |",
        "|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def render_bench(md: str, out_dir: str) -> str:
    png = os.path.relpath(os.path.join(out_dir, "results.png"), os.path.dirname(README))
    body = "\n".join(line for line in md.strip().splitlines() if not line.startswith("# "))
    return f"![benchmark results]({png})\n\n{body.strip()}"


def _replace(text: str, start: str, end: str, body: str) -> str:
    if start not in text or end not in text:
        return text  # this file has no such block (README.md holds the why table only)
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n\n{body.strip()}\n\n{end}{tail}"


def update_readme(out: dict, md: str, out_dir: str, readme: str = README) -> None:
    """Rewrite the marked blocks of ``readme`` from one run (``out``, its ``md``
    table): the why table (README.md has it), and the full table where a file
    has its markers (the full table lives in benchmarks/results/results.md)."""
    with open(readme) as f:
        text = f.read()
    new = _replace(text, BENCH_START, BENCH_END, render_bench(md, out_dir))
    new = _replace(new, WHY_START, WHY_END, render_why(out))
    with open(readme, "w") as f:
        f.write(new)
    print(f"updated {readme}")


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "results.json")
    with open(path) as f:
        out = json.load(f)
    sys.path.insert(0, HERE)
    from run import render_md

    update_readme(out, render_md(out), os.path.dirname(os.path.abspath(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
