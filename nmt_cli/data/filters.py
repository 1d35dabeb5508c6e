"""What cleaning keeps of a training corpus (prep.py): a pair's length in English-word
equivalents in any script, the rules that drop a pair, and exact duplicates found in 8 bytes
a pair."""

from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np

from nmt_cli.config import PrepConfig


class SeenPairs:
    """Exact-duplicate detection in 8 bytes per distinct pair (a 64-bit hash in a sorted array)."""

    def __init__(self, flush_every: int = 65536):
        self.old = np.zeros(0, dtype=np.uint64)
        self.recent: set[int] = set()
        self.flush_every = flush_every

    def add(self, a: str, b: str) -> bool:
        """Record the pair; False if it was seen before."""
        h = int.from_bytes(hashlib.blake2b(f"{a}\t{b}".encode(), digest_size=8).digest(), "little")
        if h in self.recent:
            return False
        i = int(np.searchsorted(self.old, np.uint64(h)))  # a Python int would cast the array
        if i < len(self.old) and int(self.old[i]) == h:
            return False
        self.recent.add(h)
        if len(self.recent) >= self.flush_every:
            new = np.sort(np.fromiter(self.recent, dtype=np.uint64, count=len(self.recent)))
            self.old = np.insert(self.old, np.searchsorted(self.old, new), new)
            self.recent.clear()
        return True


# Scripts written without spaces between words, and how much of an English word one of their
# letters carries, from translations of the Universal Declaration of Human Rights, article 1
# (English 30 words; Chinese 40 Han characters; Japanese about 30 kanji and 50 kana; Thai
# about 95 letters besides its combining vowel and tone marks): about 0.7, 0.3 and 0.3.
UNSPACED = [
    (0x3400, 0x4DBF, 0.7),
    (0x4E00, 0x9FFF, 0.7),
    (0xF900, 0xFAFF, 0.7),
    (0x20000, 0x2FA1F, 0.7),  # Han
    (0x3040, 0x30FF, 0.3),
    (0x31F0, 0x31FF, 0.3),
    (0xFF66, 0xFF9F, 0.3),  # kana
    (0x0E00, 0x0EFF, 0.3),
    (0x1000, 0x109F, 0.3),
    (0x1780, 0x17FF, 0.3),
]  # Thai, Lao,
#                                                                  Myanmar, Khmer


# Lines without such letters (nearly all, in most corpora) are counted by their spaces alone.
_ANY_UNSPACED = re.compile("[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi, _ in UNSPACED) + "]")


def _weight(c: str) -> float:
    o = ord(c)
    for lo, hi, w in UNSPACED:
        if lo <= o <= hi:
            return 0.0 if unicodedata.category(c)[0] in "MP" else w
    return -1.0


def length(text: str) -> float:
    """Length in English-word equivalents, for any script: a space-separated token counts 1; in
    one with letters of a script written without spaces, those letters count their weight and
    the rest of the token 1 if it holds a letter or digit."""
    if not _ANY_UNSPACED.search(text):
        return len(text.split())
    n = 0.0
    for token in text.split():
        if token.isascii():
            n += 1
            continue
        weights = [_weight(c) for c in token]
        if max(weights) < 0:
            n += 1
            continue
        n += sum(w for w in weights if w > 0)
        n += any(w < 0 and c.isalnum() for w, c in zip(weights, token))
    return n


def drop_reason(a: str, b: str, config: PrepConfig) -> str | None:
    """Why `nmt prep` drops a training pair (None: it keeps it): empty, too long, unbalanced."""
    if not a or not b:
        return "empty"
    na, nb = length(a), length(b)
    if na > config.max_words or nb > config.max_words:
        return "too long"
    if na > config.max_ratio * nb or nb > config.max_ratio * na:
        return "length ratio"
    return None
