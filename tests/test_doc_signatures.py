"""The signatures the docs show are the code's.

README.md, docs/guide.md and docs/api.md show calls of the public API with
their parameters (``start_processes(name, entrypoint, ..., preload=None)``,
``ctx.wait(timeout=None)``). Every parameter a page names must exist, with the
default the page gives; a signature shown whole (a ``python`` block that is
one call) must list every parameter, in order. A page that drifts from the
code - a parameter added, renamed or given another default - fails here.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import aiolaunch
import aiolaunch.agent

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "docs" / "api.md"]

#: what a page may call, by the name it uses
CALLABLES: dict[str, Any] = {
    "start_processes": aiolaunch.start_processes,
    "launch": aiolaunch.launch,
    "wait": aiolaunch.PContext.wait,
    "close": aiolaunch.PContext.close,
    "dump_stacks": aiolaunch.PContext.dump_stacks,
    "events": aiolaunch.PContext.events,
    "wait_ready": aiolaunch.PContext.wait_ready,
    "Watchdog": aiolaunch.Watchdog,
    "RestartPolicy": aiolaunch.RestartPolicy,
    "DefaultLogsSpecs": aiolaunch.DefaultLogsSpecs,
    "ProcessFailure": aiolaunch.ProcessFailure,
    "WorkerSpec": aiolaunch.agent.WorkerSpec,
    "LocalElasticAgent": aiolaunch.agent.LocalElasticAgent,
}

_CALL = re.compile(r"\b(?:\w+\.)*(" + "|".join(CALLABLES) + r")\(")


def _parameters(fn: Any) -> dict[str, inspect.Parameter]:
    params = dict(inspect.signature(fn).parameters)
    params.pop("self", None)
    return params


def _snippets(text: str) -> list[tuple[str, bool]]:
    """``(code, whole)``: inline code spans, and ``python`` blocks (``whole``:
    the block is one bare call, a signature shown whole)."""
    out = [(m.group(1), False) for m in re.finditer(r"`([^`\n]+)`", text)]
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        block = re.sub(r",\s*\*\s*,", ",", block)  # a bare `*` in a shown signature
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue
        whole = len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr)
        out.append((block, whole))
    return out


def _calls(code: str) -> list[tuple[str, ast.Call]]:
    """The calls of :data:`CALLABLES` in ``code`` (a span may be a fragment:
    ``await ctx.wait(timeout=None)`` parses, ``start_processes(..., x=1)`` too)."""
    found = []
    for m in _CALL.finditer(code):
        start, depth = m.end() - 1, 0
        for i in range(start, len(code)):
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            if depth == 0:
                text = code[m.start(1) : i + 1].replace("...", "_ellipsis_")
                text = re.sub(r",\s*\*\s*,", ",", text)  # a bare `*` in a shown signature
                try:
                    node = ast.parse(text, mode="eval").body
                except SyntaxError:
                    break
                if isinstance(node, ast.Call):
                    found.append((m.group(1), node))
                break
    return found


def _default(node: ast.expr) -> object:
    text = ast.unparse(node)
    try:
        return ast.literal_eval(node)
    except ValueError:
        return text  # Std.NONE, SIGTERM: compared by name below


def _same_default(shown: object, real: object) -> bool:
    if isinstance(shown, str) and not isinstance(real, str):
        return shown.split(".")[-1] == getattr(real, "name", repr(real))
    if isinstance(shown, int | float) and isinstance(real, int | float):
        return float(shown) == float(real)
    return shown == real


def _check(page: Path, code: str, whole: bool) -> list[str]:
    wrong = []
    for name, call in _calls(code):
        params = _parameters(CALLABLES[name])
        shown = [k.arg for k in call.keywords if k.arg is not None]
        for kw in call.keywords:
            if kw.arg is None:
                continue
            if kw.arg not in params:
                wrong.append(f"{page.name}: {name}() has no parameter {kw.arg!r}")
                continue
            real = params[kw.arg].default
            shown_default = _default(kw.value)
            if (
                whole
                and real is not inspect.Parameter.empty
                and not _same_default(shown_default, real)
            ):
                wrong.append(
                    f"{page.name}: {name}({kw.arg}=...) shows {ast.unparse(kw.value)}, "
                    f"the code's default is {real!r}"
                )
        if whole:
            positional = [a.id for a in call.args if isinstance(a, ast.Name)]
            listed = positional + shown
            if listed != list(params):
                wrong.append(f"{page.name}: {name}{listed} is not the code's {list(params)}")
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_signatures_a_page_shows_are_the_codes(page: Path) -> None:
    wrong = [w for code, whole in _snippets(page.read_text()) for w in _check(page, code, whole)]
    assert not wrong, "; ".join(wrong)


def test_the_guide_shows_start_processes_whole() -> None:
    # The check above must see a whole signature, or it would check nothing.
    shown = [
        code
        for code, whole in _snippets((ROOT / "docs" / "guide.md").read_text())
        if whole and code.startswith("start_processes(")
    ]
    assert len(shown) == 1


def test_a_stale_signature_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "`ctx.wait(timeout=None, poll=1)`\n\n"
        "```python\nlaunch(func, args, nprocs, master_addr='localhost')\n```\n"
    )
    wrong = [w for code, whole in _snippets(page.read_text()) for w in _check(page, code, whole)]
    assert any("no parameter 'poll'" in w for w in wrong), wrong
    assert any("is not the code's" in w for w in wrong), wrong
