"""Small shared types: :class:`Std`, :func:`to_map`, the package's type aliases
and :class:`PerProcess`, the fork-aware per-process singleton.

This is a leaf module: it imports nothing else from aiolaunch, so function
workers and the error-file helpers can import it cheaply.
"""

from __future__ import annotations

import os
import re
import threading
from enum import IntFlag
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["JSON", "START_METHODS", "PerProcess", "Std", "StdSpec", "to_map"]

#: The multiprocessing start methods a function worker may use (CLI choices too).
START_METHODS = ("spawn", "fork", "forkserver")

_T = TypeVar("_T")

#: A decoded JSON object, e.g. the contents of an error file.
JSON: TypeAlias = dict[str, Any]

# One digit 0-3; torch's _VALUE_REGEX.
_VALUE_RE = re.compile(r"[0-3]")
# "rank:value" pairs separated by commas. Unlike torch (``\d:[0123]``), ranks
# may have several digits, so "10:3" works on hosts with more than 10 workers.
_MAPPING_RE = re.compile(r"\d+:[0-3](?:,\d+:[0-3])*")


class Std(IntFlag):
    """Which standard streams of a worker a setting (``redirects``, ``tee``) applies to.

    A flag: ``Std.ALL == Std.OUT | Std.ERR``, and ``setting & Std.OUT`` tells
    whether stdout is concerned. The values match torch's
    ``torch.distributed.elastic.multiprocessing.Std``, so ``int`` settings and
    command-line strings mean the same thing in both.
    """

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """Parse a command-line setting, with torch's syntax.

        ``"3"`` gives ``Std.ALL`` (one value for every rank); ``"0:3,1:0"``
        gives ``{0: Std.ALL, 1: Std.NONE}`` (per local rank; ranks not named
        are left out, and :func:`to_map` later treats them as ``Std.NONE``).
        Unlike torch, ranks may have several digits (``"10:3"``).

        :param vm: the setting, e.g. the value of ``--redirects``.
        :returns: a :class:`Std`, or a ``{local_rank: Std}`` mapping.
        :raises ValueError: ``vm`` is neither a digit 0-3 nor a comma-separated
            list of ``rank:digit`` pairs, or it names a rank twice. The message
            quotes ``vm``.
        """
        if not isinstance(vm, str):
            raise TypeError(f"Std.from_str() takes a str, not {type(vm).__name__}: {vm!r}")
        if _VALUE_RE.fullmatch(vm):
            return cls(int(vm))
        if _MAPPING_RE.fullmatch(vm):
            mapping: dict[int, Std] = {}
            for pair in vm.split(","):
                rank_str, value = pair.split(":")
                rank = int(rank_str)
                if rank in mapping:
                    raise ValueError(f"invalid Std setting {vm!r}: local rank {rank} appears twice")
                mapping[rank] = cls(int(value))
            return mapping
        raise ValueError(
            f"invalid Std setting {vm!r}: use one digit 0-3 for every rank "
            "(0=NONE, 1=OUT, 2=ERR, 3=ALL), e.g. '3', or 'rank:digit' pairs "
            "separated by commas, e.g. '0:3,1:0'"
        )


#: What ``redirects=`` and ``tee=`` accept: one :class:`Std` for every rank,
#: or ``{local_rank: Std}``.
StdSpec: TypeAlias = Std | dict[int, Std]


def to_map(val_or_map: Std | dict[int, Std], local_world_size: int) -> dict[int, Std]:
    """Expand a :class:`Std` setting to one value per local rank (torch's semantics).

    A single :class:`Std` applies to every rank; a mapping gives each rank
    ``0 .. local_world_size - 1`` its value, ``Std.NONE`` for ranks it does
    not name. Keys outside that range are ignored, as torch does. Plain ints
    are accepted where a :class:`Std` is expected and converted.

    ::

        to_map(Std.OUT, 2)     # {0: Std.OUT, 1: Std.OUT}
        to_map({1: Std.OUT}, 2)  # {0: Std.NONE, 1: Std.OUT}

    :param val_or_map: one setting, or ``{local_rank: Std}``.
    :param local_world_size: the number of local ranks.
    :returns: a new dict with exactly the keys ``0 .. local_world_size - 1``.
    """
    if isinstance(val_or_map, int):  # Std is an int subclass
        value = Std(val_or_map)
        return dict.fromkeys(range(local_world_size), value)
    return {rank: Std(val_or_map.get(rank, Std.NONE)) for rank in range(local_world_size)}


class PerProcess(Generic[_T]):
    """A value made once per process, on first use: the fork-aware singleton.

    A child forked from the process that made the value makes its own on its
    first :meth:`get` - it never uses its parent's threads, pipes or helper
    processes, which a fork does not carry over (threads) or which belong to
    the parent (a pipe whose only writer must be the supervisor). The parent's
    value is left alone in the child: closing it there could break the
    parent's use of shared fds. Thread-safe.
    """

    def __init__(self, make: Callable[[], _T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._value: tuple[int, _T] | None = None

    def get(self) -> _T:
        """This process's value, made now if it has none yet."""
        with self._lock:
            if self._value is None or self._value[0] != os.getpid():
                self._value = (os.getpid(), self._make())
            return self._value[1]

    def peek(self) -> _T | None:
        """This process's value if it was made, else ``None``; makes nothing."""
        value = self._value
        if value is None or value[0] != os.getpid():
            return None
        return value[1]
