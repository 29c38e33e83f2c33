"""A zygote's image: what its workers inherit from it, and which workers may be forked from it.

A forked worker starts from the zygote's state: libraries loaded and
configured with the zygote's load-time environment (``OMP_*``, ``LD_*``,
``PYTHON*``... read as the interpreter starts and libraries load). A worker
whose environment disagrees on one of them would not be what a fresh start
makes: it is started the ordinary way (:meth:`Image.refusal`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._child._safety import load_time_items

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["Image"]


class Image:
    """What the workers of one zygote inherit (the zygote's environment ``env``)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        #: the load-time variables the zygote started with
        self.load_env = load_time_items(env)

    def refusal(self, env: Mapping[str, str]) -> str | None:
        """Why a worker with environment ``env`` would differ from a fresh start; ``None``: none."""
        mine, theirs = dict(self.load_env), dict(load_time_items(env))
        for name in sorted(set(mine) | set(theirs)):
            if mine.get(name) != theirs.get(name):
                return (
                    f"{name}={theirs.get(name)!r} in the worker's environment but "
                    f"{mine.get(name)!r} in the zygote's (read when a library loads)"
                )
        return None
