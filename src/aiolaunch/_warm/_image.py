"""A zygote's image: what its workers inherit from it, and which workers may be forked from it.

A forked worker starts from the zygote's state: libraries loaded and
configured with the zygote's load-time environment (``OMP_*``, ``LD_*``,
``PYTHON*``... read as the interpreter starts and libraries load), and the
code of the modules it imported, as the files were and as the variables
they read at import said (their provenance: :mod:`aiolaunch._child._provenance`).

A worker whose environment disagrees with the zygote's on a load-time
variable, or on a variable a preloaded module read at import, would not be
what a fresh start makes: it is started the ordinary way
(:meth:`Image.refusal`). A zygote whose files changed since, or whose
imports read a variable the supervisor's environment now sets otherwise,
is stale (:meth:`Image.stale`): a new one replaces it before any worker is
forked, so no group runs old code, nor two versions of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._child._provenance import Provenance
from .._child._safety import load_time_items
from ._start import SET_BY_US

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["Image"]


class Image:
    """What the workers of one zygote inherit (the zygote's environment ``env``)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        #: the load-time variables the zygote started with
        self.load_env = load_time_items(env)
        #: what its imports depended on (known once it is ready)
        self.provenance = Provenance({}, {})

    def imported(self, provenance: Provenance) -> None:
        """The zygote imported more (``Ready``, ``Loaded``)."""
        self.provenance = self.provenance | provenance

    def refusal(self, env: Mapping[str, str]) -> str | None:
        """Why a worker with environment ``env`` would differ from a fresh start; ``None``: none."""
        mine, theirs = dict(self.load_env), dict(load_time_items(env))
        for name in sorted(set(mine) | set(theirs)):
            if mine.get(name) != theirs.get(name):
                return (
                    f"{name}={theirs.get(name)!r} in the worker's environment but "
                    f"{mine.get(name)!r} in the zygote's (read when a library loads)"
                )
        return self._read_otherwise(env, "the worker's environment")

    def stale(self, env: Mapping[str, str]) -> str | None:
        """Why the zygote no longer holds what a fresh start would import with ``env``."""
        path = self.provenance.changed_file()
        if path is not None:
            return f"{path} changed since the zygote imported it"
        return self._read_otherwise(env, "the environment")

    def _read_otherwise(self, env: Mapping[str, str], whose: str) -> str | None:
        name = self.provenance.changed_variable(env, ignore=SET_BY_US)
        if name is None:
            return None
        seen = self.provenance.env[name]
        return (
            f"{name}={env.get(name)!r} in {whose} but {seen!r} when the zygote imported "
            "its modules (a preloaded module read it at import)"
        )
