"""README's benchmark blocks are generated from a run's JSON, never hand-copied."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "readme_table", ROOT / "benchmarks" / "readme_table.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("readme_table", mod)
    spec.loader.exec_module(mod)
    return mod


def _row(
    group: str,
    label: str,
    stats: dict[str, Any],
    ratios: dict[str, Any] | None = None,
    **kw: object,
) -> dict[str, Any]:
    return {
        "group": group,
        "label": label,
        "stats": stats,
        "ratios": ratios or {},
        "errors": kw.get("errors", {}),
        "status": kw.get("status", "ok"),
    }


def _out(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "meta": {
            "machine": {"nproc": 2, "cpu": "Test CPU"},
            "date": "2026-11-25T04:00:00+00:00",
            "versions": {"torch": "2.13.0"},
        },
        "results": rows,
    }


def test_why_table_takes_every_number_from_the_json() -> None:
    mod = _module()
    med = {"median": 0.7, "p99": 2.5}
    out = _out(
        [
            _row("exit_bin", "binaries N=1 exit 0", {"aiolaunch": {"user_exit_to_return_ms": med}}),
            _row(
                "throughput",
                "redirect 16 x 32 MiB",
                {},
                {"MB_per_s": {"torch-p0.1": 1.25}},
            ),
            _row(
                "throughput",
                "tee 4 x 16 MiB",
                {},
                {"MB_per_s": {"torch-p0.1": 3.5}},
                errors={"torch-p0.1": ["console got 1 lines"]},
            ),
        ]
    )
    text = mod.render_why(out)
    assert "0.70 ms median, 2.5 ms p99" in text
    assert "1.25x at N=16" in text
    assert "3.5x at N=4" in text
    assert "lost console lines in this run" in text
    # Not measured in this run: said, not invented.
    assert "n/a at N=1" in text
    assert "2 x Test CPU, 2026-11-25" in text


def test_update_readme_rewrites_only_the_marked_blocks(tmp_path: Path) -> None:
    mod = _module()
    readme = tmp_path / "README.md"
    readme.write_text(
        f"intro\n{mod.WHY_START}\nold why\n{mod.WHY_END}\nmiddle\n"
        f"{mod.BENCH_START}\nold table\n{mod.BENCH_END}\nend\n"
    )
    mod.update_readme(_out([]), "# title\n| a | b |\n", str(tmp_path), readme=str(readme))
    text = readme.read_text()
    assert text.startswith("intro\n") and "middle\n" in text and text.endswith("end\n")
    assert "old why" not in text and "old table" not in text
    assert "| a | b |" in text and "# title" not in text
    assert "| | torch | aiolaunch |" in text
