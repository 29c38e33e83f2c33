"""Live observability, the pure parts: top's screen and keys.

No job runs here: the rules are functions of their inputs (the wiring is
tested with real processes in tests/test_observe.py).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from aiolaunch._cli import _top_view as tv

STATES = ("starting", "running", "sleeping", "disk-sleep", "stopped", "stalled", "restarting",
          "exited")  # fmt: skip


def _worker(rank: int, **kw: Any) -> dict[str, Any]:
    w: dict[str, Any] = {
        "rank": rank, "pid": 1000 + rank, "state": "sleeping", "restarts": 0,
        "last_output_s": 1.5, "cpu_percent": 2.0, "rss": 1 << 20, "exitcode": None,
        "cpu_s": 0.25, "stalls": 0, "straggling": False, "steps": None, "step_rate": None,
    }  # fmt: skip
    w.update(kw)
    return w


# -- top's screen and keys ---------------------------------------------------------------

_worker_st: st.SearchStrategy[dict[str, Any]] = st.builds(
    dict,
    rank=st.integers(0, 10_000),
    pid=st.integers(0, 4_000_000),
    state=st.sampled_from([*STATES, "weird-state-name-that-is-long"]),
    restarts=st.integers(0, 10**6),
    last_output_s=st.none() | st.floats(0, 1e7),
    cpu_percent=st.floats(0, 10_000),
    rss=st.integers(0, 1 << 50),
    exitcode=st.none() | st.integers(-64, 255),
    stalls=st.integers(0, 100),
    straggling=st.booleans(),
    step_rate=st.none() | st.floats(0, 1e6),
)


@settings(max_examples=200)
@given(
    st.lists(_worker_st, max_size=80),
    st.integers(1, 200),
    st.integers(1, 60),
    st.lists(st.sampled_from([tv.KEY_DOWN, tv.KEY_UP, tv.KEY_NPAGE, ord("f"), ord("G"), ord("a")]),
             max_size=10),
)  # fmt: skip
def test_screen_fits_any_terminal(
    workers: list[dict[str, Any]], width: int, height: int, keys: list[int]
) -> None:
    for i, w in enumerate(workers):
        w["rank"] = i
    snap = {"name": "trainer", "log_dir": "/tmp/logs", "workers": workers}
    state = tv.TopState()
    for key in [0, *keys]:
        if key:
            assert tv.on_key(state, key, snap, height) in (None, "stacks")
        lines = tv.screen(snap, state, width, height, "12:00:00")
        assert len(lines) <= height
        assert all(len(text) == width for text, _ in lines)
        selected = [t for t, style in lines if style == "selected"]
        assert len(selected) <= 1
        if height >= 5 and width >= 4 and state.pager is None:
            # every rank row shown is a rank of the filter, once, in order
            ranks = [int(t.split()[0]) for t, style in lines[3:-1]
                     if style in ("row", "selected", "alert", "warn", "dim") and t.split()
                     and t.split()[0].isdigit()]  # fmt: skip
            want = [w["rank"] for w in workers
                    if state.filter is None or w["state"] == state.filter]  # fmt: skip
            assert ranks == want[state.top : state.top + len(ranks)]
            assert len(ranks) == min(len(want) - state.top, height - 4)


def test_screen_80x24_one_row_per_rank() -> None:
    workers = [_worker(r, step_rate=1.25 * r) for r in range(5)]
    workers[2].update(state="stalled", stalls=1)
    workers[3].update(straggling=True)
    workers[4].update(state="exited", exitcode=3)
    state = tv.TopState()
    lines = tv.screen({"name": "trainer", "log_dir": "/l", "workers": workers}, state, 80, 24)
    assert len(lines) == 24
    text = [t for t, _ in lines]
    assert text[0].startswith("aiolaunch top - trainer: 5 ranks (1 stalled, 3 sleeping, 1 exited)")
    assert text[2].split()[:9] == ["RANK", "STATE", "PID", "RST", "OUTPUT", "CPU%", "RSS",
                                   "STEP/s", "MARKS"]  # fmt: skip
    rows = text[3:8]
    assert [r.split()[0] for r in rows] == ["0", "1", "2", "3", "4"]
    assert "STALLED" in rows[2] and "STRAGGLING" in rows[3] and "exit 3" in rows[4]
    assert rows[1].split()[7] == "1.25"
    assert lines[3][1] == "selected" and lines[5][1] == "alert" and lines[6][1] == "warn"
    assert text[-1].startswith("q quit")


def test_keys_select_filter_and_ask_for_stacks() -> None:
    workers = [_worker(r) for r in range(30)]
    workers[7]["state"] = "running"
    snap = {"name": "t", "log_dir": "/l", "workers": workers}
    state = tv.TopState()
    tv.screen(snap, state, 80, 10)
    assert state.selected == 0
    tv.on_key(state, tv.KEY_DOWN, snap, 10)
    tv.on_key(state, tv.KEY_NPAGE, snap, 10)
    assert state.selected == 1 + (10 - 4)
    lines = tv.screen(snap, state, 80, 10)
    assert any(style == "selected" and t.split()[0] == "7" for t, style in lines)
    assert "[2-7 of 30]" in lines[-1][0] or "of 30]" in lines[-1][0]
    assert tv.on_key(state, ord("s"), snap, 10) == "stacks"
    tv.on_key(state, ord("f"), snap, 10)  # all -> running (the first state seen in order)
    assert state.filter == "running"
    lines = tv.screen(snap, state, 80, 10)
    assert [t.split()[0] for t, s in lines[3:] if s in ("row", "selected")][:1] == ["7"]
    tv.on_key(state, ord("a"), snap, 10)
    assert state.filter is None
    assert tv.on_key(state, ord("q"), snap, 10) == "quit"
    state.pager = ["line"] * 50
    assert tv.on_key(state, ord("q"), snap, 10) is None and state.pager is None


def test_formats() -> None:
    assert [tv.fmt_age(x) for x in (None, 0.04, 9.96, 42.4, 725, 11_000)] == [
        "-", "0.0s", "10.0s", "42s", "12m05s", "3h03m"]  # fmt: skip
    assert [tv.fmt_bytes(x) for x in (0, 512, 2048, 5 << 20, 3 << 30)] == [
        "-", "512B", "2.0K", "5.0M", "3.0G"]  # fmt: skip


def test_pager_puts_a_frame_function_first_and_wraps() -> None:
    dump = [
        "Current thread 0x00007fad34bbbb80 (most recent call first):",
        '  File "/very/long/folder/name/train.py", line 4 in load_batch',
        '  File "<frozen runpy>", line 88 in _run_code',
    ]
    assert tv.pager_lines(dump, 80) == [
        dump[0],
        "  load_batch  train.py:4  (/very/long/folder/name)",
        "  _run_code  <frozen runpy>:88",
    ]
    narrow = tv.pager_lines(dump, 20)
    assert narrow[:3] == ["Current thread 0x000", "    07fad34bbbb80 (m", "    ost recent call "]
    assert all(len(line) <= 20 for line in narrow)
    assert "".join(line.strip() for line in narrow).count("load_batch") == 1
