"""The releases of the optional libraries that untrusted input reaches which fixed their last
known hole (docs/reliability.md): pyproject.toml's floors, checked again where the library is
imported, because an environment may hold an older release than pip chose."""

from __future__ import annotations

import itertools
from types import ModuleType

from nmt_cli.errors import NmtError

AIOHTTP = (3, 14, 4)  # request smuggling, decompression bombs
CTRANSLATE2 = (4, 8, 1)  # a crafted model file: a heap overflow, variables of unchecked size


def version_tuple(version: str) -> tuple[int, ...]:
    """ "3.14.4", "2.13.0+cpu", "3.15.0rc1" as (3, 14, 4), (2, 13, 0), (3, 15, 0)."""
    parts = version.split("+")[0].split(".")[:3]
    return tuple(int("".join(itertools.takewhile(str.isdigit, part)) or 0) for part in parts)


def check(name: str, installed: str, floor: tuple[int, ...], extra: str) -> None:
    """One error line if `installed` is older than `floor`."""
    if version_tuple(installed) < floor:
        at_least = ".".join(map(str, floor))
        raise NmtError(
            f"{name} {installed} has known holes: pip install '{name}>={at_least}' (or 'nmt-cli[{extra}]')"
        )


def require(name: str, shown: str, floor: tuple[int, ...], extra: str) -> ModuleType:
    """The optional library `name`, imported and at `floor` or later; one error line otherwise."""
    try:
        module = __import__(name)  # (as an import statement: -X importtime sees it)
    except ImportError:
        raise NmtError(
            f"{shown} is not installed: pip install 'nmt-cli[{extra}]' (or pip install {name})"
        ) from None
    check(name, module.__version__, floor, extra)
    return module
