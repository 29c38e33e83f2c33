"""The rules of the package's layout, read from the code (docs/ARCHITECTURE.md, "Rules").

- no import cycle between aiolaunch's modules, counting imports inside
  functions and under ``TYPE_CHECKING`` (a cycle hidden in a function is
  still two modules that cannot be understood, or changed, one at a time);
- the wings depend on the core and on each other in one direction only
  (:data:`FORBIDDEN`): no arrow runs back up;
- code that runs inside a worker or the zygote (``_child/``) imports only the
  standard library and its siblings: a worker pays for no import of the
  supervisor's, and importing it starts no thread and loads nothing else
  (checked in a fresh interpreter);
- ``/proc`` is opened through one door on each side (:data:`PROC_DOORS`);
- at most :data:`ROOT_MODULES` modules in the package root (the rest live in
  the wing they belong to), and one sanity bound on a module's size
  (:data:`MODULE_LINES`: a module that long holds more than one concept);
- no reaching into another object's private attributes (``ctx._workers``):
  an object's state is changed through its methods, by its one owner;
- no ``# fmt: skip`` (the formatter decides how code is laid out) and no
  measurement diary in comments (dates, issue numbers, trial counts belong in
  the commit log and benchmarks/README.md).

Rules about the text are checked on the text (``ast``, ``tokenize``), without
importing anything.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "aiolaunch"

#: the most modules in the package root
ROOT_MODULES = 25
#: the most lines in one module
MODULE_LINES = 600

#: ``(importer, imported)``: folders (or modules) that must never import the
#: other, each with why. A prefix matches a module and everything below it.
FORBIDDEN: list[tuple[str, str, str]] = [
    ("aiolaunch._workers", "aiolaunch._logs", "the context wires streams to spawns"),
    ("aiolaunch._workers", "aiolaunch._hangs", "launching knows nothing of forensics"),
    ("aiolaunch._workers", "aiolaunch._live", "launching knows nothing of the live view"),
    ("aiolaunch._workers", "aiolaunch._warm", "warm start builds on launching"),
    ("aiolaunch._logs", "aiolaunch._hangs", "the log pipeline feeds listeners it does not know"),
    ("aiolaunch._logs", "aiolaunch._live", "the log pipeline feeds listeners it does not know"),
    ("aiolaunch._hangs", "aiolaunch._live", "the live view reads the forensics, not the reverse"),
    ("aiolaunch._signals", "aiolaunch._ending", "the signal race reports; the ending decides"),
    ("aiolaunch._group", "aiolaunch._ending", "the state knows no one who acts on it"),
]
for wing in ("_hangs", "_live", "_warm", "_logs", "_workers", "_signals", "_child"):
    FORBIDDEN.append((f"aiolaunch.{wing}", "aiolaunch.agent", "the agent builds on the wings"))
    FORBIDDEN.append((f"aiolaunch.{wing}", "aiolaunch._cli", "the command line is the top"))

#: the modules that open ``/proc``: the supervisor side's door, the worker
#: side's, and the guardian (a /bin/sh script that runs after the supervisor died)
PROC_DOORS = {"_workers/_proc.py", "_child/_proc.py", "_workers/_guardian.py"}

#: third-party modules a ``_child`` module may import inside a function, with why
CHILD_MAY_IMPORT_LATE = {
    # The payload's own format: a function sent by value is unpickled with it.
    "cloudpickle",
    # Already loaded where it is used (the zygote preloaded it, or the program
    # imported it): the worker side never imports torch first.
    "torch",
}

# Private names read on objects that are not ours to change: each one a
# documented exception, with its reason.
ALLOWED_REACHES = {
    # CPython's and torch's internals, kept behind one module each
    "_compat.py",
    "_child/_compat.py",
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


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def _import_targets(
    node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules: dict[str, Path]
) -> set[str]:
    """What one import statement of module ``name`` imports: aiolaunch modules by
    their name, anything else by its top-level name."""
    if isinstance(node, ast.Import):
        return {a.name if a.name in modules else a.name.split(".")[0] for a in node.names}
    if not node.level:
        target = node.module or ""
        if not target.startswith("aiolaunch"):
            return {target.split(".")[0]}
    else:
        package = name if is_package else name.rpartition(".")[0]
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    if target not in modules:
        return set()
    # `from pkg import sub` imports the submodule; `from pkg import name`
    # reads the package itself.
    subs = [f"{target}.{a.name}" for a in node.names]
    if all(s in modules for s in subs):
        return set(subs)
    return {target} | {s for s in subs if s in modules}


def _imports(
    name: str, path: Path, modules: dict[str, Path], *, runtime_only: bool = False
) -> set[str]:
    """Every module ``name`` imports, anywhere in its text (``runtime_only``:
    not under ``TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_blocks(tree) if runtime_only else set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip:
            found |= _import_targets(node, name, path.name == "__init__.py", modules)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {m for m in _imports(name, path, modules) if m in modules}
        for name, path in modules.items()
    }


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


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# -- imports ----------------------------------------------------------------------


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    # The package's own __init__ re-exports lazily (module __getattr__) and is
    # imported before any submodule anyway; an edge *to* it from a submodule
    # that reads a name from the façade is still counted.
    assert _cycles(_graph()) == []


