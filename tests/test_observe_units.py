"""Live observability, the pure parts: step rate, event JSON, metrics text, top's screen and keys.

No job runs here: the rules are functions of their inputs (the wiring is
tested with real processes in tests/test_observe.py). The metrics text is
parsed by prometheus_client's own parser, the reference for the format.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from aiolaunch import _events as ev
from aiolaunch._cli import _top_view as tv
from aiolaunch._hangs._rates import StepRate
from aiolaunch._live._event_json import event_kind, event_to_json
from aiolaunch._live._metrics import STATES, MetricsServer, bind_metrics, render_metrics

# -- step rate ----------------------------------------------------------------------


def test_step_rate_counts_over_the_window() -> None:
    r = StepRate(since=100.0, window=10.0)
    assert r.rate(100.0) == 0.0
    for i in range(20):  # 2 per second for 10 s
        r.add(100.25 + i * 0.5)
    assert r.total == 20
    assert r.rate(110.0) == pytest.approx(2.0, rel=0.05)
    assert r.rate(125.0) == 0.0  # all older than the window
    assert r.total == 20


def test_step_rate_before_the_window_is_full_uses_the_time_since_start() -> None:
    r = StepRate(since=50.6, window=60.0)
    r.add(50.7)
    r.add(51.1)
    assert r.rate(52.6) == pytest.approx(1.0)  # 2 events in 2 s


def test_step_rate_right_at_the_start_is_finite() -> None:
    # Found by the property test below: an event 2e-311 s after ``since``,
    # asked at once, gave n / 2e-311 = inf (``status --json`` cannot carry it).
    r = StepRate(since=0.0, window=1.0)
    r.add(2.225073858507e-311)
    got = r.rate(2.225073858507e-311)
    assert got == pytest.approx(1000.0)  # one event over the 1 ms floor
    json.dumps(got, allow_nan=False)


def test_step_rate_rejects_a_bad_window() -> None:
    with pytest.raises(ValueError, match="window"):
        StepRate(0.0, window=0)


@given(
    st.lists(st.floats(0, 1000, allow_nan=False), max_size=300),
    st.floats(1, 120),
    st.floats(0, 200),
)
def test_step_rate_matches_a_plain_count(gaps: list[float], window: float, extra: float) -> None:
    # The bucketed rate is within one bucket's worth of the exact count.
    r = StepRate(since=0.0, window=window)
    t, times = 0.0, []
    for g in gaps:
        t += g / 100
        r.add(t)
        times.append(t)
    now = t + extra
    span = min(window, now)
    got = r.rate(now)
    assert got >= 0 and math.isfinite(got)
    if span > 0:
        exact = sum(1 for x in times if x > now - span) / span
        # the oldest bucket is counted in proportion: at most its whole count off
        first_bucket = sum(1 for x in times if math.floor(x) == math.floor(now - span))
        assert abs(got - exact) <= (first_bucket + 1e-9) / span + 1e-9
    assert len(r._buckets) <= window + 2


# -- events as JSON ---------------------------------------------------------------------

_EVENTS: list[tuple[ev.Event, str]] = [
    (ev.WorkerStarted(rank=0, time=1.0, pid=10, attempt=1), "started"),
    (ev.WorkerReady(rank=0, time=1.0, pid=10), "ready"),
    (
        ev.WorkerExited(rank=1, time=1.0, pid=11, exitcode=-9, signal="SIGKILL", stopped=False),
        "exited",
    ),
    (ev.WorkerRestarting(rank=1, time=1.0, attempt=2, delay=0.5), "restarting"),
    (ev.WorkerStalled(rank=2, time=1.0, idle_s=3.0, reason="no output"), "stalled"),
    (ev.GroupStopped(rank=None, time=1.0, failed=True), "group_stopped"),
    (ev.EventsDropped(rank=None, time=1.0, count=3), "dropped"),
    (ev.LogLine(rank=0, time=1.0, stream="stdout", text="step 1"), "line"),
]


@pytest.mark.parametrize(("event", "kind"), _EVENTS, ids=[k for _, k in _EVENTS])
def test_every_event_maps_to_one_flat_json_object(event: ev.Event, kind: str) -> None:
    msg = event_to_json(event, version=7, group="g")
    assert json.loads(json.dumps(msg, allow_nan=False)) == msg
    assert (msg["v"], msg["event"], msg["group"], msg["rank"]) == (7, kind, "g", event.rank)
    assert msg["monotonic"] == event.time
    assert isinstance(msg["time"], float)
    for name in type(event).__dataclass_fields__:
        if name not in ("rank", "time"):
            assert msg[name] == getattr(event, name)


def test_a_new_event_class_gets_a_name_from_itself() -> None:
    class WorkerStraggling:
        pass

    class GroupPaused:
        pass

    assert event_kind(WorkerStraggling) == "straggling"
    assert event_kind(GroupPaused) == "group_paused"


def test_event_json_has_no_nan() -> None:
    event = ev.WorkerRestarting(rank=0, time=1.0, attempt=1, delay=float("inf"))
    assert event_to_json(event, version=1, group="g")["delay"] is None


# -- metrics text -------------------------------------------------------------------


def _worker(rank: int, **kw: Any) -> dict[str, Any]:
    w: dict[str, Any] = {
        "rank": rank,
        "pid": 1000 + rank,
        "state": "sleeping",
        "restarts": 0,
        "last_output_s": 1.5,
        "cpu_percent": 2.0,
        "rss": 1 << 20,
        "exitcode": None,
        "cpu_s": 0.25,
        "stalls": 0,
        "straggling": False,
        "steps": None,
        "step_rate": None,
    }
    w.update(kw)
    return w


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_text_has_a_sample_per_rank_and_parses() -> None:
    workers = [_worker(r) for r in range(4)]
    workers[3].update(state="exited", exitcode=-9, pid=1003, last_output_s=None)
    snap = {"name": 'odd "name"\n', "log_dir": "/tmp/x\\y", "workers": workers, "start_time": 5.0}
    fams = _families(render_metrics(snap))
    for name in (
        "aiolaunch_worker_up",
        "aiolaunch_worker_restarts",
        "aiolaunch_worker_cpu_seconds",
        "aiolaunch_worker_resident_memory_bytes",
        "aiolaunch_worker_stalls",
        "aiolaunch_worker_pid",
    ):
        assert sorted(s.labels["rank"] for s in fams[name].samples) == ["0", "1", "2", "3"], name
    up = {s.labels["rank"]: s.value for s in fams["aiolaunch_worker_up"].samples}
    assert up == {"0": 1, "1": 1, "2": 1, "3": 0}
    state = {
        (s.labels["rank"], s.labels["state"]): s.value
        for s in fams["aiolaunch_worker_state"].samples
    }
    assert len(state) == 4 * len(STATES) and sum(state.values()) == 4
    assert state[("3", "exited")] == 1
    assert [s.labels["rank"] for s in fams["aiolaunch_worker_exit_code"].samples] == ["3"]
    assert fams["aiolaunch_worker_exit_code"].samples[0].value == -9
    # unknown ages are left out, not NaN
    ages = fams["aiolaunch_worker_last_output_age_seconds"].samples
    assert sorted(s.labels["rank"] for s in ages) == ["0", "1", "2"]
    assert "aiolaunch_worker_steps_per_second" not in fams  # no --progress-regex
    info = fams["aiolaunch_group_info"].samples[0].labels
    assert info == {"group": 'odd "name"\n', "log_dir": "/tmp/x\\y"}
    assert fams["aiolaunch_group_workers"].samples[0].value == 4
    assert fams["aiolaunch_worker_restarts"].type == "counter"
    assert fams["process_cpu_seconds"].samples[0].value > 0


def test_metrics_step_rate_with_a_progress_regex() -> None:
    snap = {
        "name": "g",
        "log_dir": "/x",
        "workers": [_worker(0, steps=12, step_rate=0.4), _worker(1, steps=0, step_rate=0.0)],
    }
    fams = _families(render_metrics(snap))
    rates = {s.labels["rank"]: s.value for s in fams["aiolaunch_worker_steps_per_second"].samples}
    assert rates == {"0": 0.4, "1": 0.0}
    lines = {s.labels["rank"]: s.value for s in fams["aiolaunch_worker_progress_lines"].samples}
    assert lines == {"0": 12, "1": 0}


async def test_metrics_server_answers_a_scrape_and_closes_its_connections() -> None:
    calls: list[int] = []

    def collect() -> str:
        calls.append(1)
        return render_metrics({"name": "g", "log_dir": "/x", "workers": [_worker(0)]})

    server = await MetricsServer.start(bind_metrics("127.0.0.1", 0), collect)
    host, port = server.address
    try:
        reader, writer = await asyncio.open_connection(host, port)
        for _ in range(2):  # keep-alive: two scrapes on one connection
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            assert head.startswith("HTTP/1.1 200 OK\r\n")
            assert "text/plain; version=0.0.4" in head
            length = int(head.split("Content-Length: ")[1].split("\r\n")[0])
            body = (await reader.readexactly(length)).decode()
            assert "aiolaunch_worker_up" in _families(body)
        writer.write(b"GET /nope HTTP/1.1\r\n\r\n")
        assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 404")
        # an idle keep-alive connection does not outlive the server
        await server.aclose()
        assert await asyncio.wait_for(reader.read(), 5) is not None
        writer.close()
        await writer.wait_closed()
    finally:
        await server.aclose()
    assert len(calls) == 2
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(host, port)


def test_bind_metrics_names_a_port_in_use() -> None:
    first = bind_metrics("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError, match=rf"127.0.0.1:{port}.*--metrics-port"):
            bind_metrics("127.0.0.1", port)
    finally:
        first.close()
    with pytest.raises(OSError, match=r"metrics_host='no\.such\.host\.invalid'"):
        bind_metrics("no.such.host.invalid", 0)


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
    st.lists(
        st.sampled_from([tv.KEY_DOWN, tv.KEY_UP, tv.KEY_NPAGE, ord("f"), ord("G"), ord("a")]),
        max_size=10,
    ),
)
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
            ranks = [
                int(t.split()[0])
                for t, style in lines[3:-1]
                if style in ("row", "selected", "alert", "warn", "dim")
                and t.split()
                and t.split()[0].isdigit()
            ]
            want = [
                w["rank"] for w in workers if state.filter is None or w["state"] == state.filter
            ]
            assert ranks == want[state.top : state.top + len(ranks)]
            assert len(ranks) == min(len(want) - state.top, height - 4)


def test_screen_80x24_one_row_per_rank() -> None:
    workers = [_worker(r, step_rate=1.25 * r) for r in range(5)]
    workers[2].update(state="stalled", stalls=1)
    workers[3].update(straggling=True, attached=True)
    workers[4].update(state="exited", exitcode=3)
    state = tv.TopState()
    lines = tv.screen({"name": "trainer", "log_dir": "/l", "workers": workers}, state, 80, 24)
    assert len(lines) == 24
    text = [t for t, _ in lines]
    assert text[0].startswith("aiolaunch top - trainer: 5 ranks (1 stalled, 3 sleeping, 1 exited)")
    assert text[2].split()[:9] == [
        "RANK",
        "STATE",
        "PID",
        "RST",
        "OUTPUT",
        "CPU%",
        "RSS",
        "STEP/s",
        "MARKS",
    ]
    rows = text[3:8]
    assert [r.split()[0] for r in rows] == ["0", "1", "2", "3", "4"]
    assert "STALLED" in rows[2] and "STRAGGLING ATTACHED" in rows[3] and "exit 3" in rows[4]
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
        "-",
        "0.0s",
        "10.0s",
        "42s",
        "12m05s",
        "3h03m",
    ]
    assert [tv.fmt_bytes(x) for x in (0, 512, 2048, 5 << 20, 3 << 30)] == [
        "-",
        "512B",
        "2.0K",
        "5.0M",
        "3.0G",
    ]


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


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"metrics_port": -1}, ValueError, "metrics_port=-1"),
        ({"metrics_port": 65536}, ValueError, "metrics_port=65536"),
        ({"metrics_port": True}, TypeError, "metrics_port"),
        ({"metrics_port": "9400"}, TypeError, "metrics_port"),
        ({"metrics_port": 0, "metrics_host": ""}, TypeError, "metrics_host"),
    ],
)
def test_metrics_arguments_are_checked_at_the_call(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    import aiolaunch
    from aiolaunch.agent import WorkerSpec

    with pytest.raises(error, match=match):
        aiolaunch.start_processes("t", "true", {0: ()}, {0: {}}, **kwargs)
    if "metrics_host" not in kwargs:
        with pytest.raises(error, match=match):
            WorkerSpec(role="t", local_world_size=1, entrypoint="true", **kwargs)


def test_metrics_host_needs_metrics_port_on_the_command_line() -> None:
    from aiolaunch._cli import config_from_args, parse_args

    with pytest.raises(ValueError, match="--metrics-host needs --metrics-port"):
        config_from_args(parse_args(["--metrics-host", "0.0.0.0", "x.py"]))
    spec = config_from_args(parse_args(["--metrics-port", "9400", "x.py"])).spec
    assert (spec.metrics_port, spec.metrics_host) == (9400, "127.0.0.1")
