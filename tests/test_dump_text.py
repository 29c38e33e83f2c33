"""Reading dumps (pure) and the worker's asyncio task dump (in this process)."""

from __future__ import annotations

import asyncio

from aiolaunch import StackReport
from aiolaunch._child._dump_handler import TASKS_END, TASKS_HEADER, tasks_text
from aiolaunch._hangs._dump_text import (
    idle_loop_text,
    main_frames,
    rank_where,
    signature,
    split_tasks,
)

_PY = "/usr/lib/python3.11"
_LOOP = f"""Thread 0x00007f0000000002 (most recent call first):
  File "{_PY}/threading.py", line 320 in wait
  File "{_PY}/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000001 (most recent call first):
  File "{_PY}/selectors.py", line 468 in select
  File "{_PY}/asyncio/base_events.py", line 1884 in _run_once
  File "{_PY}/asyncio/base_events.py", line 607 in run_forever
  File "{_PY}/asyncio/runners.py", line 118 in run
  File "/x/serve.py", line 30 in <module>
"""


def _tasks(where: str, line: int) -> str:
    return (
        f"{TASKS_HEADER}\n"
        "Task 'Task-1' (main):\n"
        f'  File "{_PY}/asyncio/tasks.py", line 649 in sleep\n'
        f'  File "/x/serve.py", line {line} in {where}\n'
        '  File "/x/serve.py", line 20 in step\n'
        '  File "/x/serve.py", line 25 in main\n'
        "  awaits Future\n"
        "Task 'Task-2' (heartbeat):\n"
        '  File "/x/serve.py", line 5 in heartbeat\n'
        "  awaits Future\n"
        f"{TASKS_END}\n"
    )


def test_split_tasks_takes_the_last_complete_section() -> None:
    assert split_tasks(_LOOP) == (_LOOP, None)
    threads, tasks = split_tasks(_LOOP + _tasks("collective", 9))
    assert threads.strip() == _LOOP.strip()
    assert tasks is not None and "collective" in tasks and TASKS_END not in tasks
    # A section cut short (the worker did not finish it) is ignored.
    cut = _LOOP + _tasks("collective", 9) + _tasks("load_batch", 12)[:60]
    _, tasks = split_tasks(cut)
    assert tasks is not None and "collective" in tasks


def test_asyncio_ranks_are_grouped_by_their_tasks() -> None:
    assert idle_loop_text(_LOOP)
    assert [f for f, _, _ in main_frames(_LOOP + _tasks("x", 1))][:2] == ["select", "_run_once"]
    majority = _LOOP + _tasks("collective", 9)
    odd = _LOOP + _tasks("load_batch", 12)
    report = StackReport.from_dumps({0: majority, 1: majority, 2: odd, 3: majority})
    assert report.outliers == [2]
    assert rank_where(odd)[1] == (
        "task: sleep (tasks.py:649) <- load_batch (serve.py:12) <- step (serve.py:20)"
        " (+1 more tasks)"
    )
    # Without its task section an asyncio rank is where its main thread is.
    assert rank_where(_LOOP)[1].startswith("select (selectors.py:468) <- _run_once")


def test_ranks_in_one_loop_at_different_lines_are_one_place() -> None:
    def dump(line: int, func: str = "spin") -> str:
        return (
            "Current thread 0x00007f0000000001 (most recent call first):\n"
            f'  File "/x/t.py", line {line} in {func}\n'
            '  File "/x/t.py", line 54 in main\n'
        )

    report = StackReport.from_dumps({0: dump(41), 1: dump(42), 2: dump(47, "other")})
    assert report.outliers == [2]
    assert report.groups[0] == ([0, 1], "spin (t.py:41) <- main (t.py:54)")
    # A different call site above is a different place.
    other_caller = dump(41).replace("line 54 in main", "line 60 in main")
    assert StackReport.from_dumps({0: dump(41), 1: other_caller}).outliers == []


def test_the_signature_ignores_which_thread_took_the_signal() -> None:
    other = _LOOP.replace("Current thread 0x00007f0000000001", "Thread 0x00007f0000000001")
    other = other.replace("Thread 0x00007f0000000002", "Current thread 0x00007f0000000002")
    assert signature(_LOOP) == signature(other)
    moved = _LOOP.replace("line 30 in <module>", "line 31 in <module>")
    assert signature(_LOOP) != signature(moved)
    # Helper threads moving is not the main thread moving.
    helper = _LOOP.replace("line 320 in wait", "line 321 in wait")
    assert signature(_LOOP) == signature(helper)
    # Tasks are part of it.
    assert signature(_LOOP + _tasks("a", 1)) != signature(_LOOP + _tasks("a", 2))
    assert signature("<pid 5 not registered for stack dumps>") is None


async def load_batch(started: asyncio.Event) -> None:
    started.set()
    await asyncio.sleep(3600)


async def test_the_worker_task_dump_shows_where_each_task_awaits() -> None:
    started = asyncio.Event()
    task = asyncio.ensure_future(load_batch(started), loop=None)
    task.set_name("loader")
    await started.wait()
    try:
        text = tasks_text()
    finally:
        task.cancel()
    assert text.startswith(TASKS_HEADER + "\n") and text.endswith(TASKS_END + "\n")
    block = text.split("Task 'loader' (load_batch):\n", 1)[1]
    lines = block.splitlines()
    assert lines[0].endswith(" in sleep") and "tasks.py" in lines[0]
    assert lines[1].endswith(" in load_batch") and "test_dump_text.py" in lines[1]
    assert lines[2] == "  awaits Future"
    # This test's own task is running (it called tasks_text): no awaits line.
    assert "in test_the_worker_task_dump_shows_where_each_task_awaits" in text


def test_the_task_dump_without_a_loop() -> None:
    assert "<no running event loop in the main thread>" in tasks_text()


def test_a_thread_dump_is_complete_at_its_outermost_frame() -> None:
    from aiolaunch._hangs._stacks import thread_dump_done

    boot = '  File "<frozen runpy>", line 198 in _run_module_as_main\n'
    script = '  File "/x/train.py", line 30 in <module>\n'
    spawned = '  File "<string>", line 1 in <module>\n'
    assert thread_dump_done(_LOOP + boot, stable=False)  # python -m: runpy is outermost
    assert thread_dump_done(_LOOP + spawned, stable=False)  # a spawned child
    # A script's <module> under the bootstrap is an inner frame: only once stable.
    assert not thread_dump_done(_LOOP + script, stable=False)
    assert thread_dump_done(_LOOP + script, stable=True)
    assert not thread_dump_done(_LOOP + '  File "/x/t.py", line 3 in f\n', stable=True)
    assert not thread_dump_done(_LOOP + boot[:20], stable=True)  # cut mid-line
    assert thread_dump_done("Current thread 0x1 (most recent call first):\n  ...\n", stable=False)