def test_no_arrow_runs_back_up() -> None:
    wrong = [
        f"{importer} imports {imported} ({why})"
        for importer, imports in sorted(_graph().items())
        for imported in sorted(imports)
        for low, high, why in FORBIDDEN
        if _under(importer, low) and _under(imported, high)
    ]
    assert not wrong, "; ".join(wrong)


def _stdlib(name: str) -> bool:
    return name in sys.stdlib_module_names or name == "__future__"


def test_child_side_imports_only_the_standard_library_and_its_siblings() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if not _under(name, "aiolaunch._child"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_blocks(tree)
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in skip:
                continue
            for target in _import_targets(node, name, path.name == "__init__.py", modules):
                if _under(target, "aiolaunch._child") or _stdlib(target):
                    continue
                late = id(node) not in top_level and target in CHILD_MAY_IMPORT_LATE
                if not late:
                    wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {target}")
    assert not wrong, "code that runs in a worker or the zygote: " + "; ".join(wrong)


def test_the_rule_sees_a_forbidden_import(tmp_path: Path) -> None:
    # The walk above must see a supervisor module imported from a child module.
    tree = ast.parse("from .._logs import LogWiring\nimport os\n")
    node = tree.body[0]
    assert isinstance(node, ast.ImportFrom)
    targets = _import_targets(node, "aiolaunch._child._x", False, _modules())
    assert targets == {"aiolaunch._logs"}


def test_child_modules_import_cheaply_and_start_no_thread() -> None:
    # In a fresh interpreter: what importing every worker-side module adds to
    # sys.modules is the standard library, aiolaunch's façade and _child alone.
    names = sorted(n for n in _modules() if _under(n, "aiolaunch._child"))
    code = (
        "import sys, threading\n"
        "before = set(sys.modules)\n"
        f"for name in {names!r}:\n"
        "    __import__(name)\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print(threading.active_count())\n"
        "print(' '.join(new))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "1", "importing the worker side started a thread"
    foreign = [
        m
        for m in out[1].split()
        if not _stdlib(m.split(".")[0])
        and m not in ("aiolaunch", "aiolaunch._version")
        and not _under(m, "aiolaunch._child")
    ]
    assert not foreign, f"importing the worker side loaded {foreign}"


# -- /proc ------------------------------------------------------------------------


def _proc_paths(tree: ast.AST) -> list[int]:
    """Lines of string literals naming a /proc path (docstrings aside)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str | bytes)
        and id(node) not in docstrings
        and re.search(r"/proc(/|$)", node.value if isinstance(node.value, str) else "")
    ]


def test_the_proc_finder_sees_a_path() -> None:
    tree = ast.parse('"""about /proc"""\nopen(f"/proc/{pid}/stat")\nx = "/procedure"\n')
    assert _proc_paths(tree) == [2]


def test_proc_is_opened_through_its_doors() -> None:
    opening = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if _proc_paths(ast.parse(path.read_text(encoding="utf-8")))
    }
    assert opening <= PROC_DOORS, f"read /proc through _workers/_proc.py: {opening - PROC_DOORS}"


# -- size and shape ---------------------------------------------------------------


def test_the_root_keeps_the_core() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES, f"{len(root)} modules in the root: {root}"


def test_no_module_is_huge() -> None:
    too_big = [
        f"{path.relative_to(PACKAGE)}: {lines} lines"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := path.read_text(encoding="utf-8").count("\n")) > MODULE_LINES
    ]
    assert not too_big, f"over {MODULE_LINES} lines (more than one concept?): {too_big}"


def _comments(path: Path) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]


_DIARY = re.compile(r"20\d\d-\d\d-\d\d|(?<![\w/])#\d\d\b| trials\b")


@pytest.mark.parametrize(
    ("comment", "diary"),
    [
        ("# measured 2026-11-27, 30 trials a side", True),
        ("# see #26", True),
        ("# pytorch#56297: the Reducer's dealloc", False),
        ("# fmt-free comment on why", False),
    ],
)
def test_the_diary_finder(comment: str, diary: bool) -> None:
    assert bool(_DIARY.search(comment)) is diary


def test_comments_are_no_diary_and_no_formatter_escape() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{line} {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in _comments(path)
        if _DIARY.search(text) or "fmt: skip" in text or "fmt: off" in text
    ]
    assert not found, "; ".join(found)


# -- privates ---------------------------------------------------------------------


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
