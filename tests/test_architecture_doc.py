"""docs/ARCHITECTURE.md lists every module of the package (issue #16.6)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "aiolaunch"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _module_table() -> str:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"^## Modules\n.*?```\n(.*?)```", text, re.S | re.M)
    assert match is not None, "docs/ARCHITECTURE.md has no '## Modules' table"
    return match.group(1)


def test_every_module_is_in_the_architecture_table() -> None:
    listed = set(re.findall(r"^(\S+\.py)\b", _module_table(), re.M))
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    missing = sorted(modules - listed)
    assert not missing, f"add these modules to the table of docs/ARCHITECTURE.md: {missing}"
    gone = sorted(listed - modules)
    assert not gone, f"the table of docs/ARCHITECTURE.md lists modules that are gone: {gone}"


def test_each_row_says_what_the_module_is_for() -> None:
    for line in _module_table().splitlines():
        if re.match(r"^\S+\.py\b", line):
            assert len(line.split(None, 1)) == 2, f"a row without a description: {line!r}"
