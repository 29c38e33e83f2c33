"""Property-based tests: validation shapes, ``Std.from_str``, prefixes, log bytes.

The log-bytes properties drive the real sinks (``FileSink``, ``ConsoleSink``,
``LineSink``) directly, chunk by chunk inside an event loop, with arbitrary
binary data cut at arbitrary read boundaries: the file must hold exactly the
bytes, the console exactly the lines (prefixed, decoded with
``errors="replace"``). One end-to-end example runs a real worker. Settings are
modest (CI has two cores).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import aiolaunch
from aiolaunch import Std
from aiolaunch._logs import ConsoleSink, FileSink, LineSink, console, set_console_hook

if TYPE_CHECKING:
    from typing import TextIO

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# -- validation ------------------------------------------------------------------

keys = st.sets(st.integers(min_value=-2, max_value=8), max_size=6)


@SETTINGS
@given(arg_keys=keys, env_keys=keys)
def test_rank_key_sets_accepted_iff_exactly_0_to_n_minus_1(
    arg_keys: set[int], env_keys: set[int]
) -> None:
    args = {k: ("x",) for k in arg_keys}
    envs: dict[int, dict[str, str]] = {k: {} for k in env_keys}
    ok = bool(arg_keys) and arg_keys == set(range(len(arg_keys))) and env_keys == arg_keys
    if ok:
        # validated; never awaited: nothing starts, and dropping it warns
        with pytest.warns(RuntimeWarning, match="never awaited"):
            aiolaunch.start_processes(name="p", entrypoint="/bin/true", args=args, envs=envs)
    else:
        with pytest.raises(ValueError, match=r"args|envs"):
            aiolaunch.start_processes(name="p", entrypoint="/bin/true", args=args, envs=envs)


env_atoms = st.one_of(
    st.text(max_size=5), st.integers(), st.none(), st.binary(max_size=3), st.floats()
)


@SETTINGS
@given(env=st.dictionaries(env_atoms, env_atoms, max_size=4))
def test_env_values_must_be_str_to_str(env: dict[Any, Any]) -> None:
    # names: non-empty, no "=" or NUL; values: no NUL (neither fits in an environment)
    good = all(
        isinstance(k, str)
        and isinstance(v, str)
        and k
        and "=" not in k
        and "\0" not in k
        and "\0" not in v
        for k, v in env.items()
    )
    call: dict[str, Any] = {
        "name": "p",
        "entrypoint": "/bin/true",
        "args": {0: ()},
        "envs": {0: env},
    }
    if good:
        with pytest.warns(RuntimeWarning, match="never awaited"):
            aiolaunch.start_processes(**call)
    else:
        with pytest.raises((TypeError, ValueError), match=r"envs\[0\]"):
            aiolaunch.start_processes(**call)


@SETTINGS
@given(
    args=st.one_of(
        st.integers(), st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=2)
    )
)
def test_per_rank_args_must_be_tuples_or_lists(args: Any) -> None:
    call: dict[str, Any] = {
        "name": "p",
        "entrypoint": "/bin/true",
        "args": {0: args},
        "envs": {0: {}},
    }
    if isinstance(args, list):
        with pytest.warns(RuntimeWarning, match="never awaited"):
            aiolaunch.start_processes(**call)
    else:
        with pytest.raises(TypeError, match=r"args\[0\]"):
            aiolaunch.start_processes(**call)


# -- Std.from_str ------------------------------------------------------------------


@SETTINGS
@given(st.dictionaries(st.integers(0, 10_000), st.integers(0, 3), min_size=1, max_size=8))
def test_std_from_str_roundtrip(mapping: dict[int, int]) -> None:
    text = ",".join(f"{r}:{v}" for r, v in mapping.items())
    assert Std.from_str(text) == {r: Std(v) for r, v in mapping.items()}


@SETTINGS
@given(st.integers(0, 3))
def test_std_from_str_single_value(v: int) -> None:
    assert Std.from_str(str(v)) == Std(v)


@SETTINGS
@given(st.text(alphabet="0123456789:,4 -x\n", max_size=12))
@example("0:3,0:1")
@example("0:4")
@example("")
@example("3\n")
def test_std_from_str_rejects_cleanly(text: str) -> None:
    """Any string parses to a valid setting or raises a ValueError quoting it."""
    error: ValueError | None = None
    try:
        value = Std.from_str(text)
    except ValueError as exc:
        error = exc
    if error is not None:
        assert repr(text) in str(error)
        return
    if isinstance(value, dict):
        assert all(isinstance(r, int) and r >= 0 and isinstance(s, Std) for r, s in value.items())
        assert len(value) == text.count(",") + 1
    else:
        assert isinstance(value, Std) and text == str(int(value))


# -- sinks, fed chunk by chunk ---------------------------------------------------

_hook_lock = threading.Lock()


class _Captured:
    def __init__(self) -> None:
        self.parts: list[tuple[str, str]] = []

    def __call__(self, stream: TextIO, text: str) -> None:
        self.parts.append(("stdout" if stream is sys.stdout else "stderr", text))

    def text(self) -> str:
        return "".join(t for _, t in self.parts)


def _cuts(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


async def _feed(data: bytes, cuts: list[int], prefix: str) -> tuple[bytes, str, list[str]]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "stdout.log")
        fsink = FileSink(path)
        csink = ConsoleSink("stdout", prefix)
        lines: list[str] = []
        lsink = LineSink(lines.append, lambda: True)
        captured = _Captured()
        previous = set_console_hook(captured)
        try:
            for chunk in _cuts(data, cuts):
                for sink in (fsink, csink, lsink):
                    sink.feed(chunk)
                await asyncio.sleep(0)  # let file writes interleave with feeding
            for sink in (fsink, csink, lsink):
                await sink.aclose()
            await console().flush()
        finally:
            set_console_hook(previous)
        with open(path, "rb") as f:
            return f.read(), captured.text(), lines


def _expected_console(data: bytes, prefix: str) -> tuple[str, list[str]]:
    """What a console shows for ``data`` without ``\\r``: lines, 64 KiB pieces."""
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    out = []
    for line in lines:
        pieces = [line[i : i + 65536] for i in range(0, len(line), 65536)] or [""]
        out += [prefix + p + "\n" for p in pieces]
    return "".join(out), lines


binary = st.binary(max_size=3000).map(lambda b: b.replace(b"\r", b"\n"))
utf8ish = st.lists(
    st.sampled_from([b"\n", b"\xe2\x9c\x93", b"\xf0\x9d\x84\x9e", b"\xff", b"\x00", b"a", b"\xc3"]),
    max_size=400,
).map(b"".join)
prefixes = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\n\r"), max_size=12
)


@SETTINGS
@given(
    data=st.one_of(binary, utf8ish),
    cuts=st.lists(st.integers(0, 10_000), max_size=30),
    prefix=prefixes,
)
@example(data=b"\xe2\x9c\x93\n", cuts=[1, 2], prefix="[w0]:")
@example(data=b"no newline at end", cuts=[3], prefix="")
def test_sinks_keep_exact_bytes_and_whole_lines(data: bytes, cuts: list[int], prefix: str) -> None:
    """Arbitrary chunks at arbitrary boundaries: file == bytes; console == lines.

    Cuts fall inside multibyte characters too; the incremental decoder must
    give the same text as decoding everything at once.
    """
    with _hook_lock:
        file_bytes, console_text, lines = asyncio.run(_feed(data, cuts, prefix))
    assert file_bytes == data
    expected, expected_lines = _expected_console(data, prefix)
    assert console_text == expected
    assert lines == expected_lines


@SETTINGS
@given(
    data=st.lists(
        st.sampled_from([b"\r", b"\n", b"\r\n", b"50%", b"\xff", b"\xe2\x9c\x93", b"x" * 100]),
        min_size=1,
        max_size=200,
    ).map(lambda parts: b"\r" + b"".join(parts)),
    cuts=st.lists(st.integers(0, 3000), max_size=20),
)
def test_carriage_returns_never_break_line_atomicity(data: bytes, cuts: list[int]) -> None:
    """With ``\\r`` (progress bars) the file is still exact, and the console gets
    only whole prefixed lines with no ``\\r`` left inside them."""
    with _hook_lock:
        file_bytes, console_text, _ = asyncio.run(_feed(data, cuts, "[p]:"))
    assert file_bytes == data
    assert console_text == "" or console_text.endswith("\n")
    for line in console_text.split("\n")[:-1]:
        assert line.startswith("[p]:")
        assert "\r" not in line


def test_one_mib_line_fed_byte_ranges_matches() -> None:
    """A long line split into 64 KiB pieces, fed at boundaries that never align."""
    data = (b"abc\xe2\x9c\x93" * 200_000) + b"\n"
    cuts = list(range(1, len(data), 65_537))
    file_bytes, console_text, _ = asyncio.run(_feed(data, cuts, "[x]:"))
    assert file_bytes == data
    assert console_text == _expected_console(data, "[x]:")[0]


async def _console_of(data: bytes, cuts: list[int], prefix: str, fast: bool) -> str:
    sink = ConsoleSink("stdout", prefix)
    sink._fast = fast  # False: the reference, every chunk through the LineFramer
    captured = _Captured()
    previous = set_console_hook(captured)
    try:
        for chunk in _cuts(data, cuts):
            sink.feed(chunk)
        await sink.aclose()
        await console().flush()
    finally:
        set_console_hook(previous)
    return captured.text()


# Pieces that move the console sink between its byte-level fast path and the
# framer: lines around the 64 KiB limit in bytes and in characters, a
# multibyte character, a bad byte, progress updates.
mixed = st.lists(
    st.sampled_from(
        [
            b"\n",
            b"ab\n",
            b"\xe2\x9c\x93",
            b"\xff",
            b"\r",
            b"50%\r",
            b"x" * 65_535,
            b"x" * 65_536,
            b"\xe2\x9c\x93" * 30_000,
        ]
    ),
    max_size=12,
).map(b"".join)


@SETTINGS
@given(data=mixed, cuts=st.lists(st.integers(0, 400_000), max_size=12), prefix=prefixes)
@example(data=b"x" * 65_536 + b"\nab\n" + b"x" * 65_535 + b"\n", cuts=[], prefix="[a]:")
@example(data=b"\n" + b"x" * 65_536 + b"\xff\nab\n", cuts=[], prefix="[a]:")
@example(data=b"ab\n" + b"x" * 65_536 + b"\xff", cuts=[3], prefix="[a]:")
@example(data=b"50%\r\nab\n\xe2\x9c", cuts=[5, 8], prefix="")
def test_console_fast_path_equals_the_framer(data: bytes, cuts: list[int], prefix: str) -> None:
    """The byte-level fast path shows exactly what the line framer shows, at
    any chunking, while it hands over to the framer and back (``\\r``, long
    lines, characters cut by a read)."""
    with _hook_lock:
        fast = asyncio.run(_console_of(data, cuts, prefix, fast=True))
        reference = asyncio.run(_console_of(data, cuts, prefix, fast=False))
    assert fast == reference
    if b"\r" not in data:
        assert fast == _expected_console(data, prefix)[0]


WRITER = """
import os, sys
data = open(sys.argv[1], "rb").read()
cuts = [int(c) for c in sys.argv[2].split(",") if c]
prev = 0
for c in sorted(set(cuts)) + [len(data)]:
    os.write(1, data[prev:c]); prev = c
"""


@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=utf8ish, cuts=st.lists(st.integers(0, 400), max_size=10))
def test_end_to_end_with_a_real_worker(tmp_path: Path, data: bytes, cuts: list[int]) -> None:
    """The same property through a real pipe and a real worker (few examples)."""
    run = Path(tempfile.mkdtemp(dir=tmp_path))
    (run / "data").write_bytes(data)
    (run / "w.py").write_text(WRITER)
    captured = _Captured()

    async def main() -> Any:
        previous = set_console_hook(captured)
        try:
            async with aiolaunch.start_processes(
                name="e",
                entrypoint=sys.executable,
                args={
                    0: (
                        str(run / "w.py"),
                        str(run / "data"),
                        ",".join(str(c) for c in cuts if c <= len(data)),
                    )
                },
                envs={0: {}},
                log_dir=str(run / "logs"),
                tee=Std.OUT,
            ) as ctx:
                return await ctx.wait()
        finally:
            set_console_hook(previous)

    with _hook_lock:
        result = asyncio.run(main())
    assert result is not None and not result.is_failed()
    assert Path(result.stdouts[0]).read_bytes() == data
    assert captured.text() == _expected_console(data, "[e0]:")[0]
