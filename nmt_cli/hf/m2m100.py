"""The numbering of a published M2M100 or NLLB folder, and its one sentencepiece model with nmt's
ids.

Both number pieces as fairseq's dictionary does (<s> 0, <pad> 1, </s> 2, <unk> 3) over one
sentencepiece model shared by both sides, and put a language token first on each side: the
source's before its pieces, the target's forced after the decoder's start (</s>). M2M100 keeps
the numbering in `vocab.json` and its language tokens (`__de__`) after it, in an order its
tokenizer knows by the name `language_codes` (copied below from fairseq's lists); NLLB keeps it in
`tokenizer.json` (each sentencepiece id plus one) with its language codes (`deu_Latn`) as
added tokens. nmt's vocabulary is that sentencepiece model rewritten (pieces.rebuilt) so that
its output layer is the model's whole softmax, row for row:

- nmt's PAD, UNK and EOS are the folder's <pad>, <unk> and </s>; BOS (the decoder's start) is
  </s>'s row again, outside the softmax (its output bias ABSENT: </s> counts once, as EOS);
- a piece of the sentencepiece model the numbering lacks is unused (never cut from text) and
  ABSENT, as the model cannot emit it;
- the language tokens, and every other row the numbering names (NLLB's <mask>), are unused
  pieces under their names: never cut from text, put in by the translator as ids;
- a row nothing names (<s>, M2M100's "made-up words") is an unused piece `<hf:ROW>`, so that the
  log-probabilities are the model's own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nmt_cli.errors import NmtError
from nmt_cli.files import read_json
from nmt_cli.hf.names import SPECIALS
from nmt_cli.hf.pieces import Side, rebuilt, spm_proto
from nmt_cli.vocab import BOS, EOS, PAD, UNK

# fairseq's language lists, by the name M2M100's tokenizer_config.json gives them
M2M100_LANGUAGES = {
    "m2m100": (
        "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu "
        "ha he hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr "
        "ms my ne nl no ns oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr "
        "uk ur uz vi wo xh yi yo zh zu"
    ).split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}
NLLB_CODE = re.compile(r"[a-z]{3}_[A-Z][a-z]{3}")
MAX_TOKENIZER_BYTES = 64 << 20  # as a Marian vocab.json's bound; a published one is far smaller


@dataclass
class Numbering:
    """A folder's ids: each named piece's row, and each language's token (a name in `rows`)."""

    rows: dict[str, int]
    languages: dict[str, str]
    kind: str  # "m2m100" or "nllb"


def numbering(folder: Path, tokenizer: dict, noted: Callable[[Path], None]) -> Numbering:
    """The numbering of the M2M100 (vocab.json) or NLLB (tokenizer.json) folder `folder`;
    `tokenizer` is its tokenizer_config.json, `noted` records each file read."""
    if (folder / "vocab.json").is_file():
        rows = _rows(read_json(folder / "vocab.json", MAX_TOKENIZER_BYTES), folder / "vocab.json")
        noted(folder / "vocab.json")
        codes = tokenizer.get("language_codes", "m2m100")
        if codes not in M2M100_LANGUAGES:
            raise NmtError(
                f"{folder}/tokenizer_config.json: language_codes {codes!r:.40} is not one of fairseq's "
                f"lists ({', '.join(M2M100_LANGUAGES)})"
            )
        size = len(rows)
        languages = {code: f"__{code}__" for code in M2M100_LANGUAGES[codes]}
        rows.update({token: size + i for i, token in enumerate(languages.values())})
        return Numbering(rows, languages, "m2m100")
    if not (folder / "tokenizer.json").is_file():
        raise NmtError(
            f"{folder} is not a complete M2M100 or NLLB model: it has no vocab.json or tokenizer.json"
        )
    if tokenizer.get("legacy_behaviour"):
        raise NmtError(
            f"{folder}/tokenizer_config.json: legacy_behaviour puts the language after the source, "
            "which nmt does not read"
        )
    said = read_json(folder / "tokenizer.json", MAX_TOKENIZER_BYTES)
    noted(folder / "tokenizer.json")
    model = said.get("model") if isinstance(said.get("model"), dict) else {}
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # a Unigram model's: [piece, score] by id
        vocab = {entry[0]: i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry}
    rows = _rows(vocab, folder / "tokenizer.json")
    for added in said.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("content"), str) and type(added.get("id")) is int:
            rows[added["content"]] = added["id"]
    languages = {piece: piece for piece in rows if NLLB_CODE.fullmatch(piece)}
    if not languages:
        raise NmtError(f"{folder}/tokenizer.json names no language codes (like eng_Latn)")
    return Numbering(_rows(rows, folder / "tokenizer.json"), languages, "nllb")


def _rows(vocab: object, where: Path) -> dict[str, int]:
    if not isinstance(vocab, dict) or not all(type(v) is int and v >= 0 for v in vocab.values()):
        raise NmtError(f"{where} holds no vocabulary (piece: id)")
    for special in ("<pad>", "<unk>", "</s>"):
        if special not in vocab:
            raise NmtError(f"{where} has no {special}")
    return dict(vocab)


def renumbered(spm: bytes, where: Path, numbering: Numbering, start: int, size: int) -> Side:
    """The folder's sentencepiece model `spm` with nmt's ids over the model's `size` output rows
    (`start`: the decoder's start, </s>), as the module's docstring says."""
    proto = spm_proto(spm, where)
    t = type(proto.pieces[0])
    rows_of = numbering.rows
    specials = [rows_of["<pad>"], rows_of["<unk>"], start, rows_of["</s>"]]
    pieces = [(s, 0.0, kind) for s, kind in zip(SPECIALS, (t.CONTROL, t.UNKNOWN, t.CONTROL, t.CONTROL))]
    rows, absent = list(specials), [False, False, True, False]  # BOS: EOS's row, counted once
    for p in proto.pieces:
        if p.type not in (t.NORMAL, t.USER_DEFINED, t.UNUSED, t.BYTE) or p.piece in SPECIALS:
            continue
        row = rows_of.get(p.piece)
        pieces.append((p.piece, p.score, p.type if row is not None else t.UNUSED))
        rows.append(rows_of["<unk>"] if row is None else row)
        absent.append(row is None)
    named = {piece for piece, _, _ in pieces}
    covered = {r for r, out in zip(rows, absent) if not out}
    for piece, row in sorted(rows_of.items(), key=lambda x: x[1]):
        if piece in named or row in covered or piece in SPECIALS:
            continue
        pieces.append((piece, 0.0, t.UNUSED))
        rows.append(row)
        absent.append(False)
        covered.add(row)
    for row in range(size):
        if row not in covered:
            pieces.append((f"<hf:{row}>", 0.0, t.UNUSED))
            rows.append(row)
            absent.append(False)
    if max(rows) >= size:
        raise NmtError(f"{where}: its numbering reaches row {max(rows)} of a model of {size} rows")
    assert rows[PAD] >= 0 and rows[UNK] >= 0 and rows[BOS] == rows[EOS] == start
    return Side(rebuilt(proto, pieces, spm), rows, absent)
