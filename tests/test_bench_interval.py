"""The benchmark's verdicts: a bootstrap interval of a ratio of medians, and
the "within noise" verdict it gives a target that a run could not resolve.

Pure rules, no processes: benchmarks/_interval.py and run.py's rendering.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


_interval = _load("_interval")  # first: run.py imports it by this name
run = _load("run")


def _draws(center: float, spread: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(center, spread) for _ in range(n)]


def test_same_distribution_gives_an_interval_around_one() -> None:
    a = _draws(100, 5, 40, 1)
    b = random.Random(2).sample(a, len(a))  # the same trials, in another order
    iv = _interval.ratio_interval(a, b, ours_over_theirs=True)
    assert iv is not None
    lo, hi = iv
    assert lo < 1.0 < hi
    assert hi - lo < 0.1  # 40 trials of 5% spread: a few percent either way


def test_a_real_difference_is_resolved_and_oriented() -> None:
    fast, slow = _draws(50, 2, 30, 3), _draws(100, 4, 30, 4)
    # rates: ours / theirs
    lo, hi = _interval.ratio_interval(fast, slow, ours_over_theirs=True) or (0, 0)
    assert 0.45 < lo <= hi < 0.55
    # times: theirs / ours (ours is faster: > 1)
    lo, hi = _interval.ratio_interval(fast, slow, ours_over_theirs=False) or (0, 0)
    assert 1.8 < lo <= hi < 2.2


def test_more_trials_give_a_narrower_interval() -> None:
    def width(n: int) -> float:
        iv = _interval.ratio_interval(
            _draws(100, 10, n, 5), _draws(100, 10, n, 6), ours_over_theirs=True
        )
        assert iv is not None
        return float(iv[1] - iv[0])

    assert width(100) < width(10)


def test_interval_is_reproducible_and_needs_three_samples() -> None:
    a, b = _draws(10, 1, 12, 7), _draws(10, 1, 12, 8)
    assert _interval.ratio_interval(a, b, ours_over_theirs=True) == _interval.ratio_interval(
        a, b, ours_over_theirs=True
    )
    assert _interval.ratio_interval(a[:2], b, ours_over_theirs=True) is None
    assert _interval.ratio_interval(a, [0.0, 0.0, 0.0], ours_over_theirs=True) is None
    with pytest.raises(ValueError, match="confidence"):
        _interval.ratio_interval(a, b, ours_over_theirs=True, confidence=95)


@pytest.mark.parametrize(
    ("op", "metric", "want"),
    [
        (">=", "MB_per_s", (True, False)),  # a rate >= k x theirs: ours / theirs >= k
        (">=", "all_running_ms", (False, False)),  # "k x faster": theirs / ours >= k
        ("<=", "cpu_ms_per_s", (False, True)),  # ours <= k x theirs: theirs / ours >= 1 / k
    ],
)
def test_goodness_orients_every_kind_of_target(
    op: str, metric: str, want: tuple[bool, bool]
) -> None:
    assert _interval.goodness(op, metric) == want


def _target(met: bool, ratio: float, interval: tuple[float, float], **kw: Any) -> dict[str, Any]:
    t: dict[str, Any] = {"target": "median >= 1 x torch", "metric": "MB_per_s", "value": 6400.0}
    t |= {"met": met, "ratio": ratio, "interval": list(interval), "need": 1.0, **kw}
    t["within_noise"] = not met and interval[1] >= 1.0
    return t


def test_target_interval_marks_an_unresolved_miss_within_noise() -> None:
    rng = random.Random(9)
    same = {
        "aiolaunch": {"MB_per_s": [rng.gauss(6400, 200) for _ in range(30)]},
        "torch-p0.1": {"MB_per_s": [rng.gauss(6420, 200) for _ in range(30)]},
    }
    t = run.Target("MB_per_s", "median", ">=", vs="torch-p0.1")
    res = run.target_interval(t, same, met=False)
    assert res["need"] == 1.0
    lo, hi = res["interval"]
    assert lo < res["ratio"] < hi and lo < 1.0 < hi
    assert res["within_noise"] is True
    assert run.target_interval(t, same, met=True)["within_noise"] is False
    # Clearly below the bound: NOT met, not within noise.
    slow = {**same, "aiolaunch": {"MB_per_s": [x * 0.8 for x in same["aiolaunch"]["MB_per_s"]]}}
    res = run.target_interval(t, slow, met=False)
    assert res["interval"][1] < 1.0 and res["within_noise"] is False
    # A "<= k x" target asks for theirs / ours >= 1 / k.
    cpu = run.Target("cpu_ms_per_s", "median", "<=", vs="torch", factor=2.0)
    assert run.target_interval(cpu, {"aiolaunch": {}, "torch": {}}, met=True) == {}
    both = {"aiolaunch": {"cpu_ms_per_s": [1.0] * 5}, "torch": {"cpu_ms_per_s": [2.0] * 5}}
    res = run.target_interval(cpu, both, met=True)
    assert res["need"] == 0.5 and res["ratio"] == 2.0 and res["interval"] == [2.0, 2.0]


def test_verdicts_and_tally_name_what_was_not_met() -> None:
    met = _target(True, 1.08, (1.02, 1.14))
    noise = _target(False, 0.98, (0.94, 1.03))
    missed = _target(False, 0.80, (0.75, 0.86))
    assert run.verdict(met).startswith("met (6,400; 1.08x; 95%: 1.02-1.14x)")
    assert run.verdict(noise).startswith("within noise (6,400; 0.980x")
    assert run.verdict(missed).startswith("NOT met (6,400; 0.800x")
    rows = [
        {"group": "g", "label": f"row {i}", "targets": [t]}
        for i, t in enumerate((met, noise, missed))
    ]
    text = "\n".join(run.tally(rows))
    assert "1 met, 1 within noise, 1 NOT met" in text
    assert "- within noise: g / row 1" in text
    assert "- NOT met: g / row 2" in text
    assert "row 0" not in text
