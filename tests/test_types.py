"""Std and to_map: torch's semantics, plus ranks of several digits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiolaunch import Std, to_map


def test_std_values_and_flags() -> None:
    assert [int(s) for s in (Std.NONE, Std.OUT, Std.ERR, Std.ALL)] == [0, 1, 2, 3]
    assert Std.ALL == Std.OUT | Std.ERR
    assert Std.ALL & Std.ERR
    assert not Std.OUT & Std.ERR


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", Std.NONE), ("1", Std.OUT), ("2", Std.ERR), ("3", Std.ALL)],
)
def test_from_str_single_value(text: str, expected: Std) -> None:
    value = Std.from_str(text)
    assert value is expected


def test_from_str_mapping() -> None:
    assert Std.from_str("0:3,1:0") == {0: Std.ALL, 1: Std.NONE}
    assert Std.from_str("0:3,1:0,2:1,3:2") == {0: Std.ALL, 1: Std.NONE, 2: Std.OUT, 3: Std.ERR}
    parsed = Std.from_str("1:2")
    assert parsed == {1: Std.ERR}
    assert isinstance(parsed, dict)
    assert all(type(v) is Std for v in parsed.values())


def test_from_str_ranks_of_several_digits() -> None:
    assert Std.from_str("10:3") == {10: Std.ALL}
    assert Std.from_str("0:1,12:2,127:3") == {0: Std.OUT, 12: Std.ERR, 127: Std.ALL}


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "4",
        "-1",
        "03",
        "ALL",
        "0:4",
        "0:",
        ":3",
        "0:3,",
        ",0:3",
        "0:3;1:0",
        " 3",
        "3\n",
        "0:3, 1:0",
        "a:1",
        "0:3:1",
        "0=3",
    ],
)
def test_from_str_rejects_bad_input_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid Std setting") as info:
        Std.from_str(bad)
    assert repr(bad) in str(info.value)


def test_from_str_rejects_duplicate_rank() -> None:
    with pytest.raises(ValueError, match="local rank 1 appears twice"):
        Std.from_str("1:3,0:0,1:2")


def test_from_str_rejects_non_str() -> None:
    with pytest.raises(TypeError, match="takes a str"):
        Std.from_str(3)  # type: ignore[arg-type]


@given(st.dictionaries(st.integers(0, 10_000), st.sampled_from(list(Std)), min_size=1))
def test_from_str_round_trips_any_mapping(mapping: dict[int, Std]) -> None:
    text = ",".join(f"{rank}:{int(value)}" for rank, value in mapping.items())
    assert Std.from_str(text) == mapping


def test_to_map_single_value_applies_to_every_rank() -> None:
    assert to_map(Std.OUT, 3) == {0: Std.OUT, 1: Std.OUT, 2: Std.OUT}
    assert to_map(Std.NONE, 0) == {}


def test_to_map_fills_missing_ranks_with_none() -> None:
    assert to_map({1: Std.OUT}, 3) == {0: Std.NONE, 1: Std.OUT, 2: Std.NONE}
    assert to_map({}, 2) == {0: Std.NONE, 1: Std.NONE}


def test_to_map_ignores_ranks_out_of_range_like_torch() -> None:
    assert to_map({0: Std.ERR, 5: Std.ALL}, 2) == {0: Std.ERR, 1: Std.NONE}


def test_to_map_accepts_ints_and_returns_std() -> None:
    mapping = to_map({0: 3}, 2)  # type: ignore[dict-item]
    assert mapping == {0: Std.ALL, 1: Std.NONE}
    assert all(type(v) is Std for v in mapping.values())
    assert to_map(2, 1) == {0: Std.ERR}  # type: ignore[arg-type]


def test_to_map_returns_a_new_dict() -> None:
    given_map = {0: Std.OUT}
    result = to_map(given_map, 1)
    result[0] = Std.NONE
    assert given_map == {0: Std.OUT}


@pytest.mark.parametrize("text", ["0", "1", "2", "3", "0:3,1:0", "0:1,1:2,2:3,3:0", "5:1"])
def test_from_str_agrees_with_torch(text: str) -> None:
    torch_api = pytest.importorskip("torch.distributed.elastic.multiprocessing.api")
    theirs = torch_api.Std.from_str(text)
    ours = Std.from_str(text)
    if isinstance(theirs, dict):
        assert isinstance(ours, dict)
        assert {k: int(v) for k, v in ours.items()} == {k: int(v) for k, v in theirs.items()}
    else:
        assert isinstance(ours, Std)
        assert int(ours) == int(theirs)


@pytest.mark.parametrize("setting", [Std.ALL, {1: Std.ERR}, {0: Std.OUT, 2: Std.ALL}])
def test_to_map_agrees_with_torch(setting: Std | dict[int, Std]) -> None:
    torch_api = pytest.importorskip("torch.distributed.elastic.multiprocessing.api")
    torch_setting = (
        torch_api.Std(int(setting))
        if isinstance(setting, Std)
        else {k: torch_api.Std(int(v)) for k, v in setting.items()}
    )
    theirs = torch_api.to_map(torch_setting, 3)
    assert {k: int(v) for k, v in to_map(setting, 3).items()} == {
        k: int(v) for k, v in theirs.items()
    }
