"""``aiolaunch``: torchrun's command line, on the asyncio agent.

``aiolaunch [options] script.py [script args]`` takes torchrun's flags, their
defaults, their underscore spellings (``--nproc_per_node``) and their
``PET_*`` environment variables, so that replacing ``torchrun`` with
``aiolaunch`` in a command line just works. One machine (the default, or
``--standalone``) needs no torch; several machines join through torch's own
rendezvous (``--rdzv-backend c10d``).

Only the standard library is imported until the arguments are parsed, so
``aiolaunch --help`` is instant.
"""

from __future__ import annotations

from ._checks import parse_endpoint
from ._config import (
    LaunchConfig,
    config_from_args,
    determine_local_world_size,
    parse_min_max_nnodes,
    parse_rdzv_conf,
    run_script_path,
)
from ._main import main
from ._parser import get_args_parser, parse_args

__all__ = [
    "LaunchConfig",
    "config_from_args",
    "determine_local_world_size",
    "get_args_parser",
    "main",
    "parse_args",
    "parse_endpoint",
    "parse_min_max_nnodes",
    "parse_rdzv_conf",
    "run_script_path",
]
