"""argparse actions for torchrun's options: ``PET_*`` defaults, choices, lists.

``PET_<NAME>`` in the environment is an option's default, as in torchrun;
the options given on the command line are recorded in the namespace's
:data:`GIVEN` attribute (the Slurm and Kubernetes defaults never override
them). Standard library only: ``aiolaunch --help`` stays instant.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["GIVEN", "BadEnvironment", "EnvFlag", "EnvOption", "comma_list", "env_name", "one_of"]

#: the namespace attribute with the dests given on the command line (``EnvOption`` options)
GIVEN = "given_options"


def env_name(dest: str) -> str:
    """The environment variable of an option: ``PET_{DEST}`` (torch's)."""
    return f"PET_{dest.upper()}"


class EnvOption(argparse.Action):
    """An option whose default comes from ``PET_{DEST}`` when set (torch's ``env``).

    An empty variable counts as unset. A value from the environment goes
    through the option's ``type`` like one on the command line (argparse does
    that for str defaults), so give options with ``choices`` a
    :func:`one_of` type: argparse checks ``choices`` for the command line only.
    """

    def __init__(self, dest: str, default: Any = None, required: bool = False, **kw: Any) -> None:
        default = os.environ.get(env_name(dest)) or default
        if default:
            required = False
        super().__init__(dest=dest, default=default, required=required, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        # which options the command line gave (Slurm's defaults fill the others)
        given = getattr(namespace, GIVEN, None)
        if given is None:
            given = set()
            setattr(namespace, GIVEN, given)
        given.add(self.dest)


class BadEnvironment(ValueError):
    """A ``PET_*`` variable that cannot be read (raised while the parser is built)."""


class EnvFlag(argparse.Action):
    """A flag that is also on when ``PET_{DEST}`` is a non-zero int (torch's ``check_env``)."""

    def __init__(self, dest: str, default: bool = False, **kw: Any) -> None:
        value = os.environ.get(env_name(dest)) or ("1" if default else "0")
        try:
            default = bool(int(value))
        except ValueError:
            flag = next(
                (o for o in kw.get("option_strings", ()) if o.startswith("--") and "_" not in o),
                f"--{dest}",
            )
            raise BadEnvironment(
                f"${env_name(dest)}={value!r} must be an integer: 1 (or any non-zero) turns "
                f"{flag} on, 0 off; fix or unset it"
            ) from None
        super().__init__(dest=dest, const=True, default=default, nargs=0, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.const)


def one_of(dest: str, choices: Sequence[str]) -> Callable[[str], str]:
    """A ``type`` that checks ``choices`` (from the command line or ``PET_{DEST}``)."""

    def check(value: str) -> str:
        if value not in choices:
            source = f" (from ${env_name(dest)})" if os.environ.get(env_name(dest)) == value else ""
            raise argparse.ArgumentTypeError(
                f"invalid choice {value!r}{source}; choose from {', '.join(choices)}"
            )
        return value

    return check


def comma_list(value: str) -> list[str]:
    # torch's parsing: ",," escapes a comma
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]
