"""The floors under nmt's dependencies (pyproject.toml) stand past their known advisories, what is
installed stands on them, and docs/reliability.md says what each protects."""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from nmt_cli import floors as floors_of
from nmt_cli.errors import NmtError
from nmt_cli.floors import version_tuple
from nmt_cli.inference.ct2_spec import require_ctranslate2
from nmt_cli.serve.app import require

ROOT = Path(__file__).resolve().parents[2]
# The first release past each advisory (docs/reliability.md names them).
PAST_ADVISORIES = {
    "torch": (2, 10),
    "sentencepiece": (0, 2, 1),
    "aiohttp": (3, 14, 4),
    "ctranslate2": (4, 8, 1),
}


def floors() -> dict[str, tuple[int, ...]]:
    """Each dependency's floor in pyproject.toml, the lowest where it is named more than once
    (in an extra and in the tests')."""
    text = (ROOT / "pyproject.toml").read_text()
    found: dict[str, tuple[int, ...]] = {}
    for name, v in re.findall(r'"([a-z0-9-]+)>=([0-9.]+)"', text):
        found[name] = min(found.get(name, version_tuple(v)), version_tuple(v))
    found["python"] = version_tuple(re.search(r'requires-python = ">=([0-9.]+)"', text)[1])
    return found


def test_each_floor_is_past_its_advisories_and_documented():
    found, documented = floors(), (ROOT / "docs" / "reliability.md").read_text()
    for name, past in {**PAST_ADVISORIES, "python": (3, 10, 7)}.items():
        assert found[name] >= past, name
        assert f"{name} {'.'.join(map(str, found[name]))}" in documented.lower(), name
    # the checks where they are imported say the same
    assert (found["aiohttp"], found["ctranslate2"]) == (floors_of.AIOHTTP, floors_of.CTRANSLATE2)


def test_what_is_installed_stands_on_the_floors():
    found = floors()
    assert sys.version_info[:3] >= found["python"]
    for name in PAST_ADVISORIES:
        assert version_tuple(version(name)) >= found[name], name


def test_the_server_refuses_an_aiohttp_below_the_floor(monkeypatch):
    import aiohttp

    assert require() is not None
    monkeypatch.setattr(aiohttp, "__version__", "3.9.5")
    with pytest.raises(NmtError, match=r"^aiohttp 3\.9\.5 has known holes: pip install 'aiohttp>=3\.14\.4'"):
        require()


def test_a_ctranslate2_below_the_floor_is_refused_before_it_reads_a_model(monkeypatch):
    import ctranslate2

    assert require_ctranslate2() is ctranslate2
    monkeypatch.setattr(ctranslate2, "__version__", "4.8.0")
    refused = r"^ctranslate2 4\.8\.0 has known holes: pip install 'ctranslate2>=4\.8\.1'"
    with pytest.raises(NmtError, match=refused):
        require_ctranslate2()
