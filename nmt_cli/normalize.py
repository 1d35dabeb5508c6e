"""The one normalisation of text, for training data (`nmt prep`) and for what is translated."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

_rules_of: dict = {}  # each language's


def normalize(line: str, lang: str) -> str:
    """Moses punctuation normalisation, non-printing characters to spaces, single spaces."""
    rules = _rules_of.get(lang)
    if rules is None:
        rules = _rules_of[lang] = _rules(_punct_normalizer()(lang=lang))
    for sub, replacement in rules:
        line = sub(replacement, line)
    line = line.strip()
    if not line.isprintable():  # fast path: most lines have nothing to remove
        # As Moses' remove-non-printing-char.perl: every \p{C} code point becomes a space.
        line = "".join(" " if unicodedata.category(c)[0] == "C" else c for c in line)
    return " ".join(line.split())


def _rules(normalizer) -> list[tuple]:
    """sacremoses' substitutions, compiled once: its normalize() hands each pattern to re.sub on
    every line, and the lookup in re's cache of compiled patterns is much of what it costs."""
    return [(re.compile(pattern).sub, replacement) for pattern, replacement in normalizer.substitutions]


def _punct_normalizer() -> type:
    """sacremoses' MosesPunctNormalizer, its module alone where the package is not imported yet:
    the package's __init__ also imports its tokenizer, whose regular expressions take most of a
    one-line translation's start to compile, for nothing here (normalize.py imports only re,
    regex and itertools)."""
    import sys

    if "sacremoses" not in sys.modules:
        import importlib.util

        found = importlib.util.find_spec("sacremoses")  # found, not run
        if found is not None and found.submodule_search_locations:
            path = Path(list(found.submodule_search_locations)[0]) / "normalize.py"
            spec = importlib.util.spec_from_file_location("nmt_cli._moses_normalize", path)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module.MosesPunctNormalizer
    from sacremoses import MosesPunctNormalizer

    return MosesPunctNormalizer
