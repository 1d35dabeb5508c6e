"""The one normalisation of text, for training data (`nmt prep`) and for what is translated."""

from __future__ import annotations

import unicodedata

_normalizers: dict = {}


def normalize(line: str, lang: str) -> str:
    """Moses punctuation normalisation, non-printing characters to spaces, single spaces."""
    normalizer = _normalizers.get(lang)
    if normalizer is None:
        from sacremoses import MosesPunctNormalizer

        normalizer = _normalizers[lang] = MosesPunctNormalizer(lang=lang)
    line = normalizer.normalize(line)
    if not line.isprintable():  # fast path: most lines have nothing to remove
        # As Moses' remove-non-printing-char.perl: every \p{C} code point becomes a space.
        line = "".join(" " if unicodedata.category(c)[0] == "C" else c for c in line)
    return " ".join(line.split())
