"""The elastic agent: torchrun's ``LocalElasticAgent``, asyncio-native.

``import aiolaunch.agent`` never imports torch; a torch rendezvous handler is
only touched when one is passed in ``WorkerSpec(rdzv_handler=...)``.
"""

from __future__ import annotations

from ._agent import LocalElasticAgent as LocalElasticAgent
from ._rendezvous._static import StaticRendezvous as StaticRendezvous
from ._resilience import Resilience as Resilience
from ._spec import RunResult as RunResult
from ._spec import WorkerSpec as WorkerSpec
from ._spec import WorkerState as WorkerState

__all__ = [
    "LocalElasticAgent",
    "Resilience",
    "RunResult",
    "StaticRendezvous",
    "WorkerSpec",
    "WorkerState",
]

# Public objects name ``aiolaunch.agent`` as their module, so reprs, tracebacks
# and pickles show the public path and survive internal moves.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
