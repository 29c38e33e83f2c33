"""What a zygote preloads: the ``preload`` argument, checked, and the load-time environment.

Imports only the standard library; nothing here starts a process.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._child._bootstrap import BOOTSTRAP
from .._child._zygote import load_time_items

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "DEFAULT_PRELOAD",
    "TORCH_LATER",
    "Preload",
    "resolve_preload",
    "shared_load_env",
    "supported",
    "workers_folder",
]

#: what ``preload=True`` (and the CLI's default, for a script that imports torch) imports
DEFAULT_PRELOAD = ("torch",)
#: imported by the zygote once its first workers run, when torch is preloaded:
#: DDP, FSDP and torch.compile import it on first use (~1-2 s per worker)
TORCH_LATER = ("torch._dynamo",)


@dataclass(frozen=True)
class Preload:
    """The modules a zygote imports before its first fork (``now``), and after it.

    ``folder``: where the zygote imports from first (its ``sys.path[0]``), as
    the workers' own ``sys.path[0]`` is: a script's folder, so that a module
    beside the script preloads as the script imports it; ``""``: the current
    folder.
    """

    now: tuple[str, ...]
    later: tuple[str, ...] = ()
    folder: str = ""


def resolve_preload(preload: object, what: str = "preload", folder: str = "") -> Preload | None:
    """Check ``preload`` (``None``/``False``: off; ``True``: torch; module names).

    With torch among the modules, ``torch._dynamo`` is imported later (once
    the first workers run). ``folder``: the workers' ``sys.path[0]`` (a
    script's folder, :func:`workers_folder`; ``""``: the current one), where
    a module may be too: when one is found only there, the zygote imports
    from there first (:attr:`Preload.folder`); otherwise the zygote is the
    one of every folder.

    :raises TypeError: not a bool, ``None`` or a list of str.
    :raises ValueError: a name that is not a dotted module name, or whose
        top-level package is not installed (found without importing it).
    """
    if preload is None or preload is False:
        return None
    if isinstance(preload, Preload):
        return preload
    if preload is True:
        names: tuple[str, ...] = DEFAULT_PRELOAD
    elif isinstance(preload, str) or not isinstance(preload, list | tuple):
        raise TypeError(
            f"{what}={preload!r} must be True, False, None or a list of module names, "
            f"e.g. {what}=['torch']"
        )
    else:
        names = tuple(preload)
    import importlib.util

    beside = False
    for name in names:
        if not isinstance(name, str) or not all(p.isidentifier() for p in name.split(".")):
            raise ValueError(f"{what}: {name!r} is not a module name such as 'torch' or 'a.b'")
        top = name.partition(".")[0]
        if top in sys.modules or importlib.util.find_spec(top) is not None or _in_folder(top, ""):
            continue  # installed, or in the current folder (the zygote's own sys.path[0])
        if folder and _in_folder(top, folder):
            beside = True
            continue
        raise ValueError(
            f"{what}: no module named {top!r} is installed, nor in {folder or os.getcwd()}; "
            f"install it or leave {name!r} out of {what}"
        )
    if not names:
        return None
    later = TORCH_LATER if "torch" in names else ()
    return Preload(
        tuple(dict.fromkeys(names)),
        tuple(m for m in later if m not in names),
        folder if beside else "",
    )


def workers_folder(entrypoint: object, args: Sequence[object]) -> str:
    """The ``sys.path[0]`` of workers that run ``entrypoint`` with ``args``,
    for :attr:`Preload.folder`: a Python script's folder (``python [-u] [-m
    aiolaunch._child._bootstrap] script.py``; a folder run as a script is
    itself), else ``""`` (``-m``, ``-c``, a function, a binary: the current
    folder, as the zygote's own)."""
    if not isinstance(entrypoint, str) or os.path.realpath(entrypoint) != os.path.realpath(
        sys.executable
    ):
        return ""
    rest = [str(a) for a in args]
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if rest[:2] == ["-m", BOOTSTRAP]:
        rest = rest[2:]
    if not rest or rest[0].startswith("-"):
        return ""
    script = os.path.abspath(rest[0])
    return script if os.path.isdir(script) else os.path.dirname(script)


def _in_folder(name: str, folder: str) -> bool:
    # The zygote's sys.path[0]: the folder, else its current one (``python -c``).
    from importlib.machinery import PathFinder

    return PathFinder.find_spec(name, [folder or os.getcwd()]) is not None


def supported() -> bool:
    """Whether workers can be forked from a zygote here (Linux, pidfds)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def shared_load_env(envs: Mapping[int, Mapping[str, str]]) -> dict[str, str]:
    """The zygote's share of ``envs``: each load-time variable as most ranks set it.

    A rank that sets one otherwise is started the ordinary way (its value
    must take effect as the libraries load).
    """
    from collections import Counter

    per_rank = [dict(load_time_items(env)) for env in envs.values()]
    names = {name for env in per_rank for name in env}
    out: dict[str, str] = {}
    for name in sorted(names):
        value, _ = Counter(env.get(name) for env in per_rank).most_common(1)[0]
        if value is not None:
            out[name] = value
    return out
