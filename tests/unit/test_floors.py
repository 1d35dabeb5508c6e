"""The floors under nmt's dependencies (pyproject.toml) stand past their known advisories, what is
installed stands on them, and docs/reliability.md says what each protects."""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from nmt_cli.errors import NmtError
from nmt_cli.serve.app import AIOHTTP_FLOOR, require, version_tuple

ROOT = Path(__file__).resolve().parents[2]
# The first release past each advisory (docs/reliability.md names them).
PAST_ADVISORIES = {"torch": (2, 10), "sentencepiece": (0, 2, 1), "aiohttp": (3, 14, 4)}


def floors() -> dict[str, tuple[int, ...]]:
    text = (ROOT / "pyproject.toml").read_text()
    found = {name: version_tuple(v) for name, v in re.findall(r'"([a-z0-9-]+)>=([0-9.]+)"', text)}
    found["python"] = version_tuple(re.search(r'requires-python = ">=([0-9.]+)"', text)[1])
    return found


def test_each_floor_is_past_its_advisories_and_documented():
    found, documented = floors(), (ROOT / "docs" / "reliability.md").read_text()
    for name, past in {**PAST_ADVISORIES, "python": (3, 10, 7)}.items():
        assert found[name] >= past, name
        assert f"{name} {'.'.join(map(str, found[name]))}" in documented.lower(), name
    assert found["aiohttp"] == AIOHTTP_FLOOR  # the server's own check says the same


def test_what_is_installed_stands_on_the_floors():
    found = floors()
    assert sys.version_info[:3] >= found["python"]
    for name in PAST_ADVISORIES:
        assert version_tuple(version(name)) >= found[name], name


def test_the_server_refuses_an_aiohttp_below_the_floor(monkeypatch):
    import aiohttp

    assert require() is not None
    monkeypatch.setattr(aiohttp, "__version__", "3.9.5")
    with pytest.raises(NmtError, match=r"aiohttp 3\.9\.5 has known server-side holes"):
        require()
