"""docs/modules.md lists every module of the package; docs/ARCHITECTURE.md names only what exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "aiolaunch"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
INDEX = ROOT / "docs" / "modules.md"


def _module_table() -> str:
    text = INDEX.read_text(encoding="utf-8")
    match = re.search(r"^```\n(.*?)```", text, re.S | re.M)
    assert match is not None, "docs/modules.md has no table"
    return match.group(1)


def test_every_module_is_in_the_architecture_table() -> None:
    listed = set(re.findall(r"^(\S+\.py)\b", _module_table(), re.M))
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    missing = sorted(modules - listed)
    assert not missing, f"add these modules to the table of docs/modules.md: {missing}"
    gone = sorted(listed - modules)
    assert not gone, f"the table of docs/modules.md lists modules that are gone: {gone}"


def test_each_row_says_what_the_module_is_for() -> None:
    for line in _module_table().splitlines():
        if re.match(r"^\S+\.py\b", line):
            assert len(line.split(None, 1)) == 2, f"a row without a description: {line!r}"


def _defined_names() -> set[str]:
    """Every name the package defines or reads: modules, functions, classes, attributes."""
    import ast

    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        names.add(path.stem)
        names.update(path.relative_to(PACKAGE).parts[:-1])  # the folders: `_hangs`
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):  # set, or read (CPython's, in _compat)
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)  # getattr(loop, "_signal_handlers")
    return names


def test_every_private_name_the_page_mentions_exists() -> None:
    # A redesign renames the middle; the page must not describe what is gone
    # (it once named `_decided()`, `_kill_now` and `PContext._forward_signal`
    # long after they were removed).
    text = DOC.read_text(encoding="utf-8")
    spans = re.findall(r"`([^`\n]+)`", text)
    mentioned = {
        name
        for span in spans
        for name in re.findall(
            r"(?<![\w.])_[A-Za-z][A-Za-z0-9_]*|(?<=\.)_[A-Za-z][A-Za-z0-9_]*", span
        )
    }
    missing = sorted(mentioned - _defined_names())
    assert not missing, f"docs/ARCHITECTURE.md names what src/aiolaunch does not define: {missing}"
