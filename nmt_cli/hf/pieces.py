"""A folder's sentencepiece models with nmt's ids.

The ids. A Marian folder has two sentencepiece models that only cut text into pieces, and a
vocabulary (`vocab.json`, the source's and the target's when they are separate) that numbers the
pieces: EOS 0, UNK 1, PAD last, and PAD is also what the decoder starts from. nmt numbers pieces
by its sentencepiece models, PAD 0, UNK 1, BOS 2, EOS 3 (vocab.py). So the import writes each
side's sentencepiece model again with nmt's specials first and every other piece after them, in
their order and with their scores (the pieces a text is cut into stay the same), and gathers the
embedding rows and output biases by piece:

- a source piece the vocabulary lacks is UNK's row, as Marian's tokenizer makes it UNK;
- the target's model also holds every piece of the vocabulary that its sentencepiece model lacks,
  as an unused piece (never cut from text), so that the output scores cover Marian's whole
  vocabulary and the log-probabilities are Marian's;
- a target piece the vocabulary lacks is unused too, and its output bias is ABSENT (it is not in
  Marian's softmax), as is PAD's;
- BOS is Marian's PAD row (the decoder's start); the search never emits it, as `generate` never
  emits PAD.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from nmt_cli.errors import NmtError
from nmt_cli.hf.names import SPECIALS
from nmt_cli.vocab import BOS, EOS, PAD, UNK


def spm_proto(data: bytes, where: Path):
    from sentencepiece import sentencepiece_model_pb2 as pb  # needs protobuf: '.[huggingface]'

    proto = pb.ModelProto()  # type: ignore[attr-defined]  # generated at import
    try:
        proto.ParseFromString(data)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
        raise NmtError(f"{where} is not a sentencepiece model ({type(e).__name__})") from None
    if not proto.pieces:
        raise NmtError(f"{where} is not a sentencepiece model (it has no pieces)")
    return proto


def require_protobuf() -> None:
    try:
        from sentencepiece import sentencepiece_model_pb2  # noqa: F401
    except ImportError:
        raise NmtError(
            "the Hugging Face format needs protobuf: pip install 'nmt-cli[huggingface]' "
            "(or pip install protobuf)"
        ) from None


@dataclass
class Side:
    """One side's sentencepiece model rewritten with nmt's ids, and for each of its ids the
    Marian row it takes (-1: none, a zero row) and whether it is outside the softmax."""

    model: bytes
    rows: list[int]
    absent: list[bool]


def renumbered(spm: bytes, where: Path, vocab: dict[str, int], special_rows: list[int], target: bool) -> Side:
    """`spm` with nmt's specials at 0-3 (their Marian rows `special_rows`) and its other pieces
    after them; the target's also with the pieces of `vocab` it lacks, unused."""
    proto = spm_proto(spm, where)
    t = type(proto.pieces[0])
    normal, unknown, control, user, unused = t.NORMAL, t.UNKNOWN, t.CONTROL, t.USER_DEFINED, t.UNUSED
    own = [p for p in proto.pieces if p.type in (normal, user, unused, t.BYTE) and p.piece not in SPECIALS]
    listed = {p.piece for p in own}
    rows, absent = list(special_rows), [r < 0 for r in special_rows]
    absent[UNK] = False
    pieces = [(s, 0.0, kind) for s, kind in zip(SPECIALS, (control, unknown, control, control))]
    for p in own:
        row = vocab.get(p.piece)
        kind = p.type
        if target and row is None and kind in (normal, user):
            kind = unused  # Marian cannot emit it: never cut from target text either
        pieces.append((p.piece, p.score, kind))
        rows.append(special_rows[UNK] if row is None else row)
        absent.append(row is None and target)
    # A language tag (`>>deu<<`) is a piece of the vocabulary the tokenizer takes whole from the
    # start of the source; a user-defined piece is taken whole wherever it is. With the word
    # boundary sentencepiece puts before the line's first word: one piece, as Marian's.
    for piece, row in vocab.items():
        tag = re.fullmatch(r">>[^<>\s]+<<", piece) is not None
        if piece in listed or piece in SPECIALS or (tag and "\u2581" + piece in listed):
            continue  # (an export's vocab.json lists a tag both ways)
        if target:
            pieces.append((piece, 0.0, unused))
        elif tag:
            pieces.append(("\u2581" + piece, 0.0, user))
        else:
            continue
        rows.append(row)
        absent.append(False)
    return Side(rebuilt(proto, pieces, spm), rows, absent)


def rebuilt(proto, pieces: list[tuple[str, float, int]], spm: bytes) -> bytes:
    """The sentencepiece model `proto` (read from `spm`) holding `pieces` (piece, score,
    type), nmt's specials first."""
    ts = proto.trainer_spec
    if [(p.piece, p.score, p.type) for p in proto.pieces] == pieces and (
        ts.pad_id,
        ts.unk_id,
        ts.bos_id,
        ts.eos_id,
    ) == (PAD, UNK, BOS, EOS):
        return spm  # nmt's own (an export's): the same file
    del proto.pieces[:]
    for piece, score, kind in pieces:
        proto.pieces.add(piece=piece, score=score, type=kind)
    ts.pad_id, ts.unk_id, ts.bos_id, ts.eos_id = PAD, UNK, BOS, EOS
    ts.pad_piece, ts.unk_piece, ts.bos_piece, ts.eos_piece = SPECIALS
    ts.vocab_size = len(pieces)
    return proto.SerializeToString()
