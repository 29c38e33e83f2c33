"""Fork safety: when a fork of the zygote gives a sound child, and what must agree with it.

:func:`fork_hazard` is checked before every fork (and at ``ready``): one
thread (after the fork handlers of pools such as OpenBLAS's ran), no CUDA.
:func:`load_time_items` is what a worker's environment must share with the
zygote's to be forked rather than started the ordinary way: the variables
read as the interpreter starts and libraries load.

Standard library only, like everything in this folder.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from ._proc import library_loaded, thread_ids

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "LOAD_TIME_NAMES",
    "LOAD_TIME_PREFIXES",
    "fork_hazard",
    "load_time_items",
]

#: Environment variables read when the interpreter starts or a preloaded
#: library loads (the interpreter's, glibc's, OpenMP's, BLAS's, torch's). A
#: worker is forked only if its environment agrees with the zygote's on all
#: of them; else it is started the ordinary way, where they take effect.
LOAD_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "LC_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO_",
    "TORCH_",
    "PYTORCH_",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
)
LOAD_TIME_NAMES = frozenset({"LANG", "LANGUAGE"})


def load_time_items(env: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    """The ``(name, value)`` pairs of ``env`` that are read at load time."""
    return frozenset(
        (k, v) for k, v in env.items() if k in LOAD_TIME_NAMES or k.startswith(LOAD_TIME_PREFIXES)
    )


def _threads() -> int:
    tids = thread_ids()
    if tids is None:  # pragma: no cover - no procfs
        import threading

        return threading.active_count()
    return len(tids)


def _probe_fork() -> None:
    # A fork runs the pthread_atfork handlers: OpenBLAS (imported by numpy,
    # which torch imports) stops its thread pool there and starts it again
    # only at its next call, which the zygote never makes.
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child exits at once
        os._exit(0)
    os.waitpid(pid, 0)


def _cuda_loaded() -> bool:
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None:
        try:
            if cuda.is_initialized():
                return True
        except Exception:  # pragma: no cover - a broken torch
            return True
    # The CUDA driver is loaded by the first CUDA call, not by torch's
    # import; torch.cuda.is_available() loads it unless
    # PYTORCH_NVML_BASED_CUDA_CHECK=1 (set in the zygote's environment).
    return library_loaded(b"/libcuda.so")


def fork_hazard() -> str | None:
    """Why a fork of this process now could give a broken child; ``None``: safe."""
    n = _threads()
    if n > 1:
        _probe_fork()
        n = _threads()
        if n > 1:
            return (
                f"{n} threads run in the zygote (a preloaded module started a thread "
                "or ran a parallel op at import)"
            )
    if _cuda_loaded():
        return "CUDA was initialised in the zygote (a preloaded module touched the GPU)"
    return None
