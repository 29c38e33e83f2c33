"""What a zygote's imports depended on: their source files and the variables they read.

A worker forked from a zygote runs the code the zygote imported, configured
the way the zygote's environment configured it at import. That stays true
only while the files are what the zygote read and the worker's environment
says what the zygote's said: a notebook user edits a module and reruns, or
sets a variable a module reads at import. The zygote records both
(:class:`Provenance`: sent with ``Ready`` and each ``Loaded``); the
supervisor checks them before it forks (``_warm/_image.py``).

Files are those of the modules outside the interpreter's installation (the
standard library and site-packages: assumed unchanged while a process lives
- a reinstalled package needs a new process). Variables are those read by
name while the modules import (``os.environ[...]``, ``.get``, ``in``,
``os.getenv``; :class:`EnvReads`), not those merely met while a module
iterates over the whole environment.

Standard library only, like everything in this folder.
"""

from __future__ import annotations

import os
import site
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from types import TracebackType

__all__ = ["EnvReads", "Provenance", "module_files"]


@dataclass(frozen=True)
class Provenance:
    """The files a zygote's modules came from, and the variables they read at import."""

    #: path -> (``st_mtime_ns``, ``st_size``) as the zygote found them
    files: dict[str, tuple[int, int]]
    #: name -> the value the import saw (``None``: unset)
    env: dict[str, str | None]

    def __or__(self, other: Provenance) -> Provenance:
        return Provenance({**self.files, **other.files}, {**self.env, **other.env})

    def changed_file(self) -> str | None:
        """A file changed (or gone) since the zygote read it; ``None``: none."""
        for path, seen in self.files.items():
            try:
                st = os.stat(path)
            except OSError:
                return path
            if (st.st_mtime_ns, st.st_size) != seen:
                return path
        return None

    def changed_variable(
        self, env: Mapping[str, str], ignore: frozenset[str] = frozenset()
    ) -> str | None:
        """A variable read at import whose value in ``env`` differs; ``None``: none."""
        for name, seen in self.env.items():
            if name not in ignore and env.get(name) != seen:
                return name
        return None


class EnvReads:
    """Records the environment variables read by name while entered (one at a time).

    Patches ``os.environ``'s class for the duration (the zygote's imports):
    a read by name is recorded with the value it found; reads made while
    iterating over the environment are not.
    """

    def __init__(self) -> None:
        self.seen: dict[str, str | None] = {}
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> EnvReads:
        cls = type(os.environ)
        getitem, iterate = cls.__getitem__, cls.__iter__
        self._saved = (getitem, iterate)
        seen = self.seen
        iterating = 0

        def recording_getitem(environ: Any, key: str) -> str:
            try:
                value: str = getitem(environ, key)
            except KeyError:
                if not iterating:
                    seen.setdefault(key, None)
                raise
            if not iterating:
                seen.setdefault(key, value)
            return value

        def counted_iter(environ: Any) -> Iterator[str]:
            nonlocal iterating
            iterating += 1
            try:
                yield from iterate(environ)
            finally:
                iterating -= 1

        cls.__getitem__ = recording_getitem  # type: ignore[method-assign]
        cls.__iter__ = counted_iter  # type: ignore[method-assign]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._saved is not None:
            cls = type(os.environ)
            cls.__getitem__, cls.__iter__ = self._saved  # type: ignore[method-assign]
            self._saved = None


def module_files() -> dict[str, tuple[int, int]]:
    """``path -> (st_mtime_ns, st_size)`` of the loaded modules outside the installation."""
    installed = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    try:
        installed.update(site.getsitepackages())
        installed.add(site.getusersitepackages())
    except AttributeError:  # pragma: no cover - a virtualenv's old site.py
        pass
    roots = {q for p in installed if p for q in (p, os.path.realpath(p))}
    prefixes = tuple(os.path.join(root, "") for root in roots)
    files: dict[str, tuple[int, int]] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            continue
        path = os.path.abspath(path)
        if path in files or path.startswith(prefixes):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        files[path] = (st.st_mtime_ns, st.st_size)
    return files
