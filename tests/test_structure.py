"""The package's shape stays within the limits issue #21 set (read from the code).

- no import cycle between aiolaunch's modules, counting imports inside
  functions and under ``TYPE_CHECKING`` (a cycle hidden in a function is
  still two modules that cannot be understood, or changed, one at a time);
- no module over 450 lines, no class over 250;
- no reaching into another object's private attributes (``ctx._workers``):
  an object's state is changed through its methods, by its one owner.

These are rules about the text, so they are checked on the text (``ast``),
without importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "aiolaunch"

MODULE_LINES = 450
CLASS_LINES = 250

# Private names read on objects that are not ours to change: each one a
# documented exception, with its reason.
ALLOWED_REACHES = {
    # CPython's and torch's internals, kept behind one module each
    "_compat.py",
    "_signals/_compat.py",
    "agent/_numa.py",  # torch's numa binding helpers (torch.numa is private API)
    "_cli/_config.py",  # torch.distributed.run's _get_default_... (torchrun's defaults)
}
# Names that are private by spelling only (module-level functions of our own
# package read through a module alias, CPython's documented underscore API).
ALLOWED_ATTRS = {
    "_exit",  # os._exit
    "_getframe",  # sys._getframe
    "_current_frames",  # sys._current_frames
    "_fields",  # namedtuple
    "_replace",  # namedtuple
    "_asdict",  # namedtuple
    "_value_",  # enum
    "_name_",  # enum
    "_missing_",  # enum
    "_is_coroutine",  # asyncio's marker
    "_thread",  # threading's module
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every aiolaunch module ``name`` imports, anywhere in its text."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in modules:
                continue
            # `from pkg import sub` imports the submodule; `from pkg import name`
            # reads the package itself.
            subs = [f"{target}.{a.name}" for a in node.names]
            if all(s in modules for s in subs):
                found.update(subs)
            else:
                found.add(target)
                found.update(s for s in subs if s in modules)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # The package's own __init__ re-exports lazily (module __getattr__) and is
    # imported before any submodule anyway; an edge *to* it from a submodule
    # that reads a name from the façade is still counted.
    assert _cycles(graph) == []


def test_module_and_class_sizes() -> None:
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(PACKAGE).as_posix()
        lines = text.count("\n")
        if lines > MODULE_LINES:
            too_big.append(f"{rel}: {lines} lines (limit {MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                size = node.end_lineno - node.lineno + 1
                if size > CLASS_LINES:
                    too_big.append(f"{rel}: class {node.name} {size} lines (limit {CLASS_LINES})")
    assert not too_big, "split these: " + "; ".join(too_big)


def _private_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    modules_read = {
        a.asname or a.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for a in node.names
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__") or attr in ALLOWED_ATTRS:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "other"):
            continue  # `other`: the same class's instance, in __eq__ and friends
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
            continue
        if isinstance(owner, ast.Name) and (owner.id in modules_read or owner.id.startswith("_")):
            continue  # a module of ours (`_proc._x`), or a name private itself
        found.append((node.lineno, f"{ast.unparse(owner)}.{attr}"))
    return found


def test_private_reach_finder_sees_a_reach() -> None:
    tree = ast.parse("def f(ctx):\n    return ctx._workers, self._ok, os._exit\nimport os\n")
    assert _private_reaches(tree) == [(2, "ctx._workers")]


def test_no_reaching_into_private_attributes() -> None:
    reaches = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED_REACHES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        reaches += [f"{rel}:{line} {text}" for line, text in _private_reaches(tree)]
    assert not reaches, "give these objects a method instead: " + "; ".join(reaches)
